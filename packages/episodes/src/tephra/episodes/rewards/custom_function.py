"""A user's reward function loaded from a Python file (verl's `custom_reward_function.path`
and `.name`).

The function is called with keywords, as verl calls it::

    fn(data_source=..., solution_str=..., ground_truth=..., extra_info=..., **kwargs)

so it must accept those four names (or `**kwargs`). Every problem found while loading (no
file, a syntax error, an exception at import, no such function, a signature that cannot take
those keywords) raises `RewardFunctionError` naming the file, before any scoring starts.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from collections.abc import Set as AbstractSet
from pathlib import Path
from typing import Any

from tephra.episodes.rewards.results import RewardError
from tephra.episodes.user_files import import_file

SCORER_ARGUMENTS = ("data_source", "solution_str", "ground_truth", "extra_info")


class RewardFunctionError(RewardError):
    """A custom reward function file or function that cannot be used."""


def load_reward_function(
    path: str | Path, name: str = "compute_score", kwargs: dict[str, Any] | None = None
) -> Callable:
    """Import `path` and return its function `name`, checked against the scorer signature.

    `kwargs` are the extra keyword arguments the caller will pass on every call (verl's
    `reward_kwargs`); parameters they fill count as provided.
    """
    file = Path(path).expanduser().resolve()
    where = f"custom reward file {file}"
    if not file.is_file():
        raise RewardFunctionError(
            f"{where} does not exist; set reward.custom_function_path to an existing .py file"
        )
    source = file.read_text(encoding="utf-8")
    try:
        compile(source, str(file), "exec")
    except SyntaxError as exc:
        line = (exc.text or "").rstrip()
        raise RewardFunctionError(
            f"{where}, line {exc.lineno}: syntax error: {exc.msg}"
            + (f"\n    {line}" if line else "")
        ) from exc

    try:  # run again on every load: an edited file takes effect in the same process
        module = import_file(file, "tephra_custom_reward_", reuse=False)
    except Exception as exc:
        raise RewardFunctionError(
            f"{where} raised {type(exc).__name__}: {exc} while being imported"
        ) from exc

    fn = getattr(module, name, None)
    if fn is None:
        defined = sorted(
            attr
            for attr, value in vars(module).items()
            if inspect.isfunction(value)
            and value.__module__ == module.__name__
            and not attr.startswith("_")
        )
        raise RewardFunctionError(
            f"{where} has no function {name!r}; it defines: {', '.join(defined) or '(no functions)'}. "
            f"Set reward.custom_function_name to one of them"
        )
    if not callable(fn):
        raise RewardFunctionError(f"{where}: {name!r} is a {type(fn).__name__}, not a function")
    check_scorer_signature(fn, where=f"{where}: function {name!r}", provided=set(kwargs or {}))
    return fn


def check_scorer_signature(
    fn: Callable, where: str, provided: AbstractSet[str] = frozenset()
) -> None:
    """Raise RewardFunctionError unless `fn(data_source=, solution_str=, ground_truth=,
    extra_info=, **provided)` binds to `fn`'s parameters."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError) as exc:
        raise RewardFunctionError(f"{where}: its signature cannot be inspected ({exc})") from exc
    params = signature.parameters
    takes_any_keyword = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    keyword_kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    passed = [*SCORER_ARGUMENTS, *sorted(set(provided) - set(SCORER_ARGUMENTS))]
    missing = [
        arg
        for arg in passed
        if not takes_any_keyword and not (arg in params and params[arg].kind in keyword_kinds)
    ]
    unfilled = [
        p.name
        for p in params.values()
        if p.kind in (*keyword_kinds, inspect.Parameter.POSITIONAL_ONLY)
        and p.default is inspect.Parameter.empty
        and p.name not in passed
    ]
    if missing or unfilled:
        problems = []
        if missing:
            problems.append(f"it cannot take the keyword argument(s) {', '.join(missing)}")
        if unfilled:
            problems.append(
                f"its parameter(s) {', '.join(unfilled)} have no default and are never passed"
            )
        raise RewardFunctionError(
            f"{where}{signature} does not fit the reward function signature: {'; '.join(problems)}. "
            f"Expected e.g. def {getattr(fn, '__name__', 'fn')}(data_source, solution_str, "
            f"ground_truth, extra_info=None, **kwargs)"
        )


async def _awaited(awaitable: Any) -> Any:
    return await awaitable


class FileRewardFunction:
    """A custom reward function as a scorer: called with verl's keywords plus `kwargs`.

    Picklable (it pickles as path, name and kwargs and reloads the file on first use), so it
    can be sent to process-pool workers, which cannot unpickle a function from a file that
    is not an importable module.
    """

    def __init__(
        self, path: str | Path, name: str = "compute_score", kwargs: dict[str, Any] | None = None
    ) -> None:
        self.path = str(path)
        self.name = name
        self.kwargs = dict(kwargs or {})
        self._fn: Callable | None = load_reward_function(self.path, name, self.kwargs)

    def __call__(
        self, data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None
    ) -> Any:
        if self._fn is None:
            self._fn = load_reward_function(self.path, self.name, self.kwargs)
        result = self._fn(
            data_source=data_source,
            solution_str=solution_str,
            ground_truth=ground_truth,
            extra_info=extra_info,
            **self.kwargs,
        )
        if inspect.isawaitable(result):  # an `async def` reward (e.g. one that calls a judge)
            result = asyncio.run(_awaited(result))
        return result

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path, "name": self.name, "kwargs": self.kwargs, "_fn": None}

    def __repr__(self) -> str:
        return f"FileRewardFunction({self.path!r}, {self.name!r})"
