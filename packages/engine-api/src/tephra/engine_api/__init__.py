"""tephra.engine_api: the engine contract every training backend implements.

Names are imported lazily, so that `from tephra.engine_api.registry import Registry` (used
by light processes such as reward workers) does not pay for importing torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "make_batch": "batch",
    "pack": "batch",
    "split_by_token_budget": "batch",
    "unpack": "batch",
    "validate_batch": "batch",
    "LoraAdapter": "adapters",
    "Capability": "capabilities",
    "EngineConfig": "config",
    "EngineSections": "config",
    "LoraConfig": "config",
    "MoEConfig": "config",
    "MicroBatchConfig": "config",
    "ModelConfig": "config",
    "OffloadConfig": "config",
    "OptimizerConfig": "config",
    "ParallelConfig": "config",
    "PrecisionConfig": "config",
    "SchedulerConfig": "config",
    "apply_overrides": "config",
    "Engine": "engine",
    "BatchError": "errors",
    "CheckpointError": "errors",
    "ConfigError": "errors",
    "RegistryError": "errors",
    "TephraError": "errors",
    "EXTRA_FORWARD_OUTPUTS": "forward_outputs",
    "check_extra_outputs": "forward_outputs",
    "LossFn": "loss",
    "Registry": "registry",
    "get_engine": "registry",
    "get_engine_class": "registry",
    "installed_engines": "registry",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'tephra.engine_api' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"tephra.engine_api.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value
