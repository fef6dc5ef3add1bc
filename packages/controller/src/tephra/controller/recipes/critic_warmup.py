"""Critic warmup (`trainer.critic_warmup`, VAPO's value pretraining) as a recipe: for the
first steps only the critic trains; the actor's weights and optimizer stay untouched."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tephra.controller.recipes.base import RECIPES, Recipe, StepState
from tephra.core.errors import ConfigError

if TYPE_CHECKING:
    from tephra.controller.config.tree import PPOConfig


@RECIPES.register("critic_warmup")
class CriticWarmup(Recipe):
    """Holds the actor's update back while `step < trainer.critic_warmup`."""

    name = "critic_warmup"

    @classmethod
    def enabled(cls, cfg: PPOConfig) -> bool:
        return bool(cfg.trainer.critic_warmup)

    @classmethod
    def check(cls, cfg: PPOConfig) -> None:
        warmup, a = cfg.trainer.critic_warmup, cfg.algorithm
        if warmup and not a.needs("values"):
            raise ConfigError(
                f"trainer.critic_warmup={warmup} updates only the critic, but "
                f"algorithm.adv_estimator={a.adv_estimator!r} uses none; choose an estimator "
                "with a critic (e.g. gae) or set trainer.critic_warmup=0"
            )

    def before_update(self, state: StepState) -> None:
        warmup = state.step < self.cfg.trainer.critic_warmup
        state.metrics["trainer/critic_warmup"] = float(warmup)
        state.train_actor = not warmup
