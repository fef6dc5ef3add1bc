"""The episode registry: each built-in episode listed by name."""

from __future__ import annotations

from tephra.core.registry import Registry
from tephra.episodes.agent.black_box import OpenAIAgentLoop
from tephra.episodes.agent.loops import EnvironmentLoop, SingleTurnAgentLoop, ToolAgentLoop
from tephra.episodes.agent.verifiers_env import VerifiersLoop
from tephra.episodes.episode import EpisodeFactory

EPISODES: Registry[EpisodeFactory] = Registry("agent loop")
"""Episode factories by name: `single_turn` (one model turn), `tool_agent` (model turns and
tool calls until an answer or a budget), `environment` (any environment of
`tephra.episodes.environments`, named by `AgentLoopConfig.environment`), `openai_agent` (a
black-box agent, `AgentLoopConfig.openai_agent`, through the gateway's OpenAI or Anthropic
APIs), `verifiers` (an environment of the `verifiers` package running its own episode through
the gateway, `AgentLoopConfig.verifiers_environment`); each `factory(tokenizer, config, tools)`. Its kind in messages is "agent loop", the name users choose it by (`rollout.agent_loop`)."""
EPISODES.register("single_turn", SingleTurnAgentLoop)
EPISODES.register("tool_agent", ToolAgentLoop)
EPISODES.register("environment", EnvironmentLoop)
EPISODES.register("openai_agent", OpenAIAgentLoop)
EPISODES.register("verifiers", VerifiersLoop)
