"""Probing, before Ray starts, the running servers a config points at (the judge's, the
rollout's `url`): one that does not answer is a one-line error naming the field, instead of a
worker's traceback minutes later."""

from __future__ import annotations

import urllib.error
import urllib.request
from typing import TYPE_CHECKING

from tephra.core.errors import ConfigError
from tephra.episodes.environments.remote import check_remote_server
from tephra.rollout.base import ServerLaunch

if TYPE_CHECKING:
    from tephra.controller.config.tree import PPOConfig

PROBE_TIMEOUT_S = 5.0
"""Seconds one probe may take: a server on the same network answers /health in milliseconds;
a firewalled address would otherwise hold the start for the operating system's TCP timeout."""


def unreachable(url: str, timeout_s: float = PROBE_TIMEOUT_S) -> str | None:
    """Why nothing answers `GET url/health` (connection refused, unknown host, timeout), or
    None when an HTTP server answers, whatever its status (some servers have no /health)."""
    probe = url.rstrip("/") + "/health"
    try:
        with urllib.request.urlopen(probe, timeout=timeout_s):  # noqa: S310  (http(s) checked)
            return None
    except urllib.error.HTTPError:
        return None  # an HTTP answer: a server is there
    except urllib.error.URLError as exc:
        return f"{type(exc.reason).__name__}: {exc.reason}"
    except (OSError, ValueError) as exc:  # a timeout while reading, a malformed URL
        return f"{type(exc).__name__}: {exc}"


def check_server_url(field_name: str, urls: str, timeout_s: float = PROBE_TIMEOUT_S) -> None:
    """Each comma-separated URL of `field_name` answers over HTTP, else a ConfigError naming
    the field, the URL, why and the fix."""
    for url in (u.strip() for u in urls.split(",") if u.strip()):
        if not url.startswith(("http://", "https://")):
            raise ConfigError(
                f"{field_name}={urls!r}: {url!r} is not an http(s) URL; write e.g. "
                "http://10.0.0.5:8000"
            )
        why = unreachable(url, timeout_s)
        if why is not None:
            raise ConfigError(
                f"{field_name}={urls!r}: nothing answers at {url} within {timeout_s:g} s "
                f"({why}); start the server there, correct the URL, or set {field_name}=null "
                "to let tephra start its own"
            )


def check_server_urls(cfg: PPOConfig, timeout_s: float = PROBE_TIMEOUT_S) -> None:
    """The running servers the config uses: the judge's (`reward.judge.<backend>.url`), the
    rollout's (`rollout.<backend>.url`) and a remote environment's
    (`rollout.agent.environment_kwargs.url`, which must serve the environment named)."""
    judge = cfg.reward.judge
    settings = getattr(judge, judge.backend, None)
    if judge.enabled and isinstance(settings, ServerLaunch) and settings.url:
        check_server_url(f"reward.judge.{judge.backend}.url", settings.url, timeout_s)
    settings = getattr(cfg.rollout, cfg.rollout.backend, None)
    if isinstance(settings, ServerLaunch) and settings.url:
        check_server_url(f"rollout.{cfg.rollout.backend}.url", settings.url, timeout_s)
    agent = cfg.rollout.agent
    if cfg.rollout.uses_agent_loop and agent.environment == "remote":
        if agent.environment_kwargs.get("url"):  # without one, the run starts the server
            check_remote_server(agent.environment_kwargs, timeout_s)
