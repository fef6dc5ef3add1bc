"""The trainer's `rollout` section: the rollout's own config plus the episode that runs on it
(agent loop, tools, their budgets)."""

from __future__ import annotations

from dataclasses import dataclass, field

from tephra.core.errors import ConfigError, RegistryError
from tephra.core.registry import check_registered
from tephra.episodes.agent.base import AgentLoopConfig
from tephra.episodes.agent.black_box import load_agent_function
from tephra.episodes.agent.tool_calls import TOOL_CALL_PARSERS
from tephra.episodes.agent.verifiers_env import load_verifiers_environment
from tephra.episodes.environments.openenv_env import check_openenv
from tephra.episodes.environments.registry import check_remote, get_environment
from tephra.episodes.environments.swe import SweSettings
from tephra.episodes.registry import EPISODES
from tephra.rollout.config import RolloutSection


@dataclass
class EpisodeRolloutConfig(RolloutSection):
    """Generation: the backend by name, sampling, each backend's own settings, and the
    episode (agent loop) that generates with them."""

    agent_loop: str | None = None
    """Multi-turn rollouts: an episode from tephra.episodes.registry.EPISODES (`tool_agent`:
    the model calls the tools of `tools_file` between turns; `environment`: the environment
    of `agent.environment`; `openai_agent`: the black-box agent of `agent.openai_agent`;
    `verifiers`: the `verifiers` environment of `agent.verifiers_environment`; `single_turn`). It also runs the rows whose `agent_name` names no episode. None or ""
    keeps the batched `generate` path."""
    tools_file: str | None = None
    """Tools YAML of the agent loop, or `python` for the bundled sandboxed interpreter."""
    max_in_flight: int = 64
    """Agent loop: most trajectories in flight per rank (their turns are batched together)."""
    agent: AgentLoopConfig = field(
        default_factory=lambda: AgentLoopConfig(
            max_turns=3, max_response_tokens=128, max_tool_response_chars=500
        )
    )
    """Agent-loop budgets (tephra.episodes.agent.AgentLoopConfig): max_turns,
    max_response_tokens (the trained response length), max_tool_response_chars, ..."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.agent_loop:
            check_registered("rollout.agent_loop", self.agent_loop, EPISODES)
            check_registered(
                "rollout.agent.tool_call_format", self.agent.tool_call_format, TOOL_CALL_PARSERS
            )
            uses_tools = self.agent_loop == "tool_agent" or (
                self.agent_loop == "environment" and self.agent.environment == "tool"
            )
            if uses_tools and not self.tools_file:
                raise ConfigError(
                    f"rollout.agent_loop={self.agent_loop!r} needs rollout.tools_file"
                    + (" (rollout.agent.environment='tool')" if self.agent.environment else "")
                    + ": a tools YAML, or `python` for the bundled sandboxed interpreter"
                )
            if self.agent_loop == "openai_agent" or self.agent.openai_agent:
                load_agent_function(self.agent.openai_agent)  # its errors come before Ray
            if self.agent_loop == "verifiers" or self.agent.verifiers_environment:
                load_verifiers_environment(  # the taskset is imported here: errors before Ray
                    self.agent.verifiers_environment, dict(self.agent.environment_kwargs)
                )
            if self.agent_loop == "environment" or self.agent.environment:
                try:  # a file is imported here, so its errors come before Ray starts
                    get_environment(self.agent.environment)
                except RegistryError as exc:
                    raise ConfigError(f"rollout.agent.environment: {exc}") from None
                if self.agent.environment == "openenv":
                    check_openenv(self.agent.environment_kwargs)
                if self.agent.environment == "swe":
                    SweSettings.from_kwargs(self.agent.environment_kwargs)
                if self.agent.environment == "remote":
                    check_remote(self.agent.environment_kwargs, self.tools_file)
        if self.max_in_flight < 1:
            raise ConfigError(f"rollout.max_in_flight={self.max_in_flight} must be >= 1")

    @property
    def uses_agent_loop(self) -> bool:
        return bool(self.agent_loop)

    @property
    def response_budget(self) -> int:
        """Most response tokens of one sample: `agent.max_response_tokens` with an agent loop,
        `max_tokens` without."""
        return self.agent.max_response_tokens if self.uses_agent_loop else self.max_tokens

    @property
    def budget_name(self) -> str:
        return "rollout.agent.max_response_tokens" if self.uses_agent_loop else "rollout.max_tokens"
