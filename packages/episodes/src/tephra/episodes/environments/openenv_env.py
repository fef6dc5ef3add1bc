"""The `openenv` environment: an OpenEnv environment server (`openenv-core`'s HTTP/WebSocket
form, `create_app(...)` served anywhere) reached with OpenEnv's own client, one session per
trajectory; the model's turn is the action, the server's observation the next user turn, its
rewards the trajectory's."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from tephra.core.errors import ConfigError
from tephra.episodes.environments.base import Environment, StepResult
from tephra.episodes.extras import require_package

if TYPE_CHECKING:
    from tephra.episodes.agent.base import AgentLoopConfig
    from tephra.episodes.prompt import Prompt
    from tephra.episodes.tools.base import Tool

OPENENV_FIELD = "rollout.agent.environment_kwargs"
OPENENV_EXTRA = "tephra-episodes[openenv]"
"""The extra that installs `openenv-core`."""


@dataclass(frozen=True)
class OpenEnvSettings:
    """`rollout.agent.environment_kwargs` of the `openenv` environment."""

    url: str
    """The server's base URL (`http://host:port`), the one OpenEnv's `EnvClient` takes."""
    action_field: str = "message"
    """The action's field that receives the model's turn (its text)."""
    observation_field: str = "message"
    """The observation's field whose text the model reads next (as a user turn)."""
    connect_timeout_s: float = 10.0
    """Deadline of opening a session on the server."""

    @classmethod
    def from_kwargs(cls, kwargs: dict[str, Any]) -> OpenEnvSettings:
        """Checked settings; errors name the field and the fix (called when the config loads,
        before Ray starts)."""
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise ConfigError(
                f"{OPENENV_FIELD} has {unknown}, which the `openenv` environment does not take; "
                f"it takes {sorted(names)}"
            )
        url = str(kwargs.get("url") or "")
        if not url.startswith(("http://", "https://")):
            raise ConfigError(
                f"{OPENENV_FIELD}.url={url!r}: the `openenv` environment needs the OpenEnv "
                "server's base URL, e.g. rollout.agent.environment_kwargs.url=http://127.0.0.1:8000"
            )
        return cls(**{**kwargs, "url": url})


def check_openenv(kwargs: dict[str, Any]) -> OpenEnvSettings:
    """The package installed and the settings valid, before Ray starts."""
    require_package("openenv", "rollout.agent.environment='openenv'", OPENENV_EXTRA)
    return OpenEnvSettings.from_kwargs(kwargs)


class OpenEnvEnvironment(Environment):
    """One session on an OpenEnv server per trajectory, through OpenEnv's `GenericEnvClient`
    (actions and observations as dicts). `reset` opens it (the server's `reset`, given the
    item's `interaction_kwargs`); the first observation is the item's messages, followed by
    the reset observation's text as a user turn when it has one. Each model turn is sent as
    the action `{action_field: text}`; the step's reward (None counts 0) is the turn's and
    its `done` ends the episode. openenv-core's client is blocking before 0.3 (its calls run
    in a worker thread, so other trajectories' turns go on) and asynchronous from 0.3 on."""

    def __init__(
        self,
        tools: dict[str, Tool] | None = None,
        config: AgentLoopConfig | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(tools, config, **kwargs)
        self.settings = OpenEnvSettings.from_kwargs(kwargs)
        self.client: Any = None

    async def reset(self, item: Prompt) -> list[dict[str, Any]]:
        from openenv import GenericEnvClient  # the optional extra (checked when the config loads)

        s = self.settings
        self.client = GenericEnvClient(base_url=s.url, connect_timeout_s=s.connect_timeout_s)
        await _call(self.client.connect)
        result = await _call(self.client.reset, **item.interaction_kwargs)
        text = self._text(result.observation)
        return list(item.messages) + ([{"role": "user", "content": text}] if text else [])

    async def step(self, action: str) -> StepResult:
        result = await _call(self.client.step, {self.settings.action_field: action})
        reward = 0.0 if result.reward is None else float(result.reward)
        if result.done:
            return StepResult(reward=reward, done=True)
        return StepResult([{"role": "user", "content": self._text(result.observation)}], reward)

    def _text(self, observation: dict[str, Any]) -> str:
        value = observation.get(self.settings.observation_field)
        return "" if value is None else str(value)

    async def close(self) -> None:
        if self.client is not None:
            await _call(self.client.close)
            self.client = None


async def _call(method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Await a client method, in a worker thread when it blocks (openenv-core before 0.3)."""
    if inspect.iscoroutinefunction(method):
        return await method(*args, **kwargs)
    return await asyncio.to_thread(method, *args, **kwargs)
