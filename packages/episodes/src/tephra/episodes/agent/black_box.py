"""The `openai_agent` episode: a black-box agent (a user's function written against the OpenAI
Chat Completions or Responses API, or the Anthropic Messages API) drives the policy through the
gateway, with its trajectory's own API key; the gateway records the exact tokens it serves."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tephra.core.errors import ConfigError
from tephra.episodes.agent.loops import TIMEOUTS, _TokenLoop, _Trajectory
from tephra.episodes.gateway.server import shared_gateway
from tephra.episodes.gateway.session import TrajectorySession
from tephra.episodes.prompt import Prompt
from tephra.episodes.user_files import import_file
from tephra.rollout.base import Rollout, SamplingParams
from tephra.rollout.samples import Sample


def load_agent_function(spec: str) -> Callable[..., Any]:
    """`path/to/agent.py:function`, imported once; errors name the field and the fix."""
    where = f"rollout.agent.openai_agent={spec!r}"
    path, _, name = spec.rpartition(":")
    if not path.endswith(".py") or not name:
        raise ConfigError(
            f"{where}: give path/to/agent.py:function_name (the field is empty or has no ':')"
        )
    file = Path(path).expanduser().resolve()
    if not file.is_file():
        raise ConfigError(f"{where}: {file} does not exist; give an existing .py file")
    try:
        module = import_file(file, "tephra_agent_")
    except Exception as exc:
        raise ConfigError(f"{where}: importing {file} raised {type(exc).__name__}: {exc}") from exc
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ConfigError(f"{where}: {file} defines no function {name!r}")
    if len(inspect.signature(fn).parameters) < 2:
        raise ConfigError(
            f"{where}: {name} must take (gateway, item): the gateway's address and this "
            "trajectory's key (tephra.episodes.gateway.GatewayAccess: openai_base_url, "
            "anthropic_base_url, api_key) and the prompt item (Prompt)"
        )
    return fn


class OpenAIAgentLoop(_TokenLoop):
    """Runs `config.openai_agent` (`path.py:function`) as `agent(gateway, item)`: an `async
    def` is awaited, a plain function runs in a thread. It talks to the policy through the
    gateway (`tephra.episodes.gateway`) with any OpenAI or Anthropic client
    (`AsyncOpenAI(base_url=gateway.openai_base_url, api_key=gateway.api_key)`), runs its own
    tools, and returns a float (the trajectory's reward, `Sample.env_reward`) or None (the
    reward scorer scores the last served answer). The trajectory is what the gateway served
    and appended for the trajectory's key. An agent that raises ends its
    trajectory with `agent_error` (reward 0, the error in `extra_info["agent_error"]`), unless
    the budget cut the last served turn: then with `length`, scored by the reward scorer (the
    error kept in `extra_info`), as a tool agent's cut trajectory is;
    `trajectory_timeout_s` bounds the whole agent, `turn_timeout_s` each served turn."""

    async def run(self, rollout: Rollout, sample: Prompt, sampling: SamplingParams) -> Sample:
        cfg = self.config
        if not cfg.openai_agent:
            raise ConfigError(
                "the openai_agent episode needs rollout.agent.openai_agent=path/to/agent.py:fn"
            )
        return await run_black_box(
            self, load_agent_function(cfg.openai_agent), rollout, sample, sampling
        )


async def run_black_box(
    loop: _TokenLoop,
    agent: Callable[..., Any],
    rollout: Rollout,
    sample: Prompt,
    sampling: SamplingParams,
) -> Sample:
    """One trajectory of `agent(gateway, item)` through the shared gateway: the episode of
    `OpenAIAgentLoop`, and of the adapters that drive an ecosystem environment's own loop."""
    cfg = loop.config
    run = loop.begin(rollout, sampling)
    traj = _Trajectory([], list(sample.messages))
    session = TrajectorySession(loop, run, rollout, sample.sample_id, traj)
    reward: Any = None
    info: dict[str, Any] = {}
    finish = None
    try:
        async with asyncio.timeout(cfg.trajectory_timeout_s):
            async with shared_gateway(cfg.gateway) as gateway:
                access = gateway.open(session)
                try:
                    if inspect.iscoroutinefunction(agent):
                        reward = await agent(access, sample)
                    else:
                        reward = await asyncio.to_thread(agent, access, sample)
                finally:
                    gateway.close(access.api_key)
    except TimeoutError:
        finish = "trajectory_timeout"
    except Exception as exc:  # the agent's own failure ends its trajectory, not the step
        # A turn the token budget cut (`rollout.max_tokens`, `max_response_tokens`) is
        # served as cut (Responses `incomplete`, Chat `length`, Messages `max_tokens`), and
        # some clients raise on it (the Agents SDK from 0.24: ModelBehaviorError). The budget
        # ended that trajectory, as it ends a tool agent's: `length`, the reward scorer's.
        cut = session.finish in TIMEOUTS or session.finish == "length"
        finish = session.finish if cut else "agent_error"
        info["agent_error"] = f"{type(exc).__name__}: {exc}"
    finish = finish or session.finish
    # the agent's own failure scores 0 (a deadline's, in to_sample)
    env_reward = 0.0 if finish == "agent_error" else None if reward is None else float(reward)
    return traj.to_sample(sample, finish, env_reward, cfg.timeout_reward, info)
