"""Parsing tool calls out of generated text, one parser per model family's format.

`hermes` (what the Qwen2.5 / Qwen3 / Hermes chat templates teach the model):

    <tool_call>
    {"name": "python", "arguments": {"code": "print(1 + 1)"}}
    </tool_call>

`qwen3_coder` (Qwen3-Coder's XML; one `<parameter=...>` block per argument):

    <tool_call>
    <function=python>
    <parameter=code>
    print(1 + 1)
    </parameter>
    </function>
    </tool_call>

`llama3_json` (Llama 3.1 / 3.2: the whole turn is one JSON object, `parameters` for the
arguments, optionally after `<|python_tag|>`; several objects may follow one another,
separated by `;` or whitespace):

    {"name": "python", "parameters": {"code": "print(1 + 1)"}}

`mistral` (`[TOOL_CALLS]` then a JSON list, or, from Mistral's v11 tokenizer on, one
`name[ARGS]{json}` per call, each after its own `[TOOL_CALLS]`):

    [TOOL_CALLS] [{"name": "python", "arguments": {"code": "print(1 + 1)"}}]
    [TOOL_CALLS]python[ARGS]{"code": "print(1 + 1)"}

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


_QWEN3_CODER_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_QWEN3_CODER_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.DOTALL)
_QWEN3_CODER_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)
_PYTHON_LITERALS = {"True": True, "False": False, "None": None}


def _xml_value(text: str) -> Any:
    """A `<parameter>` body as a value: the template writes objects and lists as JSON and
    everything else with Jinja's `string` (so `True`, `3`, `2.5`); strings stay strings."""
    if text.startswith("\n"):
        text = text[1:]
    if text.endswith("\n"):
        text = text[:-1]
    if text in _PYTHON_LITERALS:
        return _PYTHON_LITERALS[text]
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return text
    return value if not isinstance(value, str) else text


def parse_qwen3_coder_tool_calls(text: str) -> list[ToolCall]:
    """Every complete `<tool_call><function=NAME><parameter=P>value</parameter>...</function>
    </tool_call>` block of `text`, in order; an unclosed block is not a call."""
    calls = []
    for index, match in enumerate(_QWEN3_CODER_CALL.finditer(text)):
        function = _QWEN3_CODER_FUNCTION.search(match.group(1))
        if function is None:
            calls.append(
                ToolCall(
                    None,
                    error=f"tool call {index} has no <function=NAME>...</function> block; write "
                    "<tool_call>\n<function=NAME>\n<parameter=ARG>\nvalue\n</parameter>\n"
                    "</function>\n</tool_call>",
                )
            )
            continue
        arguments = {
            name.strip(): _xml_value(body)
            for name, body in _QWEN3_CODER_PARAMETER.findall(function.group(2))
        }
        calls.append(ToolCall(function.group(1).strip(), arguments))
    return calls


def _json_objects(text: str) -> list[tuple[Any, str | None]]:
    """The JSON values one after another in `text` (separated by whitespace or `;`): each
    (value, None), or (None, error) at the first that does not parse."""
    decoder = json.JSONDecoder()
    found: list[tuple[Any, str | None]] = []
    at = 0
    while True:
        while at < len(text) and (text[at].isspace() or text[at] == ";"):
            at += 1
        if at >= len(text):
            return found
        try:
            value, at = decoder.raw_decode(text, at)
        except json.JSONDecodeError as exc:
            found.append((None, f"not valid JSON ({exc.msg} at char {exc.pos})"))
            return found
        found.append((value, None))


def _call_from_object(index: int, payload: Any, arguments_key: str) -> ToolCall:
    if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
        return ToolCall(
            None, error=f'tool call {index} needs a string "name" and an object "{arguments_key}"'
        )
    arguments = payload.get(arguments_key, payload.get("arguments", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            pass
    if not isinstance(arguments, dict):
        return ToolCall(
            payload["name"], error=f'tool call {index}: "{arguments_key}" must be a JSON object'
        )
    return ToolCall(payload["name"], arguments)


def parse_llama3_json_tool_calls(text: str) -> list[ToolCall]:
    """Llama 3.1 / 3.2 JSON calls: a turn that is (after an optional `<|python_tag|>`) one or
    more `{"name": ..., "parameters": {...}}` objects. A turn that does not start with `{` is
    an answer, not a call; one that starts with `{` but is not such objects is a malformed
    call (the model is told)."""
    body = text.strip()
    if body.startswith("<|python_tag|>"):
        body = body[len("<|python_tag|>") :].strip()
    if not body.startswith("{"):
        return []
    calls = []
    for index, (value, error) in enumerate(_json_objects(body)):
        if error is not None:
            calls.append(
                ToolCall(
                    None,
                    error=f"tool call {index} is {error}; write "
                    '{"name": ..., "parameters": {...}}',
                )
            )
            break
        calls.append(_call_from_object(index, value, "parameters"))
    return calls


_MISTRAL_TAG = "[TOOL_CALLS]"
_MISTRAL_ARGS = "[ARGS]"


def parse_mistral_tool_calls(text: str) -> list[ToolCall]:
    """Mistral calls after `[TOOL_CALLS]`: a JSON list of `{"name", "arguments"}` objects
    (its `id` ignored), or `name[ARGS]{json}` (v11 tokenizers), one per `[TOOL_CALLS]`.
    Text before the first tag is the model's prose; a turn without the tag has no call."""
    if _MISTRAL_TAG not in text:
        return []
    calls: list[ToolCall] = []
    for part in text.split(_MISTRAL_TAG)[1:]:
        part = part.strip()
        if not part.startswith(("[", "{")):  # v11: NAME[ARGS]{json}
            name, _, args = part.partition(_MISTRAL_ARGS)
            found = _json_objects(args.strip())
            value, error = found[0] if found else (None, "empty")
            if error is not None or not isinstance(value, dict):
                calls.append(
                    ToolCall(
                        name.strip() or None,
                        error=f"tool call {len(calls)}: the arguments after [ARGS] are "
                        f"{error or 'not a JSON object'}; write NAME[ARGS]{{...}}",
                    )
                )
            else:
                calls.append(ToolCall(name.strip(), value))
            continue
        found = _json_objects(part)
        value, error = found[0] if found else (None, "empty")
        if error is not None or not isinstance(value, list | dict):
            calls.append(
                ToolCall(
                    None,
                    error=f"tool call {len(calls)} is {error or 'not a JSON list'}; write "
                    '[TOOL_CALLS] [{"name": ..., "arguments": {...}}]',
                )
            )
            continue
        for payload in value if isinstance(value, list) else [value]:
            calls.append(_call_from_object(len(calls), payload, "arguments"))
    return calls


TOOL_CALL_PARSERS: Registry[Callable[[str], list[ToolCall]]] = Registry("tool-call parser")
"""Functions text -> list[ToolCall], by the name of the chat format they read."""
TOOL_CALL_PARSERS.register("hermes", parse_hermes_tool_calls)
TOOL_CALL_PARSERS.register("qwen3_coder", parse_qwen3_coder_tool_calls)
TOOL_CALL_PARSERS.register("llama3_json", parse_llama3_json_tool_calls)
TOOL_CALL_PARSERS.register("mistral", parse_mistral_tool_calls)
