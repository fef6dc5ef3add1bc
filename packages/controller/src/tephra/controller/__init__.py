"""tephra.controller: Ray worker groups, dispatch modes and the trainer parts of the RL loop."""

from tephra.controller.cluster.dispatch import Dispatch, dispatch
from tephra.controller.cluster.worker_group import ResourcePool, Worker, WorkerGroup, ray_init
from tephra.controller.data.prompts import (
    DatasetError,
    PromptLoader,
    load_hf_dataset,
    load_parquet,
    reasoning_gym_records,
    tokenize_prompts,
)
from tephra.controller.run.checkpoints import CheckpointManager
from tephra.controller.run.trackers import TRACKERS, Trackers, plot_curves, read_jsonl
from tephra.controller.step.scoring import RewardFailure, Scorer
from tephra.core.config import load_config, parse_overrides, split_cli
from tephra.episodes.prompt import Prompt

__all__ = [
    "TRACKERS",
    "CheckpointManager",
    "DatasetError",
    "Dispatch",
    "Prompt",
    "PromptLoader",
    "ResourcePool",
    "RewardFailure",
    "Scorer",
    "Trackers",
    "Worker",
    "WorkerGroup",
    "dispatch",
    "load_config",
    "load_hf_dataset",
    "load_parquet",
    "parse_overrides",
    "plot_curves",
    "ray_init",
    "read_jsonl",
    "reasoning_gym_records",
    "split_cli",
    "tokenize_prompts",
]
