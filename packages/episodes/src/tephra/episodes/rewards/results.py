"""What goes into a scorer and what comes out of it.

A scorer has verl's signature::

    fn(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None)
        -> float | dict

and may return a plain number or a dict holding "score" plus extra numeric metrics
(e.g. "acc"). `normalize_score` turns either form into one `RewardResult`: the one score type,
defined beside `tephra.rollout.Sample` (which carries it as `Sample.reward`) because the
rollout package is below this one, and re-exported here.
"""

from __future__ import annotations

import logging
import math
import numbers
from dataclasses import dataclass
from typing import Any

from tephra.core.errors import TephraError
from tephra.rollout.samples import RewardResult

__all__ = [
    "RewardError",
    "RewardInput",
    "RewardResult",
    "RewardTimeout",
    "normalize_score",
]

logger = logging.getLogger(__name__)


class RewardError(TephraError, ValueError):
    """A reward input, scorer result or reward configuration that cannot be scored."""


class RewardTimeout(RewardError):
    """A scorer did not return within `reward.timeout_s`, or a scorer's own time limit
    (math-verify's) ran out: the sample scores 0.0 and counts in `reward/timeouts`."""


@dataclass
class RewardInput:
    """One response to score (one row of a verl-format data set plus the model's text)."""

    data_source: str
    """Name of the data set the prompt came from; picks the scorer (e.g. `gsm8k`, `math`,
    `reasoning_gym/basic_arithmetic`, `countdown`)."""
    solution_str: str
    """The decoded response of the policy (without the prompt)."""
    ground_truth: Any = None
    """The reference answer (`reward_model.ground_truth` of the data set row). A string for
    gsm8k and math; see each scorer for what it accepts."""
    extra_info: dict[str, Any] | None = None
    """The row's `extra_info` dict (reasoning-gym scorers read `extra_info["reasoning_gym"]`)."""
    prompt_str: str = ""
    """The decoded prompt; only the reward-model scorer reads it (rule scorers ignore it)."""


# Keys already warned about, so a custom function returning e.g. "pred" strings on every
# item logs once, not once per item.
_warned_non_numeric: set[str] = set()


def normalize_score(value: Any, scorer: str) -> RewardResult:
    """Turn a scorer's return value (number, bool or dict with "score") into a RewardResult.

    Extra dict entries that are numbers (or bools) become `extras`; other values (verl
    scorers sometimes return the predicted string as "pred") are dropped with one warning
    per key, because the trainer logs extras as numeric metrics.
    """
    if isinstance(value, dict):
        if "score" not in value:
            raise RewardError(
                f"scorer {scorer!r} returned a dict without 'score' (keys: {sorted(value)}); "
                f"a dict result must hold 'score' and may hold extra numeric metrics"
            )
        score = _as_finite_float(value["score"], scorer, "score")
        extras: dict[str, float] = {}
        for key, extra in value.items():
            if key == "score":
                continue
            if isinstance(extra, numbers.Real):  # also numpy scalars, which scorers return
                extras[str(key)] = float(extra)
            elif key not in _warned_non_numeric:
                _warned_non_numeric.add(key)
                logger.warning(
                    "scorer %r returned extra %r of type %s; only numeric extras are kept",
                    scorer,
                    key,
                    type(extra).__name__,
                )
        return RewardResult(score=score, extras=extras)
    return RewardResult(score=_as_finite_float(value, scorer, "score"))


def _as_finite_float(value: Any, scorer: str, what: str) -> float:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (str, bytes)):
        # float("1.0") would pass, but a string score is a scorer bug worth surfacing.
        raise RewardError(
            f"scorer {scorer!r} returned {what}={value!r} of type str; return a number "
            f"(e.g. float(...)) or a dict with a numeric 'score'"
        )
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise RewardError(
            f"scorer {scorer!r} returned {what}={value!r} of type {type(value).__name__}; "
            f"expected a number or a dict with a numeric 'score'"
        ) from None
    if not math.isfinite(number):
        # A NaN reward silently poisons every advantage of its group.
        raise RewardError(
            f"scorer {scorer!r} returned a non-finite {what} ({number}); return a "
            f"finite number (guard divisions by zero, map NaN to 0.0)"
        )
    return number
