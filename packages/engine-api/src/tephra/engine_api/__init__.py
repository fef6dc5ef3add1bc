"""tephra.engine_api: the engine contract every training backend implements."""

from tephra.engine_api.batch import make_batch, pack, split_by_token_budget, unpack, validate_batch
from tephra.engine_api.config import (
    EngineConfig,
    LoraConfig,
    MicroBatchConfig,
    ModelConfig,
    OffloadConfig,
    OptimizerConfig,
    ParallelConfig,
    PrecisionConfig,
    SchedulerConfig,
    apply_overrides,
)
from tephra.engine_api.engine import Engine
from tephra.engine_api.errors import BatchError, CheckpointError, ConfigError, RegistryError, TephraError
from tephra.engine_api.loss import LossFn
from tephra.engine_api.registry import Registry, get_engine, get_engine_class, installed_engines

__all__ = [
    "BatchError", "CheckpointError", "ConfigError", "Engine", "EngineConfig", "LoraConfig",
    "LossFn", "MicroBatchConfig", "ModelConfig", "OffloadConfig", "OptimizerConfig",
    "ParallelConfig", "PrecisionConfig", "Registry", "RegistryError", "SchedulerConfig",
    "TephraError", "apply_overrides", "get_engine", "get_engine_class", "installed_engines",
    "make_batch", "pack", "split_by_token_budget", "unpack", "validate_batch",
]
