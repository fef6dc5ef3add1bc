"""Config validation names the field, the value and the fix; overrides are checked."""

from __future__ import annotations

import pytest

from tephra.engine_api.config import EngineConfig, ModelConfig, apply_overrides
from tephra.engine_api.errors import ConfigError


def cfg(**kw):
    return EngineConfig(model=ModelConfig(hf_config={"model_type": "qwen2"}), **kw)


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: ModelConfig(), "set exactly one of model.path"),
        (lambda: ModelConfig(path="x", hf_config={"model_type": "a"}), "set exactly one"),
        (lambda: ModelConfig(hf_config={}), "model.hf_config must hold 'model_type'"),
        (
            lambda: ModelConfig(path="x", role="critic"),
            r"model.role='critic' is not allowed; choose one of \['policy', 'value'\]",
        ),
        (lambda: cfg(optimizer={"lr": -1}), r"optimizer.lr=-1.0 must be > 0"),
        (lambda: cfg(optimizer={"betas": [0.9, 1.5]}), "optimizer.betas"),
        (
            lambda: cfg(scheduler={"name": "cosine", "warmup_steps": 5}),
            "scheduler.total_steps=0 must be > scheduler.warmup_steps=5",
        ),
        (
            lambda: cfg(micro_batch={"max_tokens_per_microbatch": 0}),
            "micro_batch.max_tokens_per_microbatch=0",
        ),
        (lambda: cfg(precision={"param_dtype": "fp8"}), "precision.param_dtype='fp8'"),
        (lambda: cfg(parallel={"sequence_parallel": True}), "needs parallel.tensor > 1"),
        (
            lambda: cfg(micro_batch={"max_token_per_microbatch": 5}),
            "did you mean 'max_tokens_per_microbatch'",
        ),
        (lambda: cfg(temperature=0), "engine.temperature=0 must be > 0"),
    ],
)
def test_bad_values_are_refused_with_the_field_named(build, message):
    with pytest.raises(ConfigError, match=message):
        build()


def test_dict_sections_become_dataclasses_and_overrides_apply():
    c = cfg(micro_batch={"max_tokens_per_microbatch": 64}, lora={"rank": 8})
    assert c.micro_batch.max_tokens_per_microbatch == 64 and c.lora.enabled
    d = apply_overrides(c, {"micro_batch.use_packing": False, "optimizer.lr": 0.1, "seed": 3})
    assert (d.micro_batch.use_packing, d.optimizer.lr, d.seed) == (False, 0.1, 3)
    assert c.micro_batch.use_packing is None  # the original is untouched (None: the engine picks)
    with pytest.raises(ConfigError, match="unknown config key 'optimiser'"):
        apply_overrides(c, {"optimiser.lr": 1})


def test_parallel_sizes_divide_the_world():
    c = cfg(parallel={"tensor": 2, "pipeline": 2})
    assert c.parallel.data_parallel_size(8) == 2
    with pytest.raises(ConfigError, match="world size 6 is not divisible"):
        c.parallel.data_parallel_size(6)
