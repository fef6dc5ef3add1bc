"""engine-megatron refuses vision-language models (and engine-fsdp-only options) in
check_config, before building."""

from __future__ import annotations

import json

import pytest

from tephra.engine_api import ConfigError, EngineConfig
from tephra.engine_megatron.engine import MegatronEngine


def test_vlm_folder_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "qwen2_vl", "vision_config": {"depth": 1}, "text_config": {}})
    )
    with pytest.raises(ConfigError, match="vision-language model .* use engine=fsdp"):
        MegatronEngine.check_config(EngineConfig(model={"path": str(tmp_path)}))


def test_vlm_hf_config_is_refused():
    cfg = EngineConfig(
        model={"hf_config": {"model_type": "qwen2_vl", "vision_config": {"depth": 1}}}
    )
    with pytest.raises(ConfigError, match="not supported by engine-megatron"):
        MegatronEngine.check_config(cfg)


def test_forced_prefix_sharing_is_refused():
    # an engine-fsdp option: refused here rather than silently ignored
    cfg = EngineConfig(
        model={"hf_config": {"model_type": "qwen2"}}, micro_batch={"share_prefix": True}
    )
    with pytest.raises(ConfigError, match="micro_batch.share_prefix=true is an engine-fsdp"):
        MegatronEngine.check_config(cfg)
