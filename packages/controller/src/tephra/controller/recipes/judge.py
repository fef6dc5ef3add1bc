"""The LLM judge (`reward.judge`) as a recipe: the workers' scorer runs the judge
(`tephra.episodes.rewards.GenerativeJudge`); the step logs what it did."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tephra.controller.recipes.base import RECIPES, Recipe, StepState
from tephra.controller.samples import Sample

if TYPE_CHECKING:
    from tephra.controller.config.tree import PPOConfig


def judge_metrics(samples: list[Sample]) -> dict[str, float]:
    """`reward/judge_mean` (the judge's mean score, before the weights mix it with the rule
    score), `reward/judge_fallbacks` and `reward/judge_timeouts` (the step's samples the judge
    scored with the fallback / timed out on); {} when nothing was judged."""
    judged = [s.reward.extras for s in samples if "judge_fallback" in s.reward.extras]
    if not judged:
        return {}
    return {
        "reward/judge_mean": sum(x["judge"] for x in judged) / len(judged),
        "reward/judge_fallbacks": float(sum(x["judge_fallback"] for x in judged)),
        "reward/judge_timeouts": float(sum(x.get("judge_timeout", 0.0) for x in judged)),
    }


@RECIPES.register("judge")
class Judge(Recipe):
    """`reward.judge`: the judge's mean score, fallbacks and timeouts of the step's samples."""

    name = "judge"

    @classmethod
    def enabled(cls, cfg: PPOConfig) -> bool:
        return cfg.reward.judge.enabled

    def after_scoring(self, state: StepState) -> None:
        state.metrics.update(judge_metrics(state.samples))
