"""Parsing tool calls out of generated text.

Hermes / Qwen format (what Qwen2.5/Qwen3 chat templates teach the model):

    <tool_call>
    {"name": "python", "arguments": {"code": "print(1 + 1)"}}
    </tool_call>

Several calls in one turn are run concurrently. A call whose JSON is broken is kept as a call
with an `error`, so the model is told what was wrong (and the loop counts a tool error)
instead of the call vanishing.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tephra.core.registry import Registry

_HERMES_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


@dataclass
class ToolCall:
    """One parsed call: `name` and `arguments`, or `error` when the call could not be read."""

    name: str | None
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


def parse_hermes_tool_calls(text: str) -> list[ToolCall]:
    """Every complete `<tool_call>{json}</tool_call>` block of `text`, in order.

    `arguments` may be an object or a JSON string holding an object (both occur in the wild).
    An unclosed `<tool_call>` (generation cut by the length limit) is not a call.
    """
    calls = []
    for index, match in enumerate(_HERMES_CALL.finditer(text)):
        body = match.group(1).strip()
        try:
            payload = json.loads(body)
        except json.JSONDecodeError as exc:
            calls.append(
                ToolCall(
                    None,
                    error=f"tool call {index} is not valid JSON ({exc.msg} at char {exc.pos}); "
                    'write {"name": ..., "arguments": {...}}',
                )
            )
            continue
        if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
            calls.append(
                ToolCall(
                    None, error=f'tool call {index} needs a string "name" and an object "arguments"'
                )
            )
            continue
        arguments = payload.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError:
                pass
        if not isinstance(arguments, dict):
            calls.append(
                ToolCall(
                    payload["name"], error=f'tool call {index}: "arguments" must be a JSON object'
                )
            )
            continue
        calls.append(ToolCall(payload["name"], arguments))
    return calls


TOOL_CALL_PARSERS: Registry[Callable[[str], list[ToolCall]]] = Registry("tool-call parser")
"""Functions text -> list[ToolCall], by the name of the chat format they read."""
TOOL_CALL_PARSERS.register("hermes", parse_hermes_tool_calls)
