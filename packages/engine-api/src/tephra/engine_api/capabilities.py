"""The optional parts of the engine contract, which a backend declares it implements."""

from __future__ import annotations

from enum import StrEnum


class Capability(StrEnum):
    """An optional part of the `Engine` contract. A backend lists the ones it implements in
    `Engine.capabilities`; for the others the contract's default refuses with a
    `ConfigError` naming the option (`Engine.check_config`) or the method."""

    LORA = "lora"
    """LoRA adapters (`lora.rank > 0`): `reference_mode()` runs the base model with the
    adapters off, `export_adapter(path)` writes the adapter alone as a peft folder and
    `export_adapter_weights()` hands it over in memory (adapter-only weight sync), and
    `load_adapter_weights(adapter)` takes one back with a fresh optimizer (a weights-only
    restore)."""
    OPTIMIZER_PARAMS = "optimizer_params"
    """Per-step optimizer settings (`set_optimizer_params`): the learning rate, Adam's betas
    and epsilon, weight decay and the clipping norm change between optimizer steps, as a
    caller that drives the steps one by one (the Tinker-compatible server) asks."""
