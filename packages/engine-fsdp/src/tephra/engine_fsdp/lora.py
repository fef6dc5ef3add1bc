"""LoRA through peft: wrap the model, freeze the base, and name the merged weights.

The update of an adapted linear layer is W' = W + (alpha / rank) * B @ A
(A: [rank, in], B: [out, rank]; peft's `scaling`). Only A and B train (plus the value head
of a critic, which has no base weights to start from). With the adapters disabled the model
is exactly the base model: that is the reference policy, without a second copy in memory.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import torch
from transformers import PreTrainedModel

from tephra.engine_api.config import LoraConfig
from tephra.engine_api.errors import ConfigError
from tephra.engine_api.multimodal import is_vision_config, vision_family
from tephra.engine_fsdp.model_builder import VALUE_HEAD

if TYPE_CHECKING:
    from peft import PeftModel

ADAPTER = "default"
_LORA_PARAM = re.compile(r"\.lora_(A|B)\." + ADAPTER + r"\.weight$")


def apply_lora(model: PreTrainedModel, cfg: LoraConfig, role: str, seed: int) -> PeftModel:
    """Inject adapters into `model` (in place) and return the peft wrapper.

    Adapter initialisation (A random, B zero) is drawn from `seed` so every rank builds the
    same adapters without touching the global RNG stream.
    """
    # imported here: peft takes seconds to import and only LoRA runs need it
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    excluded = [VALUE_HEAD] if role == "value" else []
    if cfg.vision == "frozen" and is_vision_config(model.config):
        # the vision tower (any depth; LLaVA's projector too); get_peft_model freezes it
        excluded += vision_family(model.config).tower_modules
    peft_cfg = PeftLoraConfig(
        r=cfg.rank,
        # peft annotates lora_alpha `int` but divides it (scaling = lora_alpha / r): a float
        # alpha is what it computes with
        lora_alpha=cfg.alpha,  # type: ignore[arg-type]
        lora_dropout=cfg.dropout,
        target_modules=cfg.target_modules,
        # a regex, full-matched against each module's dotted name
        exclude_modules=rf".*\b({'|'.join(excluded)})\b.*" if excluded else None,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            peft_model = get_peft_model(model, peft_cfg)
        except ValueError as exc:
            raise ConfigError(f"lora.target_modules={cfg.target_modules!r}: {exc}") from exc
    if role == "value":
        # the critic's head is new: it must train even though the backbone is frozen
        for p in getattr(model, VALUE_HEAD).parameters():
            p.requires_grad_(True)
    return peft_model


def is_adapter_param(name: str) -> bool:
    return _LORA_PARAM.search(name) is not None


def base_name(name: str) -> str:
    """`...q_proj.base_layer.weight` -> `...q_proj.weight` (plain HF naming)."""
    return name.replace(".base_layer.", ".")


def adapter_names(name: str) -> tuple[str, str] | None:
    """For a base weight inside an adapted layer, the names of its A and B matrices."""
    if not name.endswith(".base_layer.weight"):
        return None
    prefix = name[: -len(".base_layer.weight")]
    return f"{prefix}.lora_A.{ADAPTER}.weight", f"{prefix}.lora_B.{ADAPTER}.weight"


def lora_scaling(model: PreTrainedModel, name: str) -> float:
    """alpha / rank of the adapted layer owning base weight `name`."""
    # peft: imported here as above (loaded already once a model holds adapters)
    from peft.tuners.lora import LoraLayer

    owner = name[: -len(".base_layer.weight")]
    module = model.get_submodule(owner)
    if not isinstance(module, LoraLayer):
        raise ValueError(f"{owner!r} is not a LoRA layer (base weight name {name!r})")
    return float(module.scaling[ADAPTER])
