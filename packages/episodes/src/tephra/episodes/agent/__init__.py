"""Agent loops: multi-turn, token-in-token-out rollouts with tools.

loop = AGENT_LOOPS.get("tool_agent")(rollout, tokenizer, sampling, AgentLoopConfig(), tools)
trajectory = await loop.run(AgentSample(messages=[{"role": "user", "content": "..."}]))
"""

from tephra.episodes.agent.base import (
    AgentLoop,
    AgentLoopConfig,
    AgentSample,
)
from tephra.episodes.agent.batching import run_agent_loops
from tephra.episodes.agent.chat_format import TOOL_CHAT_TEMPLATE
from tephra.episodes.agent.chat_tokens import ChatTemplateDelta
from tephra.episodes.agent.loops import SingleTurnAgentLoop, ToolAgentLoop
from tephra.episodes.agent.registry import AGENT_LOOPS
from tephra.episodes.agent.tool_calls import TOOL_CALL_PARSERS, ToolCall, parse_hermes_tool_calls

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
    "parse_hermes_tool_calls",
    "run_agent_loops",
]
