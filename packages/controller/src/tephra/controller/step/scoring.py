"""Scoring a step's responses with `tephra.episodes.rewards`.

The rollout package's `RewardManager` picks each sample's scorer by `data_source` (or runs
a custom function from a file, verl's signature, or a reward model), counts and logs scorer
exceptions and scores those samples 0. Each rank scores its own samples (`RLWorker`). The
driver adds one rule: when every sample of a step fails, the run stops with the first error,
because a reward that is always 0 trains nothing and hides the bug.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from tephra.core.errors import TephraError
from tephra.episodes.prompt import Prompt
from tephra.episodes.rewards import RewardConfig, RewardInput, RewardManager, RewardResult


class RewardFailure(TephraError, RuntimeError):
    """The reward function failed on every sample of a batch."""


class RewardRangeError(TephraError, RuntimeError):
    """A reward beyond `reward.max_abs` (or not finite), or an advantage that is not finite:
    training on it would make every update NaN, so the run stops naming the sample."""


def check_rewards(scores: Sequence[float], samples: Sequence[str], max_abs: float) -> None:
    """Raise `RewardRangeError` at the first score that is not finite or beyond `max_abs`;
    `samples[i]` names sample i (its prompt id and data_source)."""
    for i, score in enumerate(scores):
        if not (math.isfinite(score) and abs(score) <= max_abs):
            raise RewardRangeError(
                f"the reward of sample {i} of the step ({samples[i]}) is {score:g}, beyond "
                f"reward.max_abs={max_abs:g}; fix the reward function, or set reward.clip="
                "[low,high] to clip scores into a range (or raise reward.max_abs)"
            )


def check_advantages(
    advantages: torch.Tensor, response_mask: torch.Tensor, samples: Sequence[str]
) -> None:
    """Raise `RewardRangeError` naming the first sample with a non-finite advantage on a
    trained token ([B, T] tensors; `samples[i]` names row i)."""
    bad = (~torch.isfinite(advantages) & (response_mask > 0)).any(-1)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        value = float(advantages[i][~torch.isfinite(advantages[i])][0])
        raise RewardRangeError(
            f"the advantage of sample {i} of the step ({samples[i]}) is {value:g}, and "
            f"{int(bad.sum())} of {len(bad)} samples have a non-finite advantage: the rewards of "
            "the step (with the KL and length penalties) overflow the estimator; check the "
            "reward function, or set reward.clip=[low,high] to bound the scores"
        )


def reward_inputs(
    texts: Sequence[str], prompts: Sequence[Prompt], prompt_texts: Sequence[str] | None = None
) -> list[RewardInput]:
    """What the scorer reads of `texts[i]`, the response to `prompts[i]`: its data_source,
    ground truth and extra_info (and `prompt_texts[i]`, the decoded prompt a reward model or
    judge reads)."""
    return [
        RewardInput(
            prompt.data_source,
            text,
            prompt.ground_truth,
            prompt.extra_info,
            **({"prompt_str": prompt_texts[i]} if prompt_texts is not None else {}),
        )
        for i, (text, prompt) in enumerate(zip(texts, prompts, strict=True))
    ]


class Scorer:
    """Scores decoded responses against their prompts."""

    def __init__(self, config: RewardConfig | None = None) -> None:
        self.manager = RewardManager(config or RewardConfig(executor="serial"))

    def score(
        self,
        texts: Sequence[str],
        prompts: Sequence[Prompt],
        prompt_texts: Sequence[str] | None = None,
    ) -> list[RewardResult]:
        """The reward of `texts[i]` against `prompts[i]`; `prompt_texts` are the decoded
        prompts a reward model reads."""
        return self.manager.score_batch(reward_inputs(texts, prompts, prompt_texts))


def check_not_all_failed(errors: Sequence[str | None]) -> None:
    """Raise `RewardFailure` when every sample's scorer raised."""
    failed = [e for e in errors if e is not None]
    if errors and len(failed) == len(errors):
        raise RewardFailure(
            f"the reward function failed on all {len(errors)} samples of the batch; first "
            f"error: {failed[0].strip().splitlines()[-1]}; fix the scorer of these data "
            "sources (or reward.custom_function_path), or the rows' ground truth"
        )


def accuracy_of(score: float) -> float:
    """A response counts as correct when its score reaches 1 (partial credit does not)."""
    return 1.0 if score >= 1.0 else 0.0
