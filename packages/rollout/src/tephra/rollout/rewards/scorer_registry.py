"""The registry of per-item reward scorers, keyed by `data_source`.

A scorer has verl's signature ``fn(data_source, solution_str, ground_truth, extra_info)`` and
returns a float or a dict with "score". Several names may point to one scorer (aliases such
as `openai/gsm8k`); data sources that share a prefix (`reasoning_gym/<task>`) are mapped by
`RewardConfig.prefix_scorers`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tephra.engine_api.registry import Registry

Scorer = Callable[[str, str, Any, "dict[str, Any] | None"], "float | dict[str, Any]"]

REWARD_SCORERS: Registry[Scorer] = Registry("reward scorer")
"""data_source name -> scorer function."""
