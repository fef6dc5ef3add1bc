"""Read the Hugging Face model an `EngineConfig.model` names: its config and full weights."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch
import transformers
from transformers import PretrainedConfig, PreTrainedModel

from tephra.engine_api.config import ModelConfig
from tephra.engine_api.errors import ConfigError

T = TypeVar("T")


def hf_config_of(model: ModelConfig) -> PretrainedConfig:
    if model.path is not None:
        folder = Path(model.path)
        if not (folder / "config.json").is_file():
            raise ConfigError(
                f"model.path={model.path!r} is not a Hugging Face folder (no "
                "config.json); point it at a folder written by save_pretrained"
            )
        return transformers.AutoConfig.from_pretrained(
            folder, trust_remote_code=model.trust_remote_code
        )
    assert model.hf_config is not None  # ModelConfig holds exactly one of path and hf_config
    data = dict(model.hf_config)
    return transformers.AutoConfig.for_model(data.pop("model_type"), **data)


def load_hf(
    model: ModelConfig, adapt: Callable[[PreTrainedModel], T] | None = None
) -> tuple[PretrainedConfig, dict[str, torch.Tensor], str | None, T | None]:
    """(hf_config, full state dict in float32 with transformers' names, tokenizer folder,
    what `adapt` returns for the loaded transformers model: called after the state is taken,
    it may change the model, e.g. wrap it in peft's adapters; None without `adapt`).

    From `model.hf_config` the weights are transformers' own random initialisation under
    `torch.manual_seed(model.init_seed)`, so a plain transformers model built the same way
    holds identical weights (the single-process reference of the tests)."""
    cfg = hf_config_of(model)
    hf: PreTrainedModel
    if model.path is not None:
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            model.path, dtype=torch.float32, trust_remote_code=model.trust_remote_code
        )
    else:
        hf = reference_model(cfg, model.init_seed)
    state = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    extra = adapt(hf) if adapt is not None else None
    return cfg, state, model.tokenizer_path or model.path, extra


def reference_model(cfg: PretrainedConfig, init_seed: int) -> PreTrainedModel:
    """A transformers causal LM from `cfg` with the seeded initialisation (float32, eager
    attention so that it runs anywhere)."""
    torch.manual_seed(init_seed)
    cfg._attn_implementation = "eager"
    model: PreTrainedModel = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    return model
