"""tephra.rollout: generation backends (hf, vllm, sglang) behind one contract."""

from tephra.rollout.base import (
    Generation,
    HFSettings,
    Rollout,
    RolloutConfig,
    RolloutError,
    RolloutOutput,
    SamplingParams,
    ServerDiedError,
    ServerSettings,
)
from tephra.rollout.registry import ROLLOUT_BACKENDS, get_rollout

__all__ = [
    "ROLLOUT_BACKENDS",
    "Generation",
    "HFSettings",
    "Rollout",
    "RolloutConfig",
    "RolloutError",
    "RolloutOutput",
    "SamplingParams",
    "ServerDiedError",
    "ServerSettings",
    "get_rollout",
]
