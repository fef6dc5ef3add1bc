"""Agent loops: multi-turn, token-in-token-out episodes with tools.

loop = EPISODES.get("tool_agent")(tokenizer, AgentLoopConfig(), tools)  # tephra.episodes.registry
sample = await loop.run(rollout, Prompt(messages=[{"role": "user", "content": "..."}]), sampling)
"""

from tephra.episodes.agent.base import (
    AgentLoop,
    AgentLoopConfig,
    Prompt,
)
from tephra.episodes.agent.chat_format import TOOL_CHAT_TEMPLATE
from tephra.episodes.agent.chat_tokens import ChatTemplateDelta
from tephra.episodes.agent.loops import EnvironmentLoop, SingleTurnAgentLoop, ToolAgentLoop
from tephra.episodes.agent.tool_calls import TOOL_CALL_PARSERS, ToolCall, parse_hermes_tool_calls

__all__ = [
    "TOOL_CALL_PARSERS",
    "TOOL_CHAT_TEMPLATE",
    "AgentLoop",
    "AgentLoopConfig",
    "Prompt",
    "ChatTemplateDelta",
    "EnvironmentLoop",
    "SingleTurnAgentLoop",
    "ToolAgentLoop",
    "ToolCall",
    "parse_hermes_tool_calls",
]
