"""engine-megatron refuses vision-language models in check_config (before building)."""

from __future__ import annotations

import json

import pytest

from tephra.engine_api import ConfigError, EngineConfig
from tephra.engine_megatron.engine import MegatronEngine


def test_vlm_folder_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "qwen2_vl", "vision_config": {"depth": 1}, "text_config": {}}))
    with pytest.raises(ConfigError, match="vision-language model .* use engine=fsdp"):
        MegatronEngine.check_config(EngineConfig(model={"path": str(tmp_path)}))


def test_vlm_hf_config_is_refused():
    cfg = EngineConfig(model={"hf_config": {"model_type": "qwen2_vl", "vision_config": {"depth": 1}}})
    with pytest.raises(ConfigError, match="not supported by engine-megatron"):
        MegatronEngine.check_config(cfg)
