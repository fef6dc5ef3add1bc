"""The OpenAI Responses API (`POST /v1/responses`) over a trajectory session: `input` items
(messages, `function_call`, `function_call_output`) in, `response` objects or the API's
typed SSE events out. `previous_response_id` continues the trajectory from its last turn."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

from tephra.episodes.gateway.session import ChatRequest, GatewayRefusal, ServedTurn, text_of

MODEL = "tephra-policy"


def _tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses' flat function tools as chat-form schemas (other tool kinds are refused)."""
    out = []
    for tool in tools or []:
        if tool.get("type") != "function":
            raise GatewayRefusal(
                f"tool type {tool.get('type')!r} is not served; the gateway serves function tools"
            )
        function = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
        out.append({"type": "function", "function": function})
    return out or None


def _messages(items: Any) -> list[dict[str, Any]]:
    """`input` as chat messages: a function call joins the assistant message before it."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list):
        raise GatewayRefusal("'input' must be a string or a list of input items")
    messages: list[dict[str, Any]] = []
    for item in items:
        kind = item.get("type", "message")
        if kind == "message":
            role = "system" if item.get("role") == "developer" else item.get("role")
            messages.append({"role": role, "content": text_of(item.get("content"))})
        elif kind == "function_call":
            call = {
                "id": item.get("call_id"),
                "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments", "")},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": item.get("call_id"),
                    "content": output if isinstance(output, str) else text_of(output),
                }
            )
        elif kind == "reasoning":
            continue  # the policy wrote none; an agent may echo an empty one
        else:
            raise GatewayRefusal(f"input item type {kind!r} is not served")
    return messages


def parse(body: dict[str, Any]) -> ChatRequest:
    messages = _messages(body.get("input"))
    previous = body.get("previous_response_id")
    instructions = body.get("instructions")
    if instructions and not previous:
        messages = [{"role": "system", "content": str(instructions)}, *messages]
    if not messages:
        raise GatewayRefusal("'input' is empty")
    cap = body.get("max_output_tokens")
    return ChatRequest(
        messages,
        _tools(body.get("tools")),
        cap if isinstance(cap, int) else None,
        continues=previous[len("resp_") :] if isinstance(previous, str) else None,
    )


def _output(turn: ServedTurn) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [
        {
            "type": "message",
            "id": f"msg_{turn.id}",
            "role": "assistant",
            "status": "completed",
            "content": [{"type": "output_text", "text": turn.content, "annotations": []}],
        }
    ]
    out += [
        {
            "type": "function_call",
            "id": f"fc_{c.id}",
            "call_id": c.id,
            "name": c.name,
            "arguments": c.arguments_json,
            "status": "completed",
        }
        for c in turn.tool_calls
    ]
    return out


def _response(turn: ServedTurn, body: dict[str, Any], done: bool) -> dict[str, Any]:
    length = turn.finish == "length"
    return {
        "id": f"resp_{turn.id}",
        "object": "response",
        "created_at": int(time.time()),
        "model": MODEL,
        "status": ("incomplete" if length else "completed") if done else "in_progress",
        "incomplete_details": {"reason": "max_output_tokens"} if done and length else None,
        "error": None,
        "instructions": body.get("instructions"),
        "output": _output(turn) if done else [],
        "parallel_tool_calls": True,
        "tool_choice": body.get("tool_choice", "auto"),
        "tools": body.get("tools") or [],
        "previous_response_id": body.get("previous_response_id"),
        "usage": {
            "input_tokens": turn.prompt_tokens,
            "output_tokens": turn.completion_tokens,
            "total_tokens": turn.prompt_tokens + turn.completion_tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": 0},
        }
        if done
        else None,
    }


def render(turn: ServedTurn, body: dict[str, Any]) -> dict[str, Any]:
    return _response(turn, body, done=True)


def stream(turn: ServedTurn, body: dict[str, Any]) -> Iterator[str]:
    """The turn as Responses events: created, the message item (one text delta per token
    piece), each function-call item (its arguments in one delta), completed."""
    seq = iter(range(1 << 30))

    def event(kind: str, **data: Any) -> str:
        payload = {"type": kind, "sequence_number": next(seq), **data}
        return f"event: {kind}\ndata: {json.dumps(payload)}\n\n"

    yield event("response.created", response=_response(turn, body, done=False))
    yield event("response.in_progress", response=_response(turn, body, done=False))
    items = _output(turn)
    message = items[0]
    part = {"type": "output_text", "text": "", "annotations": []}
    yield event(
        "response.output_item.added",
        output_index=0,
        item={**message, "status": "in_progress", "content": []},
    )
    where = {"item_id": message["id"], "output_index": 0, "content_index": 0}
    yield event("response.content_part.added", **where, part=part)
    for piece in turn.pieces:
        yield event("response.output_text.delta", **where, delta=piece, logprobs=[])
    yield event("response.output_text.done", **where, text=turn.content, logprobs=[])
    yield event("response.content_part.done", **where, part=message["content"][0])
    yield event("response.output_item.done", output_index=0, item=message)
    for index, item in enumerate(items[1:], start=1):
        yield event(
            "response.output_item.added",
            output_index=index,
            item={**item, "arguments": "", "status": "in_progress"},
        )
        at = {"item_id": item["id"], "output_index": index}
        yield event("response.function_call_arguments.delta", **at, delta=item["arguments"])
        yield event("response.function_call_arguments.done", **at, arguments=item["arguments"])
        yield event("response.output_item.done", output_index=index, item=item)
    final = _response(turn, body, done=True)
    kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
    yield event(kind, response=final)


def error(status: int, message: str) -> tuple[int, dict[str, Any]]:
    kind = "invalid_request_error" if status != 401 else "authentication_error"
    code = "invalid_api_key" if status == 401 else None
    return status, {"error": {"message": message, "type": kind, "param": None, "code": code}}
