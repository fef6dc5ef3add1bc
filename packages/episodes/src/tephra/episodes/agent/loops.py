"""Built-in agent loops: `single_turn` (one model turn) and `tool_agent` (model <-> tools)."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from tephra.episodes.agent.base import AgentLoop, AgentSample, check_one_sample
from tephra.episodes.agent.chat_tokens import ChatTemplateDelta
from tephra.episodes.agent.tool_calls import TOOL_CALL_PARSERS, ToolCall
from tephra.episodes.tools.base import Tool, ToolResult
from tephra.rollout.base import Rollout, SamplingParams
from tephra.rollout.samples import Sample


@dataclass(frozen=True)
class _Run:
    """One run's sampling settings and what follows from them and its rollout."""

    sampling: SamplingParams
    max_model_len: int | None
    stop_ids: set[int]


class _TokenLoop(AgentLoop):
    """Shared parts: the chat-template renderer per tool set, the model-length budget."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deltas: dict[tuple[str, ...], ChatTemplateDelta] = {}

    def offered_tools(self, sample: AgentSample) -> dict[str, Tool]:
        if sample.tools is None:
            return self.tools
        missing = [n for n in sample.tools if n not in self.tools]
        if missing:
            raise KeyError(
                f"sample {sample.sample_id} asks for tools {missing}; the loop has {sorted(self.tools)}"
            )
        return {n: self.tools[n] for n in sample.tools}

    def delta(self, tools: dict[str, Tool]) -> ChatTemplateDelta:
        key = tuple(tools)
        if key not in self._deltas:
            schemas = (
                [t.schema() for t in tools.values()] if self.config.render_tool_schemas else None
            )
            self._deltas[key] = ChatTemplateDelta(self.tokenizer, schemas)
        return self._deltas[key]

    def begin(self, rollout: Rollout, sampling: SamplingParams) -> _Run:
        """What one run needs to know of its rollout and sampling settings."""
        check_one_sample(sampling)
        eos = getattr(self.tokenizer, "eos_token_id", None)
        return _Run(
            sampling,
            # a scripted test model may have no config: then no length limit but the budgets
            getattr(getattr(rollout, "config", None), "max_model_len", None),
            set(sampling.stop_token_ids) | ({eos} if eos is not None else set()),
        )

    def turn_budget(self, run: _Run, context_len: int, response_len: int) -> int:
        """max_tokens of the next model turn: the sampling cap, the trajectory's remaining
        response budget and the room left in the model's context."""
        budget = min(run.sampling.max_tokens, self.config.max_response_tokens - response_len)
        if run.max_model_len is not None:
            budget = min(budget, run.max_model_len - context_len)
        return budget

    def text_of_turn(self, run: _Run, ids: list[int], finish_reason: str) -> tuple[str, str | None]:
        """(content, stop text): the decoded turn without its final stop token, and that token.

        The `Rollout` contract keeps the stop token as the last id of a 'stop' turn; it may be
        one of the model's EOS ids that the tokenizer does not call EOS (Qwen: <|endoftext|>)."""
        if ids and (finish_reason == "stop" or ids[-1] in run.stop_ids):
            return (
                self.tokenizer.decode(ids[:-1], skip_special_tokens=False),
                self.tokenizer.decode(ids[-1:], skip_special_tokens=False),
            )
        return self.tokenizer.decode(ids, skip_special_tokens=False), None


class SingleTurnAgentLoop(_TokenLoop):
    """One model turn; the trajectory is the generation (mask all ones)."""

    async def run(self, rollout: Rollout, sample: AgentSample, sampling: SamplingParams) -> Sample:
        run = self.begin(rollout, sampling)
        delta = self.delta({})
        prompt_ids = (
            list(sample.prompt_ids) if sample.prompt_ids else delta.prompt_ids(sample.messages)
        )
        budget = self.turn_budget(run, len(prompt_ids), 0)
        if budget < 1:
            return _empty(sample, prompt_ids)
        gen = await rollout.agenerate(
            prompt_ids, sampling.replace(max_tokens=budget), session_id=sample.sample_id
        )
        content, _ = self.text_of_turn(run, gen.response_ids, gen.finish_reason)
        return Sample(
            sample_id=sample.sample_id,
            prompt_ids=prompt_ids,
            response_ids=list(gen.response_ids),
            response_mask=[1] * len(gen.response_ids),
            log_probs=list(gen.log_probs)
            if gen.log_probs is not None
            else [0.0] * len(gen.response_ids),
            num_turns=1,
            tool_calls=0,
            tool_errors=0,
            finish_reason=gen.finish_reason,
            text=content,
            messages=[*sample.messages, {"role": "assistant", "content": content}],
            extra_info=dict(sample.extra_info),
            token_versions=list(gen.token_versions) if gen.token_versions is not None else None,
        )


class ToolAgentLoop(_TokenLoop):
    """generate -> parse tool calls -> run them concurrently -> append their results as tokens
    -> generate ..., until a turn has no tool call, `max_turns` or the token budget."""

    async def run(self, rollout: Rollout, sample: AgentSample, sampling: SamplingParams) -> Sample:
        run = self.begin(rollout, sampling)
        cfg = self.config
        tools = self.offered_tools(sample)
        delta = self.delta(tools)
        parse = TOOL_CALL_PARSERS.get(cfg.tool_call_format)
        prompt_ids = (
            list(sample.prompt_ids) if sample.prompt_ids else delta.prompt_ids(sample.messages)
        )
        instance_id = sample.sample_id
        messages = list(sample.messages)
        ids: list[int] = []
        mask: list[int] = []
        log_probs: list[float] = []
        versions: list[int] | None = []  # None once a turn comes untagged
        num_turns = calls_made = errors = 0
        finish = "max_turns"
        created: set[str] = set()
        create_lock = asyncio.Lock()
        metrics: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))

        async def call_one(call: ToolCall) -> ToolResult:
            if call.error is not None:
                return ToolResult("", error=call.error)
            tool = tools.get(call.name)
            if tool is None:
                return ToolResult(
                    "",
                    error=f"unknown tool {call.name!r}; available: {', '.join(sorted(tools)) or '(none)'}",
                )
            try:
                async with create_lock:  # create once per trajectory, even for parallel calls
                    if call.name not in created:
                        await tool.create(instance_id, **sample.tool_kwargs.get(call.name, {}))
                        created.add(call.name)
                result = await tool.execute(instance_id, call.arguments)
            except Exception as exc:  # a tool bug must not kill the other trajectories
                return ToolResult(
                    "", error=f"tool {call.name!r} raised {type(exc).__name__}: {exc}"
                )
            for key, value in result.metrics.items():
                metrics[call.name][key] += value
            return result

        try:
            for turn in range(cfg.max_turns):
                budget = self.turn_budget(run, len(prompt_ids) + len(ids), len(ids))
                if budget < 1:
                    finish = "length"
                    break
                gen = await rollout.agenerate(
                    prompt_ids + ids,
                    sampling.replace(max_tokens=budget),
                    session_id=instance_id,
                )
                num_turns += 1
                ids += gen.response_ids
                mask += [1] * len(gen.response_ids)
                log_probs += (
                    list(gen.log_probs)
                    if gen.log_probs is not None
                    else [0.0] * len(gen.response_ids)
                )
                versions = (
                    versions + list(gen.token_versions)
                    if versions is not None and gen.token_versions is not None
                    else None
                )
                content, stop_text = self.text_of_turn(run, gen.response_ids, gen.finish_reason)
                messages.append({"role": "assistant", "content": content})
                if gen.finish_reason == "length":
                    finish = "length"
                    break
                calls = parse(content)
                if not calls:
                    finish = "stop"
                    break
                if turn == cfg.max_turns - 1:
                    break  # no turn left to read the results: 'max_turns'
                calls_made += len(calls)
                run_now, refused = (
                    calls[: cfg.max_tool_calls_per_turn],
                    calls[cfg.max_tool_calls_per_turn :],
                )
                results = list(await asyncio.gather(*(call_one(c) for c in run_now)))
                results += [
                    ToolResult(
                        "",
                        error=f"more than {cfg.max_tool_calls_per_turn} calls in one turn; "
                        "this one was not run",
                    )
                    for _ in refused
                ]
                errors += sum(not r.ok for r in results)
                tool_messages = [
                    {
                        "role": "tool",
                        "name": c.name or "",
                        "content": r.message_content()[: cfg.max_tool_response_chars],
                    }
                    for c, r in zip(calls, results)
                ]
                messages.extend(tool_messages)
                tool_ids = delta.append_ids(tool_messages, stop_text)
                room = cfg.max_response_tokens - len(ids)
                if run.max_model_len is not None:
                    room = min(room, run.max_model_len - len(prompt_ids) - len(ids))
                cut = len(tool_ids) >= room  # no room left for a model token after it
                tool_ids = tool_ids[: max(room, 0)]
                ids += tool_ids
                mask += [0] * len(tool_ids)
                log_probs += [0.0] * len(tool_ids)
                if versions is not None:  # context for the next turn: the version it answers
                    versions += [versions[-1]] * len(tool_ids)
                if cut:
                    finish = "length"
                    break
            rewards = {
                name: float(await tools[name].calc_reward(instance_id)) for name in sorted(created)
            }
        finally:
            await asyncio.gather(
                *(tools[name].release(instance_id) for name in created), return_exceptions=True
            )
        return Sample(
            sample_id=sample.sample_id,
            prompt_ids=prompt_ids,
            response_ids=ids,
            response_mask=mask,
            log_probs=log_probs,
            num_turns=num_turns,
            tool_calls=calls_made,
            tool_errors=errors,
            finish_reason=finish,
            text=final_answer(messages),
            messages=messages,
            tool_rewards=rewards,
            extra_info={
                **sample.extra_info,
                "tool_metrics": {k: dict(v) for k, v in metrics.items()},
            },
            token_versions=versions if versions is not None and num_turns else None,
        )


def _empty(sample: AgentSample, prompt_ids: list[int]) -> Sample:
    return Sample(
        sample_id=sample.sample_id,
        prompt_ids=prompt_ids,
        response_ids=[],
        response_mask=[],
        log_probs=[],
        num_turns=0,
        finish_reason="length",
        messages=list(sample.messages),
        extra_info=dict(sample.extra_info),
    )


def final_answer(messages: list[dict[str, Any]]) -> str:
    """The last assistant message of a transcript: what the reward scores (earlier turns are
    tool calls)."""
    return next((m["content"] for m in reversed(messages) if m.get("role") == "assistant"), "")
