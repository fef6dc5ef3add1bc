"""What the environment loop does when an environment misbehaves: an exception in its
`reset` / `step` / `tool_rewards` becomes one line naming the environment, the item and the turn, and an
observation beyond `max_observation_chars` is cut (counted) or refused."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any, TypeVar

from tephra.core.errors import TephraError

T = TypeVar("T")

ENVIRONMENT_ERROR = "environment_error"
"""Finish reason of a trajectory dropped after its environment failed (`environment_errors=drop`)."""
ENVIRONMENT_ERROR_POLICIES = ("stop", "drop")
"""`rollout.agent.environment_errors`: stop the run, or drop the trajectory and count it."""
OVERSIZE_POLICIES = ("truncate", "refuse")
"""`rollout.agent.oversize_observation`: cut the observation to the limit, or refuse it."""
TRUNCATION_NOTE = "\n[observation truncated: {cut} of {total} characters removed]"


class EnvironmentFailure(TephraError, RuntimeError):
    """An environment raised in `reset` or `step`, or returned an observation beyond
    `rollout.agent.max_observation_chars` under `oversize_observation=refuse`; the message is
    the one line an operator reads."""


def item_name(origin: str, sample_id: str) -> str:
    """How an error names the item: its data row when known, and its sample id."""
    return f"{origin} (sample {sample_id!r})" if origin else f"sample {sample_id!r}"


async def call_environment(
    environment: str, item: str, method: str, turn: int, awaitable: Awaitable[T]
) -> T:
    """`await awaitable` (the environment's `method`); any exception but a deadline's becomes
    an `EnvironmentFailure` naming the environment, the item and the turn (the model turns
    done so far; 0 is `reset`, before the first one)."""
    try:
        return await awaitable
    except (TimeoutError, asyncio.CancelledError):
        raise  # a deadline of the loop's own, handled by its timeout policy
    except Exception as exc:
        first = (str(exc).strip().splitlines() or [""])[0]
        raise EnvironmentFailure(
            f"environment {environment!r} raised in {method} at turn {turn} of {item}: "
            f"{type(exc).__name__}: {first}; fix the environment, or set "
            "rollout.agent.environment_errors=drop to drop such trajectories (counted in "
            "agent/environment_errors)"
        ) from exc


def observation_chars(messages: list[dict[str, Any]]) -> int:
    """Characters of an observation's text (string contents and text parts)."""
    total = 0
    for message in messages:
        content = message.get("content")
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            total += sum(len(str(p.get("text") or "")) for p in content if isinstance(p, dict))
    return total


def limit_observation(
    messages: list[dict[str, Any]],
    max_chars: int | None,
    policy: str,
    environment: str,
    item: str,
    turn: int,
) -> tuple[list[dict[str, Any]], bool]:
    """(the observation within `max_chars`, whether it was cut). Under `truncate` each string
    content keeps its head within what is left of the budget, with a note of the cut; under
    `refuse` an observation beyond it raises `EnvironmentFailure`. Text parts of a multimodal
    content count but are not cut (they hold the image markers)."""
    total = observation_chars(messages)
    if max_chars is None or total <= max_chars:
        return messages, False
    if policy == "refuse":
        raise EnvironmentFailure(
            f"environment {environment!r} returned an observation of {total} characters after "
            f"turn {turn} of {item}, beyond rollout.agent.max_observation_chars={max_chars}; "
            "make the environment answer shorter, raise the limit, or set "
            "rollout.agent.oversize_observation=truncate"
        )
    left, cut_messages = max_chars, []
    for message in messages:
        content = message.get("content")
        if isinstance(content, str):
            kept = content[: max(left, 0)]
            left -= len(kept)
            if len(kept) < len(content):
                note = TRUNCATION_NOTE.format(cut=len(content) - len(kept), total=len(content))
                message = {**message, "content": kept + note}
        elif isinstance(content, list):
            left -= observation_chars([message])
        cut_messages.append(message)
    return cut_messages, True
