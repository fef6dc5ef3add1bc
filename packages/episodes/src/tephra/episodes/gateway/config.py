"""The gateway's settings (`rollout.agent.gateway`)."""

from __future__ import annotations

from dataclasses import dataclass

from tephra.core.errors import ConfigError


@dataclass
class GatewayConfig:
    """Where the gateway listens. Every request needs its trajectory's API key whatever the
    address: the key names the trajectory whose tokens the call extends."""

    host: str = "127.0.0.1"
    """Address the gateway binds: loopback by default (the agents run in the rollout worker's
    process); `0.0.0.0` lets agents on other hosts call it (with their trajectory's key)."""
    port: int = 0
    """TCP port; 0 takes a free one (needed when several rollout workers share a host: a
    fixed port fits one worker per host)."""

    def __post_init__(self) -> None:
        if not self.host or any(c.isspace() for c in self.host):
            raise ConfigError(
                f"rollout.agent.gateway.host={self.host!r} must be an address to bind, e.g. "
                "127.0.0.1 (loopback, the default) or 0.0.0.0 (every interface)"
            )
        if not 0 <= self.port <= 65535:
            raise ConfigError(
                f"rollout.agent.gateway.port={self.port} must be a TCP port in 0..65535 "
                "(0: a free port)"
            )
