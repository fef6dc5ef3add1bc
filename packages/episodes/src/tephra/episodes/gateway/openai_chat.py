"""The OpenAI Chat Completions API (`POST /v1/chat/completions`) over a trajectory session:
requests in, `chat.completion` objects or `chat.completion.chunk` SSE streams out."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

from tephra.episodes.gateway.session import ChatRequest, GatewayRefusal, ServedTurn

MODEL = "tephra-policy"


def parse(body: dict[str, Any]) -> ChatRequest:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise GatewayRefusal("'messages' must be a non-empty list of chat messages")
    if body.get("n") not in (None, 1):
        raise GatewayRefusal(f"'n'={body.get('n')!r}: the gateway serves one choice per turn")
    cap = [body[k] for k in ("max_tokens", "max_completion_tokens") if isinstance(body.get(k), int)]
    return ChatRequest(list(messages), body.get("tools") or None, min(cap) if cap else None)


def _usage(turn: ServedTurn) -> dict[str, int]:
    return {
        "prompt_tokens": turn.prompt_tokens,
        "completion_tokens": turn.completion_tokens,
        "total_tokens": turn.prompt_tokens + turn.completion_tokens,
    }


def render(turn: ServedTurn) -> dict[str, Any]:
    return {
        "id": f"chatcmpl-{turn.id}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": MODEL,
        "choices": [
            {
                "index": 0,
                "message": turn.chat_message(),
                "finish_reason": turn.finish,
                "logprobs": None,
            }
        ],
        "usage": _usage(turn),
    }


def stream(turn: ServedTurn, body: dict[str, Any]) -> Iterator[str]:
    """The turn as `chat.completion.chunk` events: the role, one content delta per token
    piece, each tool call whole, the finish reason, the usage when asked, `[DONE]`."""
    head = {
        "id": f"chatcmpl-{turn.id}",
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": MODEL,
    }

    def chunk(delta: dict[str, Any], finish: str | None = None) -> str:
        choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
        return f"data: {json.dumps({**head, 'choices': [choice]})}\n\n"

    yield chunk({"role": "assistant", "content": ""})
    for piece in turn.pieces:
        yield chunk({"content": piece})
    for k, call in enumerate(turn.tool_calls):
        yield chunk(
            {
                "tool_calls": [
                    {
                        "index": k,
                        "id": call.id,
                        "type": "function",
                        "function": {"name": call.name, "arguments": call.arguments_json},
                    }
                ]
            }
        )
    yield chunk({}, turn.finish)
    if (body.get("stream_options") or {}).get("include_usage"):
        yield f"data: {json.dumps({**head, 'choices': [], 'usage': _usage(turn)})}\n\n"
    yield "data: [DONE]\n\n"


def error(status: int, message: str) -> tuple[int, dict[str, Any]]:
    kind = "invalid_request_error" if status != 401 else "authentication_error"
    code = "invalid_api_key" if status == 401 else None
    return status, {"error": {"message": message, "type": kind, "param": None, "code": code}}
