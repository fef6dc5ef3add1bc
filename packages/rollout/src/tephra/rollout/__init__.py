"""tephra.rollout: generation backends (hf, vllm, sglang) behind one contract."""

from tephra.rollout.base import (
    DEFAULT_ADAPTER,
    HFSettings,
    Rollout,
    RolloutConfig,
    RolloutError,
    RolloutOutput,
    SamplingParams,
    ServerDiedError,
    ServerLaunch,
    ServerSettings,
)
from tephra.rollout.registry import ROLLOUT_BACKENDS, get_rollout
from tephra.rollout.samples import RewardResult, Sample, to_batch

__all__ = [
    "DEFAULT_ADAPTER",
    "ROLLOUT_BACKENDS",
    "HFSettings",
    "RewardResult",
    "Rollout",
    "RolloutConfig",
    "RolloutError",
    "RolloutOutput",
    "Sample",
    "SamplingParams",
    "ServerDiedError",
    "ServerLaunch",
    "ServerSettings",
    "get_rollout",
    "to_batch",
]
