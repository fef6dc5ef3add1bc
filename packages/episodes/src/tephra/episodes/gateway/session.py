"""One trajectory behind the gateway: the API-neutral conversation it serves token-in-token-out.

Each API module turns its request into a `ChatRequest` (OpenAI chat-form messages: `role`,
`content` text, an assistant's `tool_calls`, a tool message's `tool_call_id`) and a
`ServedTurn` back into its own response. The first request's messages (and tools) are rendered
with the chat template once; every later one must repeat the conversation so far (the
assistant turns as served) and may add `tool` / `user` messages, appended as the template's
token delta. The served token ids and log-probs are kept as the backend returned them, so the
trajectory trains on exactly what the policy produced, never on a re-tokenisation of the
agent's text.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tephra.episodes.agent.tool_calls import TOOL_CALL_PARSERS

if TYPE_CHECKING:
    from tephra.episodes.agent.loops import _Run, _TokenLoop, _Trajectory
    from tephra.rollout.base import Rollout


class GatewayRefusal(Exception):
    """A request the gateway cannot serve token-in-token-out (HTTP 400 in the API's format)."""


@dataclass
class ChatRequest:
    """One API request in the gateway's neutral form."""

    messages: list[dict[str, Any]]
    """The conversation (OpenAI chat form). With `continues`, only the messages after it."""
    tools: list[dict[str, Any]] | None = None
    """Tool schemas, OpenAI chat form (`{"type": "function", "function": {...}}`)."""
    max_tokens: int | None = None
    """The caller's cap on the turn (it can only lower the trainer's)."""
    continues: str | None = None
    """The id of the served turn this request follows (the Responses API's
    `previous_response_id`): then `messages` holds only what is added after it."""


@dataclass
class ToolCallOut:
    """One tool call of a served turn, as every API returns it."""

    id: str
    name: str
    arguments: dict[str, Any]

    @property
    def arguments_json(self) -> str:
        return json.dumps(self.arguments)


@dataclass
class ServedTurn:
    """One model turn as served: its text, its tokens and how it ended."""

    id: str
    content: str
    """The decoded turn without its stop token (tool-call markup included)."""
    pieces: list[str]
    """`content` cut at token boundaries, for streaming (they join to `content`)."""
    tool_calls: list[ToolCallOut]
    finish: str
    """`stop`, `length` or `tool_calls`."""
    response_ids: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def chat_message(self) -> dict[str, Any]:
        """The turn as an OpenAI chat message (the form the session keeps its history in)."""
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            message["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments_json},
                }
                for c in self.tool_calls
            ]
        return message


class TrajectorySession:
    """One trajectory's state behind the gateway: its tokens (`traj`), the conversation as
    served (OpenAI chat form) and the turns served (`turns`)."""

    def __init__(
        self, loop: _TokenLoop, run: _Run, rollout: Rollout, sample_id: str, traj: _Trajectory
    ) -> None:
        self.loop, self.run, self.rollout, self.sample_id = loop, run, rollout, sample_id
        self.traj = traj
        self.history: list[dict[str, Any]] = []  # every message so far, served turns included
        self.tools: list[dict[str, Any]] | None = None
        self.turns: list[ServedTurn] = []
        self.stop_text: str | None = None
        self.finish = "stop"
        self.call_names: dict[str, str] = {}
        self.lock = asyncio.Lock()  # one request at a time: the turns of a trajectory are ordered

    async def complete(self, request: ChatRequest) -> ServedTurn:
        async with self.lock:
            return await self._complete(request)

    async def _complete(self, request: ChatRequest) -> ServedTurn:
        messages, tools = request.messages, request.tools or None
        if not self.turns:
            if request.continues is not None:
                raise GatewayRefusal(
                    f"previous response {request.continues!r} is not a turn of this trajectory "
                    "(it has served none yet)"
                )
            if not messages:
                raise GatewayRefusal("the request has no messages")
            self.tools = tools
            self.delta = self.loop.delta_for(tools)
            plain = [self._plain(m) for m in messages]
            self.traj.prompt_ids = self.delta.prompt_ids(plain)
            self.traj.messages = plain
            self.history = list(messages)
        else:
            if tools != self.tools:
                raise GatewayRefusal(
                    "'tools' differ from the first request's; a trajectory keeps one tool set"
                )
            new = self._new_messages(request)
            plain = [self._plain(m) for m in new]
            self.traj.add_observation(self.delta.append_ids(plain, self.stop_text))
            self.traj.messages.extend(plain)
            self.history.extend(new)
        return await self._generate(request)

    async def _generate(self, request: ChatRequest) -> ServedTurn:
        traj, turn_index = self.traj, len(self.turns)
        context = len(traj.prompt_ids) + len(traj.ids)
        budget = self.loop.turn_budget(self.run, context, len(traj.ids))
        if request.max_tokens is not None:
            budget = min(budget, request.max_tokens)
        turn_id = f"{self.sample_id}-{turn_index}"
        if budget < 1:
            self.finish = "length"
            served = ServedTurn(turn_id, "", [], [], "length", prompt_tokens=context)
            return self._serve(served)
        limit = self.loop.config.turn_timeout_s
        try:
            async with asyncio.timeout(limit):
                gen = await self.rollout.agenerate(
                    traj.prompt_ids + traj.ids,
                    self.loop.turn_sampling(self.run, self.sample_id, traj.num_turns, budget),
                    session_id=self.sample_id,
                )
        except TimeoutError:
            self.finish = "turn_timeout"
            raise GatewayRefusal(f"the turn passed its deadline of {limit} s") from None
        traj.add_generated(gen)
        content, self.stop_text = self.loop.text_of_turn(
            self.run, gen.response_ids, gen.finish_reason
        )
        traj.messages.append({"role": "assistant", "content": content})
        self.finish = "length" if gen.finish_reason == "length" else "stop"
        calls: list[ToolCallOut] = []
        if self.tools and gen.finish_reason != "length":
            parsed = TOOL_CALL_PARSERS.get(self.loop.config.tool_call_format)(content)
            named = [(c.name, c.arguments) for c in parsed if c.error is None and c.name]
            calls = [
                ToolCallOut(f"call_{turn_index}_{k}", name, arguments)
                for k, (name, arguments) in enumerate(named)
            ]
            self.call_names.update({c.id: c.name for c in calls})
            traj.tool_calls += len(calls)
        content_ids = gen.response_ids[:-1] if self.stop_text is not None else gen.response_ids
        served = ServedTurn(
            turn_id,
            content,
            self._pieces(list(content_ids), content),
            calls,
            "tool_calls" if calls else self.finish,
            list(gen.response_ids),
            list(gen.log_probs) if gen.log_probs is not None else [0.0] * len(gen.response_ids),
            prompt_tokens=context,
            completion_tokens=len(gen.response_ids),
        )
        return self._serve(served)

    def _serve(self, served: ServedTurn) -> ServedTurn:
        self.turns.append(served)
        self.history.append(served.chat_message())
        return served

    def _pieces(self, ids: list[int], content: str) -> list[str]:
        """`content` cut where its tokens end (a token ending inside a UTF-8 character waits
        for the next), so the streamed deltas join to exactly the served text."""
        pieces: list[str] = []
        done = ""
        for k in range(1, len(ids) + 1):
            text = self.loop.tokenizer.decode(ids[:k], skip_special_tokens=False)
            if text.endswith("\ufffd") or not text.startswith(done) or len(text) == len(done):
                continue
            if not content.startswith(text):
                break
            pieces.append(text[len(done) :])
            done = text
        if len(done) < len(content):
            pieces.append(content[len(done) :])
        return pieces

    def _new_messages(self, request: ChatRequest) -> list[dict[str, Any]]:
        """The messages a request adds after the conversation so far (which it must repeat,
        the assistant turns as served, unless it names the last served turn)."""
        if request.continues is not None:
            if request.continues != self.turns[-1].id:
                raise GatewayRefusal(
                    f"previous response {request.continues!r} is not the last turn of this "
                    f"trajectory ({self.turns[-1].id!r}); a trajectory is one conversation"
                )
            new = request.messages
        else:
            messages = request.messages
            for k, (sent, kept) in enumerate(zip(messages, self.history)):
                if not same_message(sent, kept):
                    raise GatewayRefusal(
                        f"message {k} ({sent.get('role')!r}) differs from the conversation so "
                        "far; the gateway trains one token-in-token-out trajectory: send the "
                        "whole history unchanged, with the assistant messages as they were "
                        "served"
                    )
            if len(messages) < len(self.history):
                raise GatewayRefusal(
                    f"the request repeats {len(messages)} of the {len(self.history)} messages "
                    "so far; send the whole history, with the assistant messages as served"
                )
            new = messages[len(self.history) :]
        if not new:
            raise GatewayRefusal(
                "the request adds no message after the last assistant turn; add tool or user "
                "messages (or stop: the trajectory is done)"
            )
        bad = [m.get("role") for m in new if m.get("role") not in ("tool", "user")]
        if bad:
            raise GatewayRefusal(
                f"the request adds messages with roles {bad}; only 'tool' and 'user' messages "
                "may follow a served turn (an assistant message the policy did not write "
                "cannot be trained on)"
            )
        return new

    def _plain(self, message: dict[str, Any]) -> dict[str, Any]:
        """`message` as the chat template reads it: role and text (a tool result's name)."""
        plain = {"role": message.get("role"), "content": text_of(message.get("content"))}
        if message.get("role") == "tool":
            plain["name"] = self.call_names.get(message.get("tool_call_id", ""), "")
        return plain


def text_of(content: Any) -> str:
    """A message's content as text (content parts or blocks joined)."""
    if content is None:
        return ""
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return str(content)


def same_message(sent: dict[str, Any], kept: dict[str, Any]) -> bool:
    """Whether a repeated message is the one kept: role, text and tool-call ids."""
    if sent.get("role") != kept.get("role") or text_of(sent.get("content")) != text_of(
        kept.get("content")
    ):
        return False
    if sent.get("tool_call_id") != kept.get("tool_call_id"):
        return False
    ids = [c.get("id") for c in sent.get("tool_calls") or []]
    return ids == [c.get("id") for c in kept.get("tool_calls") or []]
