"""The `Tool` contract: what an agent loop can call between model turns.

A tool has one OpenAI function schema (what the chat template shows the model) and a
per-trajectory lifecycle: `create` when a trajectory starts using it, `execute` for each call,
`calc_reward` once at the end (a tool may score the trajectory, e.g. a test runner), `release`
to free what `create` took. `instance_id` keys the per-trajectory state, so one tool object
serves many trajectories in flight at once. `close` ends the tool's own life: whoever built the
tools (e.g. `load_tools` in the RL worker) calls `close_tools` once at shutdown.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from tephra.core.errors import ConfigError, TephraError


class ToolError(TephraError, RuntimeError):
    """A tool cannot start or was used wrongly by the program (not by the model)."""


class ToolConfigError(TephraError, ValueError):
    """A tools YAML file or a tool's config is wrong; the message names the file and entry."""


@dataclass
class ToolResult:
    """What one call returns to the model.

    `text` is shown to the model as the tool message. `error` is None on success, otherwise a
    one-line reason (also shown to the model: it is part of the environment's answer, and the
    loop counts it in `Sample.tool_errors`). `metrics` are numbers for logging only.
    """

    text: str
    error: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.error is None

    def message_content(self) -> str:
        """The text the model sees: the output, then the error if any."""
        if self.error is None:
            return self.text
        return f"{self.text}\nError: {self.error}" if self.text else f"Error: {self.error}"


class Tool(ABC):
    """A callable tool. Subclasses set `name`, `description` and `parameters` (JSON Schema).

    Built from a config dict (the `config:` of a YAML entry) by `Tool.from_config`, which passes
    the keys as keyword arguments to `__init__`.
    """

    name: str = ""
    description: str = ""
    parameters: dict[str, Any] = {"type": "object", "properties": {}, "required": []}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Tool:
        try:
            return cls(**config)
        except TypeError as exc:
            raise ConfigError(
                f"tool {cls.__name__}: bad config keys {sorted(config)}: {exc}"
            ) from exc

    def schema(self) -> dict[str, Any]:
        """The OpenAI function schema: `{"type": "function", "function": {name, description, parameters}}`."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.parameters,
            },
        }

    async def create(self, instance_id: str, **kwargs: Any) -> None:
        """Start the per-trajectory state of `instance_id` (kwargs come from the sample's
        `tool_kwargs[name]`, e.g. the ground truth a checker tool needs). Optional: the
        default keeps no state."""
        return None

    @abstractmethod
    async def execute(self, instance_id: str, arguments: dict[str, Any]) -> ToolResult:
        """Run one call with the model's `arguments` (already parsed from JSON)."""

    async def calc_reward(self, instance_id: str) -> float:
        """A reward this tool gives the trajectory (0 unless a subclass scores)."""
        return 0.0

    async def release(self, instance_id: str) -> None:
        """Free what `create` took; called once per trajectory, also after errors."""
        return None

    def close(self) -> None:
        """Free what the tool holds for its whole life (a server connection and its process,
        working directories, an index). Called once by the owner after the last trajectory;
        safe to call twice. Synchronous, so that shutdown paths without an event loop can
        call it. Default: nothing to free."""
        return None


def close_tools(tools: Iterable[Tool]) -> None:
    """Close every tool (each object once), even when some fail; then raise a `ToolError`
    naming the tools that failed."""
    failed, seen = [], set()
    for tool in tools:
        if id(tool) in seen:
            continue
        seen.add(id(tool))
        try:
            tool.close()
        except Exception as exc:
            failed.append(f"{tool.name or type(tool).__name__}: {exc!r}")
    if failed:
        raise ToolError(f"closing tools failed: {'; '.join(failed)}")
