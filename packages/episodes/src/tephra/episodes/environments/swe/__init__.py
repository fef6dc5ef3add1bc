"""The software-engineering environment: shipped tiny repositories with a failing test, tools
to read and edit a per-trajectory copy and to run its tests in the sandbox."""

from tephra.episodes.environments.swe.environment import SweEnvironment
from tephra.episodes.environments.swe.tasks import TASKS, TRAIN, SweTask, get_task, task_names
from tephra.episodes.environments.swe.workspace import SweSettings, SweWorkspaces, score

__all__ = [
    "TASKS",
    "TRAIN",
    "SweEnvironment",
    "SweSettings",
    "SweTask",
    "SweWorkspaces",
    "get_task",
    "score",
    "task_names",
]
