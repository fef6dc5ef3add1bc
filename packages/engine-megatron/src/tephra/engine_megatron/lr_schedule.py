"""Megatron's optimizer driven by the schedules every engine shares (lr = peak lr *
`tephra.engine_api.lr_schedules.lr_factor(cfg, step)`)."""

from __future__ import annotations

from collections.abc import Callable

from tephra.engine_api.config import SchedulerConfig
from tephra.engine_api.lr_schedules import lr_factor


class LrSchedule:
    """Sets lr = peak_lr * lr_factor(cfg, step) on every parameter group; `step()` advances
    one optimizer step (the semantics of torch's LambdaLR, for megatron's optimizer, which is
    not a torch Optimizer). `param_groups` is called each time: loading optimizer state
    replaces the group dicts."""

    def __init__(
        self, param_groups: Callable[[], list[dict]], peak_lr: float, cfg: SchedulerConfig
    ) -> None:
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
