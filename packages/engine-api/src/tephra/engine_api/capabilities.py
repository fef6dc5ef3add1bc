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
    `export_adapter_weights()` hands it over in memory (adapter-only weight sync)."""
