"""The Anthropic Messages API (`POST /v1/messages`) over a trajectory session: content blocks
(`text`, `tool_use`, `tool_result`) in, `message` objects or the API's SSE events out."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from tephra.episodes.gateway.session import ChatRequest, GatewayRefusal, ServedTurn, text_of

MODEL = "tephra-policy"
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def _tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    out = []
    for tool in tools or []:
        if "input_schema" not in tool:
            raise GatewayRefusal(
                f"tool {tool.get('name')!r} has no input_schema; the gateway serves custom "
                "(client) tools only"
            )
        function = {"name": tool.get("name"), "parameters": tool["input_schema"]}
        if "description" in tool:
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out or None


def _message(message: dict[str, Any]) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages: an assistant's `tool_use` blocks become its
    tool calls; a user's `tool_result` blocks become tool messages (before its text)."""
    role, content = message.get("role"), message.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise GatewayRefusal(f"a {role!r} message's content must be a string or a list of blocks")
    text = "".join(b.get("text", "") for b in content if b.get("type") == "text")
    if role == "assistant":
        out: dict[str, Any] = {"role": "assistant", "content": text}
        calls = [
            {
                "id": b.get("id"),
                "type": "function",
                "function": {"name": b.get("name"), "arguments": json.dumps(b.get("input", {}))},
            }
            for b in content
            if b.get("type") == "tool_use"
        ]
        if calls:
            out["tool_calls"] = calls
        return [out]
    results = [
        {
            "role": "tool",
            "tool_call_id": b.get("tool_use_id"),
            "content": text_of(b.get("content")),
        }
        for b in content
        if b.get("type") == "tool_result"
    ]
    return results + ([{"role": "user", "content": text}] if text or not results else [])


def parse(body: dict[str, Any]) -> ChatRequest:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise GatewayRefusal("'messages' must be a non-empty list of messages")
    system = body.get("system")
    chat = [{"role": "system", "content": text_of(system)}] if system else []
    for message in messages:
        chat += _message(message)
    cap = body.get("max_tokens")
    return ChatRequest(chat, _tools(body.get("tools")), cap if isinstance(cap, int) else None)


def _blocks(turn: ServedTurn) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = [{"type": "text", "text": turn.content}]
    blocks += [
        {"type": "tool_use", "id": c.id, "name": c.name, "input": c.arguments}
        for c in turn.tool_calls
    ]
    return blocks


def _message_object(turn: ServedTurn, done: bool) -> dict[str, Any]:
    return {
        "id": f"msg_{turn.id}",
        "type": "message",
        "role": "assistant",
        "model": MODEL,
        "content": _blocks(turn) if done else [],
        "stop_reason": STOP_REASONS[turn.finish] if done else None,
        "stop_sequence": None,
        "usage": {
            "input_tokens": turn.prompt_tokens,
            "output_tokens": turn.completion_tokens if done else 0,
        },
    }


def render(turn: ServedTurn) -> dict[str, Any]:
    return _message_object(turn, done=True)


def stream(turn: ServedTurn) -> Iterator[str]:
    """The turn as Messages events: message_start, the text block (one delta per token
    piece), each tool_use block (its input in one JSON delta), message_delta, message_stop."""

    def event(kind: str, **data: Any) -> str:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"

    yield event("message_start", message=_message_object(turn, done=False))
    yield event("content_block_start", index=0, content_block={"type": "text", "text": ""})
    for piece in turn.pieces:
        yield event("content_block_delta", index=0, delta={"type": "text_delta", "text": piece})
    yield event("content_block_stop", index=0)
    for index, call in enumerate(turn.tool_calls, start=1):
        block = {"type": "tool_use", "id": call.id, "name": call.name, "input": {}}
        yield event("content_block_start", index=index, content_block=block)
        delta = {"type": "input_json_delta", "partial_json": call.arguments_json}
        yield event("content_block_delta", index=index, delta=delta)
        yield event("content_block_stop", index=index)
    yield event(
        "message_delta",
        delta={"stop_reason": STOP_REASONS[turn.finish], "stop_sequence": None},
        usage={"output_tokens": turn.completion_tokens},
    )
    yield event("message_stop")


def error(status: int, message: str) -> tuple[int, dict[str, Any]]:
    kind = "authentication_error" if status == 401 else "invalid_request_error"
    return status, {"type": "error", "error": {"type": kind, "message": message}}
