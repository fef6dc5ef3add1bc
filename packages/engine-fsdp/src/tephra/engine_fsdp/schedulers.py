"""The FSDP engine's learning-rate scheduler: torch's LambdaLR over the shared schedules of
`tephra.engine_api.lr_schedules`."""

from __future__ import annotations

import torch

from tephra.engine_api.config import SchedulerConfig
from tephra.engine_api.lr_schedules import lr_factor


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: SchedulerConfig
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(cfg, step))
