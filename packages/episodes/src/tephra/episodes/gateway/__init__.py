"""A gateway that any agent can call: the OpenAI Chat Completions and Responses APIs and the
Anthropic Messages API (streaming, tool calls) served by the policy, each call tied to its
trajectory by a per-trajectory API key, token-in-token-out.

    async with Gateway().serving() as gateway:
        access = gateway.open(session)        # a TrajectorySession of one episode
        client = AsyncOpenAI(base_url=access.openai_base_url, api_key=access.api_key)
        ...
        gateway.close(access.api_key)         # later calls with the key: 401, expired
"""

from tephra.episodes.gateway.config import GatewayConfig
from tephra.episodes.gateway.server import Gateway, GatewayAccess, shared_gateway
from tephra.episodes.gateway.session import (
    ChatRequest,
    GatewayRefusal,
    ServedTurn,
    ToolCallOut,
    TrajectorySession,
)

__all__ = [
    "ChatRequest",
    "Gateway",
    "GatewayAccess",
    "GatewayConfig",
    "GatewayRefusal",
    "ServedTurn",
    "ToolCallOut",
    "TrajectorySession",
    "shared_gateway",
]
