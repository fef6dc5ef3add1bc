"""Learning-rate schedules by name, one for every engine: lr(s) = peak_lr * factor(s), s =
optimizer steps taken (FSDP drives them through torch's LambdaLR, Megatron through its own
optimizer's parameter groups; both call `lr_factor`).

All start with a linear warmup over `warmup_steps` W: factor(s) = (s + 1) / W for s < W,
so the first step already moves (lr / W) and step W - 1 uses the peak.
    constant  factor = 1 after warmup.
    cosine    p = (s - W) / (T - W) clipped to [0, 1];
              factor = m + (1 - m) * (1 + cos(pi * p)) / 2      (m = min_lr_ratio, T = total_steps)
    wsd       warmup-stable-decay: factor = 1 until D = T - decay_ratio * T, then linear
              p = (s - D) / (T - D) clipped; factor = 1 - (1 - m) * p.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol

from tephra.core.registry import Registry


class ScheduleSettings(Protocol):
    """The schedule's settings a schedule reads (`tephra.engine_api.config.SchedulerConfig`
    holds them; this module sits below it, which checks its names against `SCHEDULES`)."""

    @property
    def name(self) -> str: ...
    @property
    def warmup_steps(self) -> int: ...
    @property
    def total_steps(self) -> int: ...
    @property
    def min_lr_ratio(self) -> float: ...
    @property
    def decay_ratio(self) -> float: ...


SCHEDULES: Registry[Callable[[int, ScheduleSettings], float]] = Registry("lr schedule")


def _warmup(step: int, cfg: ScheduleSettings) -> float | None:
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    return None


@SCHEDULES.register("constant")
def constant(step: int, cfg: ScheduleSettings) -> float:
    warm = _warmup(step, cfg)
    return 1.0 if warm is None else warm


@SCHEDULES.register("cosine")
def cosine(step: int, cfg: ScheduleSettings) -> float:
    warm = _warmup(step, cfg)
    if warm is not None:
        return warm
    p = min(max((step - cfg.warmup_steps) / (cfg.total_steps - cfg.warmup_steps), 0.0), 1.0)
    m = cfg.min_lr_ratio
    return m + (1.0 - m) * 0.5 * (1.0 + math.cos(math.pi * p))


@SCHEDULES.register("wsd")
def warmup_stable_decay(step: int, cfg: ScheduleSettings) -> float:
    warm = _warmup(step, cfg)
    if warm is not None:
        return warm
    decay_steps = max(cfg.decay_ratio * cfg.total_steps, 1.0)
    start = max(cfg.total_steps - decay_steps, float(cfg.warmup_steps))
    if step < start:
        return 1.0
    p = min((step - start) / max(cfg.total_steps - start, 1.0), 1.0)
    return 1.0 - (1.0 - cfg.min_lr_ratio) * p


def lr_factor(cfg: ScheduleSettings, step: int) -> float:
    """The multiplier of the peak learning rate after `step` optimizer steps."""
    return SCHEDULES.get(cfg.name)(step, cfg)


__all__ = ["SCHEDULES", "lr_factor"]
