"""Typed, validated configuration of reward scoring (the `reward.` section of an app config)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, cast

from tephra.core.errors import ConfigError
from tephra.episodes.rewards.judge import JudgeConfig

EXECUTORS = ("thread", "process", "serial")
DEFAULT_TIMEOUT_S = 90.0
"""`RewardConfig.timeout_s`'s default, seconds per sample (see there why)."""
DEFAULT_STEP_TIMEOUT_S = 600.0
"""`RewardConfig.step_timeout_s`'s default, seconds per batch (see there why)."""


@dataclass
class RewardConfig:
    """How responses are scored: rule scorers chosen by data_source (the default), one custom
    function for every item, or a reward model for every item."""

    custom_function_path: str | None = None
    """Python file holding a custom reward function (verl's custom_reward_function.path).
    When set, that function scores every item, whatever its data_source."""
    custom_function_name: str = "compute_score"
    """Name of the function in `custom_function_path` (verl's default name)."""
    custom_function_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments passed to the custom function on every call (verl's
    reward_kwargs), e.g. {"format_score": 0.1}."""
    reward_model_path: str | None = None
    """Local folder of a Hugging Face sequence classifier with num_labels=1. When set, its
    logit on prompt + response is the reward of every item (rule scorers are not used)."""
    reward_model_batch_size: int = 8
    """Texts per reward-model forward pass (samples)."""
    reward_model_max_length: int = 2048
    """Tokens kept per text (the start of the prompt is cut first)."""
    reward_model_device: str = "cpu"
    """torch device of the reward model (`cpu`, `cuda`, `cuda:1`)."""
    reward_model_dtype: str = "float32"
    """`float32`, `bfloat16` or `float16`; float32 on CPU, bfloat16 on GPU saves memory."""
    reward_model_chat_template: bool = False
    """Format (prompt, response) with the reward tokenizer's chat template as a user and an
    assistant turn (pass the raw question as prompt_str); otherwise score prompt + response."""
    scorer_overrides: dict[str, str] = field(default_factory=dict)
    """data_source -> registered scorer name, checked before the registry, e.g.
    {"gsm8k": "gsm8k_flexible"} or {"my_arithmetic": "reasoning_gym"}."""
    prefix_scorers: dict[str, str] = field(
        default_factory=lambda: {
            "reasoning_gym/": "reasoning_gym",
            "searchR1_": "search_qa",
            "aime": "math_dapo",
        }
    )
    """data_source prefix -> registered scorer name, used when the data_source is not a
    registered name itself (so `reasoning_gym/<any task>` needs no registration per task)."""
    executor: str = "thread"
    """How a batch is spread over workers: `thread` (a thread pool: cheap, but Python-heavy
    scorers share one core through the GIL, and math-verify runs without its timeout there),
    `process` (a process pool forked from a fork server, kept for the manager's life: real
    parallelism and math-verify timeouts; the fork server's first start imports torch and the
    scorers once, seconds; scorers must be picklable; like any multiprocessing start method
    but fork, a script using it needs an `if __name__ == "__main__":` guard) or `serial`."""
    num_workers: int = 4
    """Threads or processes scoring one batch (ignored by `serial`)."""
    timeout_s: float = DEFAULT_TIMEOUT_S
    """Seconds one scorer call (one sample) may take; a later one scores 0.0, counts as an
    error (`RewardTimeout`) and in `RewardReport.timeouts_by_source` (the trainer's
    `reward/timeouts`). Each call runs on a daemon thread, left running when late (so
    math-verify's own alarm-based timeout, main thread only, is off). Default 90 s: above the
    bundled code scorer's 60 s budget per response (`CodeLimits.total_timeout_s`), so no
    bundled scorer is cut short, while a reward function that never returns costs at most
    90 s per sample instead of hanging training."""
    step_timeout_s: float | None = DEFAULT_STEP_TIMEOUT_S
    """Seconds the scoring of one batch (a rank's share of a step) may take as a whole,
    whatever `timeout_s` allows each sample: samples not scored by then score 0.0 with a
    `RewardTimeout` error saying so, and are counted with the per-sample timeouts (the
    trainer's `reward/timeouts`); a scorer is not started after the deadline. It bounds the
    rule and custom scorers (the judge has `reward.judge.timeout_s`). Default 600 s: well
    above a healthy step's scoring (seconds for math, about a minute for a batch of code
    tests), while a reward function that never returns costs one step 10 minutes instead of
    `timeout_s` times the samples in a row. null: no deadline for the batch."""
    max_abs: float = 1e6
    """Largest |reward| accepted, in reward units. A larger score is a scorer bug (1e308
    overflows the advantages' mean and std to NaN, and every optimizer step is then skipped):
    the trainer stops naming the sample, unless `clip` is set. Default 1e6: far above any
    bounded reward (rule scorers give 0-1, reward models tens) and far below where float32
    arithmetic on a batch of rewards overflows (3.4e38)."""
    clip: tuple[float, float] | None = None
    """[low, high]: clip every score into this range (in reward units) instead of stopping on
    one beyond `max_abs`; clipped scores are counted (`RewardReport.clipped`, the trainer's
    `reward/clipped`). None (default): scores are not changed, because clipping changes what
    is learnt and hides a scorer bug; it is the user's explicit choice."""
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    """A generative reward model (LLM judge) beside or instead of the rule scorers
    (`reward.judge.model_path`; see `JudgeConfig`). Off by default."""
    raise_on_error: bool = False
    """Raise when a scorer raises; by default the item scores 0.0, the error is counted per
    data_source in the report and the first traceback of each data_source is logged."""

    def __post_init__(self) -> None:
        if isinstance(self.judge, dict):  # YAML gives dicts
            self.judge = JudgeConfig(**self.judge)
        if self.judge.enabled and self.reward_model_path is not None:
            raise ConfigError(
                "reward: set at most one of reward.reward_model_path and reward.judge.model_path "
                f"(got both: {self.reward_model_path!r}, {self.judge.model_path!r})"
            )
        if self.executor not in EXECUTORS:
            raise ConfigError(
                f"reward.executor={self.executor!r} is not allowed; choose one of {list(EXECUTORS)}"
            )
        if not (math.isfinite(self.timeout_s) and self.timeout_s > 0):
            what = "" if math.isfinite(self.timeout_s) else "a finite number "
            raise ConfigError(
                f"reward.timeout_s={self.timeout_s} must be {what}> 0 (seconds per "
                f"sample; default {DEFAULT_TIMEOUT_S:g})"
            )
        if self.step_timeout_s is not None and not (
            math.isfinite(self.step_timeout_s) and self.step_timeout_s > 0
        ):
            raise ConfigError(
                f"reward.step_timeout_s={self.step_timeout_s} must be a finite number > 0 "
                f"(seconds for one batch's scoring; default {DEFAULT_STEP_TIMEOUT_S:g}) or "
                "null (no deadline for the batch)"
            )
        if not (math.isfinite(self.max_abs) and self.max_abs > 0):
            raise ConfigError(
                f"reward.max_abs={self.max_abs} must be a finite number > 0 "
                "(the largest |reward| accepted; default 1e6)"
            )
        if self.clip is not None:
            # YAML gives a list; the length is checked just below
            self.clip = cast(tuple[float, float], tuple(float(x) for x in self.clip))
            low, high = self.clip if len(self.clip) == 2 else (math.nan, math.nan)
            if not (math.isfinite(low) and math.isfinite(high) and low < high):
                raise ConfigError(
                    f"reward.clip={list(self.clip)} must be two finite numbers "
                    "[low, high] with low < high, e.g. reward.clip=[-1,1] (or null: "
                    "no clipping)"
                )
            if max(abs(low), abs(high)) > self.max_abs:
                raise ConfigError(
                    f"reward.clip={list(self.clip)} reaches beyond reward.max_abs="
                    f"{self.max_abs:g}; clip into a range inside it, or raise "
                    "reward.max_abs"
                )
        if self.num_workers < 1:
            raise ConfigError(f"reward.num_workers={self.num_workers} must be >= 1")
        if self.custom_function_path is not None and self.reward_model_path is not None:
            raise ConfigError(
                "reward: set at most one of reward.custom_function_path and reward.reward_model_path; "
                f"got both ({self.custom_function_path!r}, {self.reward_model_path!r})"
            )
        if self.reward_model_dtype not in ("float32", "bfloat16", "float16"):
            raise ConfigError(
                f"reward.reward_model_dtype={self.reward_model_dtype!r} is not allowed; "
                "choose one of ['float32', 'bfloat16', 'float16']"
            )
        if self.reward_model_batch_size < 1:
            raise ConfigError(
                f"reward.reward_model_batch_size={self.reward_model_batch_size} must be >= 1"
            )
        if self.reward_model_max_length < 1:
            raise ConfigError(
                f"reward.reward_model_max_length={self.reward_model_max_length} must be >= 1"
            )
