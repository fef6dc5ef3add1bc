"""The rollout backend registry: each built-in backend listed by name, and `get_rollout`."""

from __future__ import annotations

from tephra.engine_api.registry import Registry
from tephra.rollout.backends.hf import HFRollout
from tephra.rollout.backends.sglang import SglangRollout
from tephra.rollout.backends.vllm import VllmRollout
from tephra.rollout.base import Rollout, RolloutConfig

ROLLOUT_BACKENDS: Registry[type[Rollout]] = Registry("rollout backend")
"""Backends by name: `hf`, `vllm`, `sglang` (each a class taking a `RolloutConfig`). Another
package adds its own with `ROLLOUT_BACKENDS.register(name, cls)`."""
ROLLOUT_BACKENDS.register("hf", HFRollout)
ROLLOUT_BACKENDS.register("vllm", VllmRollout)
ROLLOUT_BACKENDS.register("sglang", SglangRollout)


def get_rollout(name: str, config: RolloutConfig) -> Rollout:
    """Build the backend registered as `name`."""
    # the Rollout ABC declares no __init__; every registered backend takes a RolloutConfig
    return ROLLOUT_BACKENDS.get(name)(config)  # type: ignore[call-arg]
