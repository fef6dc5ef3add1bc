"""The `openai_agent` episode: a black-box agent (a user's function written against the
OpenAI chat-completions API) drives the policy through a per-trajectory endpoint that records
the exact tokens it serves."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tephra.core.errors import ConfigError
from tephra.episodes.agent.base import AgentPrompt
from tephra.episodes.agent.loops import TIMEOUTS, _TokenLoop, _Trajectory
from tephra.episodes.agent.openai_endpoint import EndpointSession, serve
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
            f"{where}: {name} must take (base_url, item): the endpoint's URL for an OpenAI "
            "client and the prompt item (AgentPrompt)"
        )
    return fn


class OpenAIAgentLoop(_TokenLoop):
    """Runs `config.openai_agent` (`path.py:function`) as `agent(base_url, item)`: an `async
    def` is awaited, a plain function runs in a thread. It talks to the policy with any
    OpenAI client (`AsyncOpenAI(base_url=base_url, api_key="tephra")`), runs its own tools,
    and returns a float (the trajectory's reward, `Sample.env_reward`) or None (the reward
    scorer scores the last served answer). The trajectory is what the endpoint served and
    appended (`tephra.episodes.agent.openai_endpoint`). An agent that raises ends its
    trajectory with `agent_error` (reward 0, the error in `extra_info["agent_error"]`);
    `trajectory_timeout_s` bounds the whole agent, `turn_timeout_s` each served turn."""

    async def run(self, rollout: Rollout, sample: AgentPrompt, sampling: SamplingParams) -> Sample:
        cfg = self.config
        if not cfg.openai_agent:
            raise ConfigError(
                "the openai_agent episode needs rollout.agent.openai_agent=path/to/agent.py:fn"
            )
        agent = load_agent_function(cfg.openai_agent)
        run = self.begin(rollout, sampling)
        traj = _Trajectory([], list(sample.messages))
        session = EndpointSession(self, run, rollout, sample.sample_id, traj)
        reward: Any = None
        info: dict[str, Any] = {}
        finish = None
        try:
            async with asyncio.timeout(cfg.trajectory_timeout_s):
                async with serve(session) as base_url:
                    if inspect.iscoroutinefunction(agent):
                        reward = await agent(base_url, sample)
                    else:
                        reward = await asyncio.to_thread(agent, base_url, sample)
        except TimeoutError:
            finish = "trajectory_timeout"
        except Exception as exc:  # the agent's own failure ends its trajectory, not the step
            finish = session.finish if session.finish in TIMEOUTS else "agent_error"
            info["agent_error"] = f"{type(exc).__name__}: {exc}"
        finish = finish or session.finish
        # the agent's own failure scores 0 (a deadline's, in to_sample)
        env_reward = 0.0 if finish == "agent_error" else None if reward is None else float(reward)
        return traj.to_sample(
            sample, finish, env_reward, cfg.timeout_reward, {**sample.extra_info, **info}
        )
