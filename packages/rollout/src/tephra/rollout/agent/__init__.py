"""Agent loops: multi-turn, token-in-token-out rollouts with tools.

loop = AGENT_LOOPS.get("tool_agent")(rollout, tokenizer, sampling, AgentLoopConfig(), tools)
trajectory = await loop.run(AgentSample(messages=[{"role": "user", "content": "..."}]))
"""

from tephra.rollout.agent.base import (
    AGENT_LOOPS,
    AgentLoop,
    AgentLoopConfig,
    AgentSample,
    Trajectory,
)
from tephra.rollout.agent.batching import run_agent_loops, trajectories_to_batch
from tephra.rollout.agent.chat_format import TOOL_CHAT_TEMPLATE
from tephra.rollout.agent.chat_tokens import ChatTemplateDelta
from tephra.rollout.agent.loops import SingleTurnAgentLoop, ToolAgentLoop
from tephra.rollout.agent.tool_calls import TOOL_CALL_PARSERS, ToolCall, parse_hermes_tool_calls

__all__ = [
    "AGENT_LOOPS",
    "TOOL_CALL_PARSERS",
    "TOOL_CHAT_TEMPLATE",
    "AgentLoop",
    "AgentLoopConfig",
    "AgentSample",
    "ChatTemplateDelta",
    "SingleTurnAgentLoop",
    "ToolAgentLoop",
    "ToolCall",
    "Trajectory",
    "parse_hermes_tool_calls",
    "run_agent_loops",
    "trajectories_to_batch",
]
