"""Environments: what an episode's model talks to between turns, owning its rewards."""

from tephra.episodes.environments.base import Environment, EnvironmentFactory, StepResult
from tephra.episodes.environments.interaction import AnswerCheckInteraction, Interaction
from tephra.episodes.environments.tool_env import ToolEnvironment

__all__ = [
    "AnswerCheckInteraction",
    "Environment",
    "EnvironmentFactory",
    "Interaction",
    "StepResult",
    "ToolEnvironment",
]
