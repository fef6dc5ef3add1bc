"""Adapter-only sync on a real vLLM CPU server (`--enable-lora`, `/v1/load_lora_adapter`),
compared with the `hf` backend serving the same adapter (itself checked against peft's
`merge_and_unload` in tests/test_lora_sync.py). Skipped where vLLM cannot run (an AVX2-only
CPU), as the other vLLM tests are."""

from __future__ import annotations

import pytest
import torch

from tephra.engine_api.adapters import PEFT_PREFIX, LoraAdapter
from tephra.rollout import RolloutConfig, SamplingParams, ServerSettings, get_rollout

pytestmark = [pytest.mark.vllm, pytest.mark.multiproc]

PROMPTS = [[5, 6, 7], [10, 20, 30, 40, 50, 60, 70], [100]]


def random_adapter(model: torch.nn.Module, seed: int, rank: int = 4) -> LoraAdapter:
    """A rank-`rank` adapter on every q_proj / v_proj of `model`, large enough to move the
    greedy tokens."""
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, module in model.named_modules():
        if name.endswith(("q_proj", "v_proj")):
            out_features, in_features = module.weight.shape
            tensors[f"{PEFT_PREFIX}{name}.lora_A.weight"] = torch.randn(
                rank, in_features, generator=g
            )
            tensors[f"{PEFT_PREFIX}{name}.lora_B.weight"] = 0.3 * torch.randn(
                out_features, rank, generator=g
            )
    return LoraAdapter(rank, 8.0, tensors)


def test_vllm_serves_each_adapter_as_hf_does(tiny_model, vllm_python):
    config = RolloutConfig(
        model_path=tiny_model.path,
        max_model_len=512,
        max_lora_rank=4,
        vllm=ServerSettings(python=vllm_python, startup_timeout_s=300, request_timeout_s=120),
    )
    vllm, hf = get_rollout("vllm", config), get_rollout("hf", config)
    try:
        sampling = SamplingParams(temperature=0.0, max_tokens=12)
        base = vllm.generate(PROMPTS, sampling)
        for seed in (1, 2):  # the second replaces the first (a new name; the old unloaded)
            adapter = random_adapter(hf.model, seed)
            vllm.update_adapter(adapter)
            hf.update_adapter(adapter)
            a, b = vllm.generate(PROMPTS, sampling), hf.generate(PROMPTS, sampling)
            assert vllm.adapter == f"tephra-lora-{seed}"
            assert a.response_ids == b.response_ids
            for x, y in zip(a.log_probs, b.log_probs, strict=True):
                torch.testing.assert_close(torch.tensor(x), torch.tensor(y), atol=1e-4, rtol=0)
        assert a.response_ids != base.response_ids  # the adapter changed the policy
    finally:
        vllm.close()
        hf.close()
