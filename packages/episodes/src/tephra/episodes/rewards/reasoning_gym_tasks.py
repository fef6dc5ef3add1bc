"""reasoning-gym tasks, scored by the task's own `score_answer(answer, entry)`.

Data sources `reasoning_gym/<task>` (the prefix is `RewardConfig.prefix_scorers`) reach the
scorer registered as `reasoning_gym`. The item to score against travels in the row's
extra_info, in one of two forms:

    extra_info["reasoning_gym"] = {
        "task": "basic_arithmetic",
        "entry_json": "<json.dumps of the dataset entry: question, answer, metadata>",
        "extract": "last_number",        # optional, default "answer_tag"
    }

or, to regenerate the entry instead of storing it (exact for every task; needed for arc_agi and
rearc, whose metadata holds tuples that JSON turns into lists, which their checkers then
score 0.05 instead of 1.0; checked over all 106 tasks of reasoning-gym 0.1.25, the other
98 with answers round-trip exactly):

    extra_info["reasoning_gym"] = {
        "task": "arc_agi", "seed": 0, "size": 100, "index": 17,
        "config_json": "{}",             # extra config fields of create_dataset, as JSON
        "extract": "answer_tag",
    }

The entry is a JSON string, not a dict, so that parquet files keep one string column
whatever each task's metadata looks like. `reasoning_gym_rows` writes the first form.

"extract" says how the answer is cut out of the response before `score_answer` sees it:
`answer_tag` (content of the last <answer>...</answer>, reasoning-gym's convention; None if
absent), `last_number` (the last number, for prompts asking for just the number), `full`
(the whole stripped response).
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Callable
from functools import cache, lru_cache
from typing import Any

from tephra.episodes.rewards.extraction import extract_answer_tag, extract_last_number
from tephra.episodes.rewards.results import RewardError

EXTRACTORS: dict[str, Callable[[str], str | None]] = {
    "answer_tag": extract_answer_tag,
    "last_number": extract_last_number,
    "full": lambda text: text.strip(),
}
"""Names allowed in extra_info["reasoning_gym"]["extract"]."""

DEFAULT_PREFIX = "reasoning_gym/"


@cache
def _score_answer_fn(task: str) -> Callable[[str | None, dict], float]:
    import reasoning_gym  # seconds to import (and noisy): only reasoning-gym data needs it
    from reasoning_gym.factory import DATASETS

    if task not in DATASETS:
        close = difflib.get_close_matches(task, list(DATASETS), n=3)
        raise RewardError(
            f"reasoning_gym: unknown task {task!r}"
            + (f"; did you mean {', '.join(map(repr, close))}?" if close else "")
            + f" ({len(DATASETS)} tasks are registered in reasoning_gym.factory.DATASETS)"
        )
    return reasoning_gym.get_score_answer_fn(task)


@lru_cache(maxsize=64)
def _regenerated_dataset(task: str, seed: int, size: int, config_json: str) -> Any:
    import reasoning_gym  # seconds to import (and noisy): only reasoning-gym data needs it

    return reasoning_gym.create_dataset(task, seed=seed, size=size, **json.loads(config_json))


def reasoning_gym_entry(info: dict[str, Any]) -> dict[str, Any]:
    """The dataset entry described by extra_info["reasoning_gym"] (stored or regenerated)."""
    # Keys may be present with None: a parquet file mixing both forms fills the other
    # form's keys with nulls.
    if info.get("entry_json") is not None:
        entry = info["entry_json"]
        return json.loads(entry) if isinstance(entry, str) else dict(entry)
    if all(info.get(key) is not None for key in ("seed", "size", "index")):
        dataset = _regenerated_dataset(
            info["task"], int(info["seed"]), int(info["size"]), info.get("config_json") or "{}"
        )
        return dataset[int(info["index"])]
    raise RewardError(
        "reasoning_gym: extra_info['reasoning_gym'] needs 'entry_json' (the dataset entry as "
        "JSON) or 'seed', 'size' and 'index' (to regenerate it); got keys "
        f"{sorted(info)}. Build rows with tephra.episodes.rewards.reasoning_gym_rows"
    )


def reasoning_gym_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None
) -> float:
    """The task's own score of the answer extracted from `solution_str` (0.0 to 1.0).

    `ground_truth` is not read: the task's checker compares with the entry (some tasks accept
    several answers, which a single ground-truth string cannot express).
    """
    info = (extra_info or {}).get("reasoning_gym")
    if not isinstance(info, dict) or "task" not in info:
        raise RewardError(
            f"reasoning_gym: data_source {data_source!r} needs extra_info['reasoning_gym'] = "
            "{'task': ..., 'entry_json': ...}; got extra_info keys "
            f"{sorted(extra_info or {})}. Build rows with tephra.episodes.rewards.reasoning_gym_rows"
        )
    extract = info.get("extract") or "answer_tag"
    if extract not in EXTRACTORS:
        raise RewardError(
            f"reasoning_gym: extra_info['reasoning_gym']['extract']={extract!r} is not allowed; "
            f"choose one of {list(EXTRACTORS)}"
        )
    score_answer = _score_answer_fn(info["task"])
    answer = EXTRACTORS[extract](solution_str)
    return float(score_answer(answer, reasoning_gym_entry(info)))


def reasoning_gym_rows(
    task: str,
    size: int,
    seed: int,
    config: dict[str, Any] | None = None,
    extract: str = "answer_tag",
    prefix: str = DEFAULT_PREFIX,
) -> list[dict[str, Any]]:
    """`size` items of a reasoning-gym task as verl-style rows the reward scorer understands:
    the one builder of reasoning-gym data (the RL trainer's prompts, the evaluation app's and
    the SFT app's conversations are made from these rows).

    Each row is {"data_source": prefix + task, "question": str, "ground_truth": str,
    "extra_info": {"index": i, "reasoning_gym": {"task", "entry_json", "extract"}}};
    the caller turns "question" into a prompt (adding e.g. "Answer with just the number").
    `config` holds extra fields of the task's config (e.g. {"min_terms": 2, "max_terms": 2}).
    A value of an entry that JSON has no type for is stored as its `str`.
    """
    import reasoning_gym  # seconds to import (and noisy): only reasoning-gym data needs it

    if extract not in EXTRACTORS:
        raise RewardError(
            f"reasoning_gym_rows: extract={extract!r} is not allowed; choose one of {list(EXTRACTORS)}"
        )
    _score_answer_fn(task)  # unknown task -> RewardError with suggestions
    dataset = reasoning_gym.create_dataset(task, seed=seed, size=size, **(config or {}))
    rows = []
    for index in range(size):
        entry = dataset[index]
        rows.append(
            {
                "data_source": prefix + task,
                "question": entry["question"],
                "ground_truth": "" if entry.get("answer") is None else str(entry["answer"]),
                "extra_info": {
                    "index": index,
                    "reasoning_gym": {
                        "task": task,
                        "entry_json": json.dumps(entry, default=str),
                        "extract": extract,
                    },
                },
            }
        )
    return rows
