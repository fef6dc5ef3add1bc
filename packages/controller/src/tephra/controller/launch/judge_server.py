"""The run's one judge server: a server-backed LLM judge (`reward.judge.backend=vllm`) without
`reward.judge.vllm.url` is started once, by the driver, and every scoring process (the
generating ranks, the rollout replicas or the reward pool's ranks) sends its requests to it,
instead of each starting a copy of the judge."""

from __future__ import annotations

import secrets
from dataclasses import replace

import ray

from tephra.controller.config.tree import PPOConfig
from tephra.rollout import ROLLOUT_BACKENDS, RolloutConfig, ServerSettings, get_rollout
from tephra.rollout.backends.server_client import ServerRollout

WIDE_HOSTS = ("0.0.0.0", "::")
"""Listen addresses that are not an address to connect to: the URL names the node instead."""


def needs_judge_server(cfg: PPOConfig) -> bool:
    """Whether the judge is served by a server the run must start (a server backend and no
    `url`)."""
    judge = cfg.reward.judge
    backend = ROLLOUT_BACKENDS.get(judge.backend) if judge.enabled else None
    return getattr(backend, "protocol_class", None) is not None and judge.vllm.url is None


class JudgeServer:
    """The judge's server, started on construction on the driver's node; `cfg` is the run's
    config with `reward.judge.vllm.url` (and its key) pointing at it, for every worker.
    `close()` stops it."""

    def __init__(self, cfg: PPOConfig) -> None:
        judge = cfg.reward.judge
        launch = judge.vllm
        # a key made here (not `auto`, which stays in the process that starts the server):
        # every scoring process gets it in memory, with the URL
        key = secrets.token_urlsafe(32) if launch.api_key == "auto" else launch.api_key
        launch = replace(launch, api_key=key)
        rollout = get_rollout(
            judge.backend,
            RolloutConfig(
                model_path=str(judge.model_path),
                dtype=judge.dtype,
                max_model_len=judge.max_model_len,
                vllm=ServerSettings.of_launch(launch),
            ),
        )
        assert isinstance(rollout, ServerRollout)  # a backend with a server protocol
        self.rollout: ServerRollout | None = rollout
        url = rollout.urls[0]
        if launch.host in WIDE_HOSTS:  # reachable from the other nodes by this node's address
            url = url.replace(launch.host, ray.util.get_node_ip_address(), 1)
        self.url = url
        self.cfg = replace(
            cfg,
            reward=replace(
                cfg.reward, judge=replace(judge, vllm=replace(launch, url=url, api_key=key))
            ),
        )

    def close(self) -> None:
        """Stop the server (idempotent)."""
        if self.rollout is not None:
            rollout, self.rollout = self.rollout, None
            rollout.close()
