"""An OpenAI-compatible chat-completions endpoint for one trajectory that records the exact
tokens it serves.

A black-box agent (any code written against the `openai` client) is pointed at
`base_url`; each `POST /v1/chat/completions` is answered by the policy through the rollout's
`agenerate`, token-in-token-out: the first request's messages (and `tools`) are rendered with
the chat template once; every later request must repeat the conversation so far (the
assistant messages as served) and may add `tool` / `user` messages, which are appended as the
template's token delta. The served token ids and log-probs are kept, so the trajectory trains
on exactly what the policy produced, never on a re-tokenisation of the agent's text. A request
that rewrites the history is refused (HTTP 400, naming the message that differs).

Tool calls in a served turn are parsed with `AgentLoopConfig.tool_call_format` and returned
as OpenAI `tool_calls` (the message's `content` keeps the model's raw text, markup included,
so the agent can send it back unchanged).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from typing import TYPE_CHECKING, Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from tephra.episodes.agent.tool_calls import TOOL_CALL_PARSERS

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from tephra.episodes.agent.loops import _Run, _TokenLoop, _Trajectory
    from tephra.rollout.base import Rollout


class EndpointRefusal(Exception):
    """A request the endpoint cannot serve token-in-token-out (answered with HTTP 400)."""


class EndpointSession:
    """One trajectory's state behind the endpoint: its tokens (`traj`) and the conversation
    as served (`transcript`, OpenAI form)."""

    def __init__(
        self, loop: _TokenLoop, run: _Run, rollout: Rollout, sample_id: str, traj: _Trajectory
    ) -> None:
        self.loop, self.run, self.rollout, self.sample_id = loop, run, rollout, sample_id
        self.traj = traj
        self.transcript: list[dict[str, Any]] = []
        self.tools: list[dict] | None = None
        self.stop_text: str | None = None
        self.finish = "stop"
        self.call_names: dict[str, str] = {}
        self.lock = asyncio.Lock()  # one request at a time: the turns of a trajectory are ordered

    async def complete(self, body: dict[str, Any]) -> dict[str, Any]:
        async with self.lock:
            return await self._complete(body)

    async def _complete(self, body: dict[str, Any]) -> dict[str, Any]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise EndpointRefusal("'messages' must be a non-empty list of chat messages")
        tools = body.get("tools") or None
        if not self.transcript:
            self.tools = tools
            self.delta = self.loop.delta_for(tools)
            self.traj.prompt_ids = self.delta.prompt_ids([_plain(m) for m in messages])
            self.traj.messages = [_plain(m) for m in messages]
        else:
            if tools != self.tools:
                raise EndpointRefusal(
                    "'tools' differ from the first request's; a trajectory keeps one tool set"
                )
            new = self._new_messages(messages)
            plain = [self._plain_tool(m) for m in new]
            self.traj.add_observation(self.delta.append_ids(plain, self.stop_text))
            self.traj.messages.extend(plain)
        self.transcript = list(messages)
        budget = self.loop.turn_budget(
            self.run, len(self.traj.prompt_ids) + len(self.traj.ids), len(self.traj.ids)
        )
        if isinstance(body.get("max_tokens"), int):
            budget = min(budget, body["max_tokens"])
        if isinstance(body.get("max_completion_tokens"), int):
            budget = min(budget, body["max_completion_tokens"])
        if budget < 1:
            self.finish = "length"
            return self._response({"role": "assistant", "content": ""}, "length")
        limit = self.loop.config.turn_timeout_s
        try:
            async with asyncio.timeout(limit):
                gen = await self.rollout.agenerate(
                    self.traj.prompt_ids + self.traj.ids,
                    self.run.sampling.replace(max_tokens=budget),
                    session_id=self.sample_id,
                )
        except TimeoutError:
            self.finish = "turn_timeout"
            raise EndpointRefusal(f"the turn passed its deadline of {limit} s") from None
        self.traj.add_generated(gen)
        content, self.stop_text = self.loop.text_of_turn(
            self.run, gen.response_ids, gen.finish_reason
        )
        self.traj.messages.append({"role": "assistant", "content": content})
        self.finish = "length" if gen.finish_reason == "length" else "stop"
        message: dict[str, Any] = {"role": "assistant", "content": content}
        reason = self.finish
        if tools and gen.finish_reason != "length":
            calls = TOOL_CALL_PARSERS.get(self.loop.config.tool_call_format)(content)
            calls = [c for c in calls if c.error is None]
            if calls:
                turn = self.traj.num_turns
                message["tool_calls"] = [
                    {
                        "id": f"call_{turn}_{k}",
                        "type": "function",
                        "function": {"name": c.name, "arguments": json.dumps(c.arguments)},
                    }
                    for k, c in enumerate(calls)
                ]
                self.call_names.update(
                    {t["id"]: c.name for t, c in zip(message["tool_calls"], calls)}
                )
                self.traj.tool_calls += len(calls)
                reason = "tool_calls"
        self.served = message
        return self._response(message, reason)

    def _new_messages(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The messages a request adds after the conversation so far (which it must repeat,
        the last assistant message as served)."""
        history = [*self.transcript, self.served]
        for k, (sent, kept) in enumerate(zip(messages, history)):
            if not _same_message(sent, kept):
                raise EndpointRefusal(
                    f"message {k} ({sent.get('role')!r}) differs from the conversation so far; "
                    "the endpoint trains one token-in-token-out trajectory: send the whole "
                    "history unchanged, with the assistant messages as they were served"
                )
        if len(messages) <= len(history):
            raise EndpointRefusal(
                "the request adds no message after the last assistant turn; add tool or user "
                "messages (or stop: the trajectory is done)"
            )
        new = messages[len(history) :]
        bad = [m.get("role") for m in new if m.get("role") not in ("tool", "user")]
        if bad:
            raise EndpointRefusal(
                f"the request adds messages with roles {bad}; only 'tool' and 'user' messages "
                "may follow a served turn (an assistant message the policy did not write "
                "cannot be trained on)"
            )
        return new

    def _plain_tool(self, message: dict[str, Any]) -> dict[str, Any]:
        plain = _plain(message)
        if message.get("role") == "tool":
            plain["name"] = self.call_names.get(message.get("tool_call_id", ""), "")
        return plain

    def _response(self, message: dict[str, Any], reason: str) -> dict[str, Any]:
        return {
            "id": f"chatcmpl-{self.sample_id}-{self.traj.num_turns}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": "tephra-policy",
            "choices": [
                {"index": 0, "message": message, "finish_reason": reason, "logprobs": None}
            ],
            "usage": {
                "prompt_tokens": len(self.traj.prompt_ids),
                "completion_tokens": sum(self.traj.mask),
                "total_tokens": len(self.traj.prompt_ids) + len(self.traj.ids),
            },
        }


def _text(content: Any) -> str:
    """A message's content as text (OpenAI content parts joined)."""
    if content is None:
        return ""
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return str(content)


def _plain(message: dict[str, Any]) -> dict[str, Any]:
    """`message` as the chat template reads it: role and text content."""
    return {"role": message.get("role"), "content": _text(message.get("content"))}


def _same_message(sent: dict[str, Any], kept: dict[str, Any]) -> bool:
    if sent.get("role") != kept.get("role") or _text(sent.get("content")) != _text(
        kept.get("content")
    ):
        return False
    ids = [c.get("id") for c in sent.get("tool_calls") or []]
    return ids == [c.get("id") for c in kept.get("tool_calls") or []]


@contextlib.asynccontextmanager
async def serve(session: EndpointSession) -> AsyncIterator[str]:
    """Serve `session` on a free local port for the body of the `async with`; yields the
    `base_url` for an OpenAI client (`.../v1`)."""

    async def completions(request: Request) -> JSONResponse:
        try:
            body = await request.json()
        except json.JSONDecodeError:
            return _error("the request body is not JSON")
        try:
            return JSONResponse(await session.complete(body))
        except EndpointRefusal as exc:
            return _error(str(exc))

    app = Starlette(routes=[Route("/v1/chat/completions", completions, methods=["POST"])])
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False)
    )
    # the trainer owns the signals (and many sessions' servers run at once)
    server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign]
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        while not server.started:
            if task.done():
                task.result()  # raises what stopped it
            await asyncio.sleep(0.005)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        server.should_exit = True
        try:
            await asyncio.wait_for(task, 5.0)
        except TimeoutError:
            task.cancel()
        sock.close()


def _error(message: str) -> JSONResponse:
    # 400: the openai client raises BadRequestError with this message and does not retry
    return JSONResponse(
        {"error": {"message": message, "type": "invalid_request_error"}}, status_code=400
    )
