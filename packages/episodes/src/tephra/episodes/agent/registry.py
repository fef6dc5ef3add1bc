"""The agent-loop registry: each built-in loop class listed by name."""

from __future__ import annotations

from tephra.engine_api.registry import Registry
from tephra.episodes.agent.base import AgentLoop
from tephra.episodes.agent.loops import SingleTurnAgentLoop, ToolAgentLoop

AGENT_LOOPS: Registry[type[AgentLoop]] = Registry("agent loop")
"""Agent-loop classes by name: `single_turn`, `tool_agent`."""
AGENT_LOOPS.register("single_turn", SingleTurnAgentLoop)
AGENT_LOOPS.register("tool_agent", ToolAgentLoop)
