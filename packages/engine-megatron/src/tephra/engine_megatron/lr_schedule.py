"""Learning-rate multipliers for `SchedulerConfig` (lr = peak lr * factor(step))."""

from __future__ import annotations

import math
from collections.abc import Callable

from tephra.engine_api.config import SchedulerConfig


def lr_factor(cfg: SchedulerConfig, step: int) -> float:
    """warmup: step / warmup_steps; then
    constant: 1; cosine: r + (1 - r) * (1 + cos(pi * p)) / 2 with p the fraction of the
    post-warmup steps done and r = min_lr_ratio; wsd: 1 until the last decay_ratio of
    total_steps, then linear to r."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return step / cfg.warmup_steps
    if cfg.name == "constant":
        return 1.0
    r = cfg.min_lr_ratio
    if cfg.name == "cosine":
        p = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.total_steps - cfg.warmup_steps))
        return r + (1 - r) * 0.5 * (1 + math.cos(math.pi * p))
    decay_start = cfg.total_steps * (1 - cfg.decay_ratio)
    if step < decay_start:
        return 1.0
    p = min(1.0, (step - decay_start) / max(1e-9, cfg.total_steps - decay_start))
    return 1.0 - (1 - r) * p


class LrSchedule:
    """Sets lr = peak_lr * lr_factor(cfg, step) on every parameter group; `step()` advances
    one optimizer step (the semantics of torch's LambdaLR, for megatron's optimizer, which is
    not a torch Optimizer). `param_groups` is called each time: loading optimizer state
    replaces the group dicts."""

    def __init__(self, param_groups: Callable[[], list[dict]], peak_lr: float,
                 cfg: SchedulerConfig) -> None:
        self.param_groups = param_groups
        self.peak_lr = peak_lr
        self.cfg = cfg
        self.step_count = 0
        self._apply()

    def _apply(self) -> float:
        lr = self.peak_lr * lr_factor(self.cfg, self.step_count)
        for group in self.param_groups():
            group["lr"] = lr
        return lr

    def step(self) -> float:
        """Advance one step; returns the new lr."""
        self.step_count += 1
        return self._apply()

    def state_dict(self) -> dict:
        return {"step_count": self.step_count}

    def load_state_dict(self, state: dict) -> None:
        self.step_count = int(state["step_count"])
        self._apply()
