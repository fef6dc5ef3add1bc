"""Recipes: methods beyond the advantage estimator (SPIN, PRIME, on-policy distillation, the
LLM judge, critic warmup), each one module that hooks named stages of the RL step
(`base.Recipe`) and asks for engines by role (`base.EngineRole`). A new recipe is a module
here that registers itself in `RECIPES`, its config section, and its tests."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tephra.controller.recipes import critic_warmup, distillation, judge, prime, spin
from tephra.controller.recipes.base import (
    RECIPES,
    EngineRole,
    LossFn,
    Recipe,
    RoleEngines,
    StepState,
)

if TYPE_CHECKING:
    from tephra.controller.config.tree import PPOConfig

BUILT_IN = (critic_warmup, distillation, judge, prime, spin)
"""The modules whose import registers the built-in recipes."""


def enabled_recipes(cfg: PPOConfig) -> list[Recipe]:
    """One instance of every recipe `cfg` turns on, in the order of their names."""
    return [RECIPES.get(name)(cfg) for name in RECIPES.names() if RECIPES.get(name).enabled(cfg)]


def check_recipes(cfg: PPOConfig) -> None:
    """Every recipe's own config check (`Recipe.check`)."""
    for name in RECIPES.names():
        RECIPES.get(name).check(cfg)


__all__ = [
    "BUILT_IN",
    "RECIPES",
    "EngineRole",
    "LossFn",
    "Recipe",
    "RoleEngines",
    "StepState",
    "check_recipes",
    "enabled_recipes",
]
