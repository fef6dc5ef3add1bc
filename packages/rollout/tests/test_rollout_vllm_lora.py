"""Adapter-only sync on a real vLLM CPU server (`--enable-lora`, `/v1/load_lora_adapter`),
compared with the `hf` backend serving the same adapter(s): the default one, then a second
named one beside it on the same server (itself checked against peft's
`merge_and_unload` in tests/test_lora_sync.py). Skipped where vLLM cannot run (an AVX2-only
CPU), as the other vLLM tests are."""

from __future__ import annotations

import asyncio

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
        max_loras=2,
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

        # a second run's adapter beside the default one (`--max-loras 2`): each request
        # samples through the adapter it names, as hf does, also when the two share a batch
        for seed in (3, 4):  # run 2's second sync replaces its first
            adapter = random_adapter(hf.model, seed)
            vllm.update_adapter(adapter, name="run2")
            hf.update_adapter(adapter, name="run2")
        assert vllm.adapters == {"default": "tephra-lora-2", "run2": "tephra-lora-run2-4"}
        run2 = sampling.replace(adapter="run2")
        a2, b2 = vllm.generate(PROMPTS, run2), hf.generate(PROMPTS, run2)
        assert a2.response_ids == b2.response_ids and a2.response_ids != a.response_ids
        for x, y in zip(a2.log_probs, b2.log_probs, strict=True):
            torch.testing.assert_close(torch.tensor(x), torch.tensor(y), atol=1e-4, rtol=0)

        async def mixed():
            return await asyncio.gather(
                *(vllm.agenerate(prompt, s) for prompt in PROMPTS for s in (sampling, run2))
            )

        got = asyncio.run(mixed())
        want = [out.samples[i] for i in range(len(PROMPTS)) for out in (a, a2)]
        assert [g.response_ids for g in got] == [w.response_ids for w in want]
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(
                torch.tensor(g.log_probs), torch.tensor(w.log_probs), atol=1e-4, rtol=0
            )
    finally:
        vllm.close()
        hf.close()
