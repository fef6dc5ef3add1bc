"""The tool environment: the model's tool calls run, their results are the observation (what
the `tool_agent` episode talks to)."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from typing import Any, cast

from tephra.episodes.agent.base import AgentLoopConfig
from tephra.episodes.agent.tool_calls import TOOL_CALL_PARSERS, ToolCall
from tephra.episodes.environments.base import Environment, StepResult
from tephra.episodes.prompt import Prompt
from tephra.episodes.tools.base import Tool, ToolResult


class ToolTimeout(Exception):
    """A tool call passed `AgentLoopConfig.tool_timeout_s`."""


class ToolEnvironment(Environment):
    """Each model turn's tool calls (parsed in `config.tool_call_format`) run concurrently and
    their results come back as `tool` messages. The episode ends at a turn without a call
    (`stop`), at the last allowed turn when it still calls (`max_turns`: no turn would read the
    results), or when a call passes `tool_timeout_s` (`tool_timeout`). The reward scorer judges
    the final answer (`owns_reward` False); the tools' own `calc_reward`s are reported in
    `Sample.tool_rewards`."""

    owns_reward = False
    config: AgentLoopConfig  # never None here: __init__ fills in the default

    def __init__(
        self,
        tools: dict[str, Tool] | None = None,
        config: AgentLoopConfig | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(tools, config or AgentLoopConfig(), **kwargs)
        self.parse = TOOL_CALL_PARSERS.get(self.config.tool_call_format)
        self.offered: dict[str, Tool] = {}
        self.created: set[str] = set()
        self.create_lock = asyncio.Lock()
        self.turns = 0

    async def reset(self, item: Prompt) -> list[dict[str, Any]]:
        self.item = item
        if item.tools is None:
            self.offered = self.tools
        else:
            missing = [n for n in item.tools if n not in self.tools]
            if missing:
                raise KeyError(
                    f"sample {item.sample_id} asks for tools {missing}; the loop has "
                    f"{sorted(self.tools)}"
                )
            self.offered = {n: self.tools[n] for n in item.tools}
        return list(item.messages)

    def tool_schemas(self) -> list[dict[str, Any]] | None:
        if not self.config.render_tool_schemas:
            return None
        return [t.schema() for t in self.offered.values()] or None

    async def call_one(self, call: ToolCall, metrics: dict) -> ToolResult:
        if call.error is not None:
            return ToolResult("", error=call.error)
        # a parsed call without an error has a name
        tool = self.offered.get(cast(str, call.name))
        if tool is None:
            available = ", ".join(sorted(self.offered)) or "(none)"
            return ToolResult("", error=f"unknown tool {call.name!r}; available: {available}")
        try:
            async with self.create_lock:  # create once per trajectory, even for parallel calls
                if call.name not in self.created:
                    kwargs = self.item.tool_kwargs.get(cast(str, call.name), {})
                    await tool.create(self.item.sample_id, **kwargs)
                    self.created.add(cast(str, call.name))
            limit = self.config.tool_timeout_s
            try:
                async with asyncio.timeout(limit):
                    result = await tool.execute(self.item.sample_id, call.arguments)
            except TimeoutError:
                raise ToolTimeout(f"tool {call.name!r} passed its deadline of {limit} s") from None
        except ToolTimeout:
            raise
        except Exception as exc:  # a tool bug must not kill the other trajectories
            return ToolResult("", error=f"tool {call.name!r} raised {type(exc).__name__}: {exc}")
        for key, value in result.metrics.items():
            metrics[call.name][key] += value
        return result

    async def step(self, action: str) -> StepResult:
        cfg = self.config
        self.turns += 1
        calls = self.parse(action)
        if not calls:
            return StepResult(done=True, info={"finish_reason": "stop"})
        if self.turns >= cfg.max_turns:  # no turn left to read the results
            return StepResult(done=True, info={"finish_reason": "max_turns"})
        run_now, refused = (
            calls[: cfg.max_tool_calls_per_turn],
            calls[cfg.max_tool_calls_per_turn :],
        )
        metrics: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        try:
            results = list(await asyncio.gather(*(self.call_one(c, metrics) for c in run_now)))
        except ToolTimeout as exc:
            return StepResult(
                done=True,
                info={
                    "finish_reason": "tool_timeout",
                    "tool_calls": len(calls),
                    "tool_errors": 1,
                    "timeout": str(exc),
                },
            )
        results += [
            ToolResult(
                "",
                error=f"more than {cfg.max_tool_calls_per_turn} calls in one turn; "
                "this one was not run",
            )
            for _ in refused
        ]
        observation = [
            {
                "role": "tool",
                "name": c.name or "",
                "content": r.message_content()[: cfg.max_tool_response_chars],
            }
            for c, r in zip(calls, results)
        ]
        return StepResult(
            observation,
            info={
                "tool_calls": len(calls),
                "tool_errors": sum(not r.ok for r in results),
                "metrics": {k: dict(v) for k, v in metrics.items()},
            },
        )

    async def tool_rewards(self) -> dict[str, float]:
        return {
            name: float(await self.offered[name].calc_reward(self.item.sample_id))
            for name in sorted(self.created)
        }

    async def close(self) -> None:
        await asyncio.gather(
            *(self.offered[name].release(self.item.sample_id) for name in self.created),
            return_exceptions=True,
        )
