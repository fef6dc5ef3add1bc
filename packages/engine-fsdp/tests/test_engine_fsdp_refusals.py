"""What engine-fsdp does not support is refused with a ConfigError naming the field, before
anything is built where the config alone tells (check_config), else at build."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from tephra.engine_api.config import EngineConfig, ModelConfig
from tephra.engine_api.errors import ConfigError
from tephra.engine_fsdp.engine import FSDPEngine, flex_attention_refusal
from tephra.engine_fsdp.sharding import release_process_group

TINY = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=2,
)


@pytest.mark.parametrize(
    "section, message",
    [
        ({"parallel": {"tensor": 2}}, r"parallel.tensor=2: engine=fsdp has data and sequence"),
        ({"parallel": {"context": 3}}, r"parallel.context=3 must divide the world size 2"),
        ({"parallel": {"moe_token_dispatcher": "allgather"}}, r"moe_token_dispatcher='allgather'"),
    ],
)
def test_check_config_refuses_before_building(section, message):
    config = EngineConfig(model=ModelConfig(hf_config={"model_type": "qwen2", **TINY}), **section)
    with pytest.raises(ConfigError, match=message):
        FSDPEngine.check_config(config, world_size=2)


def test_flex_attention_on_cpu_scores_but_refuses_to_train():
    """torch's flex attention has no backward on CPU: the engine's forward runs (log-probs for
    a reference) and `forward_backward` is one ConfigError naming the fix, not torch's
    NotImplementedError from inside the attention (where torch's CPU flex attention returns
    NaN, on AVX2 kernels, the engine refuses it at build instead)."""
    model = ModelConfig(
        hf_config={"model_type": "qwen2", **TINY}, attn_implementation="flex_attention"
    )
    config = EngineConfig(model=model, device="cpu")
    ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]])
    batch = TensorDict(
        {
            "input_ids": ids,
            "attention_mask": torch.ones_like(ids),
            "position_ids": torch.arange(8)[None],
            "response_mask": torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1]]),
        },
        batch_size=[1],
    )
    try:
        if flex_attention_refusal(config, torch.device("cpu")):
            with pytest.raises(ConfigError, match="returns NaN"):
                FSDPEngine.build(config)
            return
        engine = FSDPEngine.build(config)
        with engine.eval_mode():
            log_probs = engine.forward(batch)["log_probs"]
        assert log_probs.shape == (1, 8) and bool(torch.isfinite(log_probs).all())
        with pytest.raises(
            ConfigError,
            match=r"^model\.attn_implementation='flex_attention' on CPU trains nothing.*use model\.attn_implementation=sdpa",
        ):
            engine.forward_backward(batch, lambda out, b: (out["log_probs"].sum(), {}))
    finally:
        release_process_group()
