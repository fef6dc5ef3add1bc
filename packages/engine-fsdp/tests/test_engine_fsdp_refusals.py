"""What engine-fsdp does not support is refused with a ConfigError naming the field, before
anything is built where the config alone tells (check_config), else at build."""

from __future__ import annotations

import pytest

from tephra.engine_api.config import EngineConfig, ModelConfig
from tephra.engine_api.errors import ConfigError
from tephra.engine_fsdp.engine import FSDPEngine
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


def test_output_bias_is_refused():
    # phi's lm_head has a bias: the config does not say so, the built model does
    phi = ModelConfig(hf_config={"model_type": "phi", **TINY})
    try:
        with pytest.raises(ConfigError, match=r"the output head has a bias"):
            FSDPEngine.build(EngineConfig(model=phi, device="cpu"))
    finally:
        release_process_group()
