"""Rewards: scorers chosen by `data_source`, a custom function from a file, a reward model,
and `RewardManager` that scores a batch in parallel.

Registered scorers (`REWARD_SCORERS`): gsm8k / openai/gsm8k (strict `####`), gsm8k_flexible,
math / lighteval/MATH / DigitalLearningGmbH/MATH-lighteval / HuggingFaceH4/MATH-500
(math-verify), reasoning_gym (data sources `reasoning_gym/<task>`), countdown, math_dapo / aime*,
search QA, colour_squares (the synthetic image task), and code (codecontests / apps / codeforces / taco / primeintellect / livecodebench:
the program runs against the tests in the python sandbox).
"""

from tephra.episodes.rewards.code import (
    CODE_DATA_SOURCES,
    CodeLimits,
    CodeReport,
    CodeScorer,
    code_score,
    extract_program,
    parse_code_tests,
    run_code_tests,
    score_code,
)
from tephra.episodes.rewards.config import RewardConfig
from tephra.episodes.rewards.countdown import countdown_score
from tephra.episodes.rewards.custom_function import (
    FileRewardFunction,
    RewardFunctionError,
    check_scorer_signature,
    load_reward_function,
)
from tephra.episodes.rewards.extraction import (
    extract_answer_tag,
    extract_last_boxed,
    extract_last_integer,
    extract_last_number,
    numbers_equal,
)
from tephra.episodes.rewards.gsm8k import (
    extract_gsm8k_answer,
    gsm8k_flexible,
    gsm8k_score,
    gsm8k_strict,
)
from tephra.episodes.rewards.judge import (
    JUDGE_PARSERS,
    GenerativeJudge,
    JudgeConfig,
    JudgeParseError,
    JudgeStats,
)
from tephra.episodes.rewards.manager import (
    RewardManager,
    RewardReport,
    RewardScoringError,
    RewardTimeout,
    clip_scores,
    compute_score,
    is_timeout,
    resolve_scorer,
)
from tephra.episodes.rewards.math_equivalence import math_equal, math_score
from tephra.episodes.rewards.reasoning_gym_tasks import reasoning_gym_rows, reasoning_gym_score
from tephra.episodes.rewards.results import RewardError, RewardInput, RewardResult, normalize_score
from tephra.episodes.rewards.reward_model import RewardModelScorer
from tephra.episodes.rewards.scorer_registry import REWARD_SCORERS, Scorer

__all__ = [
    "JUDGE_PARSERS",
    "GenerativeJudge",
    "JudgeConfig",
    "JudgeParseError",
    "JudgeStats",
    "CODE_DATA_SOURCES",
    "REWARD_SCORERS",
    "CodeLimits",
    "CodeReport",
    "CodeScorer",
    "FileRewardFunction",
    "RewardConfig",
    "RewardError",
    "RewardFunctionError",
    "RewardTimeout",
    "clip_scores",
    "is_timeout",
    "RewardInput",
    "RewardManager",
    "RewardModelScorer",
    "RewardReport",
    "RewardResult",
    "RewardScoringError",
    "Scorer",
    "check_scorer_signature",
    "code_score",
    "compute_score",
    "countdown_score",
    "extract_answer_tag",
    "extract_gsm8k_answer",
    "extract_last_boxed",
    "extract_last_integer",
    "extract_last_number",
    "extract_program",
    "gsm8k_flexible",
    "gsm8k_score",
    "gsm8k_strict",
    "load_reward_function",
    "math_equal",
    "math_score",
    "normalize_score",
    "numbers_equal",
    "parse_code_tests",
    "reasoning_gym_rows",
    "reasoning_gym_score",
    "resolve_scorer",
    "run_code_tests",
    "score_code",
]
