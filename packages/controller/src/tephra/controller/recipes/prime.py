"""PRIME (process reinforcement through implicit rewards, Cui et al. 2025) as a recipe: a
reward model `prm`, initialised from the policy and trained online on outcome labels, gives
every response token an implicit process reward; its advantage replaces the estimator's. The
maths is `tephra.algos.prime`."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tephra.algos import PrimeRMObjective, prime_step
from tephra.controller.recipes.base import RECIPES, EngineRole, Recipe, StepState
from tephra.core.errors import ConfigError

if TYPE_CHECKING:
    from tephra.controller.config.tree import PPOConfig


@RECIPES.register("prime")
class Prime(Recipe):
    """`algorithm.prime`: the reward model's pass beside the reference's, PRIME's advantages,
    and the reward model's update after the actor's data was read."""

    name = "prime"

    def __init__(self, cfg: PPOConfig) -> None:
        super().__init__(cfg)
        self.prm_log_probs: torch.Tensor | None = None
        """This step's reward-model log-probs of the sampled tokens [batch, seq]."""

    @classmethod
    def enabled(cls, cfg: PPOConfig) -> bool:
        return cfg.algorithm.prime.enabled

    @classmethod
    def check(cls, cfg: PPOConfig) -> None:
        a, b = cfg.algorithm, cfg.batch
        if not a.prime.enabled:
            return
        if b.samples_per_prompt < 2:
            raise ConfigError(
                "algorithm.prime compares samples of one prompt (leave-one-out baselines); "
                f"batch.samples_per_prompt={b.samples_per_prompt} must be >= 2"
            )
        if a.needs("values") or a.needs("baselines") or a.needs("token_stats"):
            raise ConfigError(
                "algorithm.prime replaces the advantage estimator; algorithm.adv_estimator="
                f"{a.adv_estimator!r} needs inputs PRIME does not use; keep the default 'grpo'"
            )
        if a.kl_in_reward.enabled:
            raise ConfigError(
                "algorithm.prime builds its advantage from the implicit and outcome rewards, "
                "without algorithm.kl_in_reward; use actor.objective.use_kl_loss=true instead"
            )

    def roles(self) -> tuple[EngineRole, ...]:
        beta = self.cfg.algorithm.prime.beta
        # on the reward pool when there is one (`resources.reward`), else with the actor
        pool = "reward" if self.cfg.resources.reward.ranks else "actor"
        return (
            EngineRole("prm", pool, loss=lambda: PrimeRMObjective(beta), checkpoint="prime_rm"),
        )

    def forward_passes(self, state: StepState) -> None:
        self.prm_log_probs = state.engines.log_probs("prm", state.batch)
        state.forward_passes += 1
        state.lap("prm")

    def advantages(self, state: StepState) -> bool:
        batch, scores = state.batch, state.scores
        assert self.prm_log_probs is not None and scores is not None  # earlier stages set them
        adv, batch["prime_labels"], metrics = prime_step(
            self.prm_log_probs,
            batch["ref_log_probs"],
            batch["response_mask"],
            scores,
            batch["uid"],
            self.cfg.algorithm.prime,
        )
        batch["advantages"], batch["returns"] = adv.float(), adv.float()
        state.metrics.update(metrics)
        self.prm_log_probs = None
        return True

    def after_update(self, state: StepState) -> None:
        # after its rewards were read: the reward model trains on this step's labels
        out = state.engines.update("prm", state.batch)
        state.metrics.update({f"prime/{k.split('/')[-1]}": v for k, v in out.items()})
        state.trained_passes += self.cfg.batch.epochs
        state.lap("prm_update")
