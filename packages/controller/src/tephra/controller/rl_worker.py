"""The colocated RL worker: actor, reference, critic and rollout engine in one process per rank.

Weights move inside the process: `sync_weights` streams `actor.export_weights()` buckets into
`rollout.update_weights()`. Every public method is declared with a dispatch mode, so the
driver calls `wg.compute_log_probs(batch)` on the whole batch and gets the whole batch back.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDict

from tephra.controller.dispatch import Dispatch, dispatch
from tephra.controller.worker_group import Worker
from tephra.engine_api.config import EngineConfig


@dataclass
class RLWorkerSpec:
    """What one rank builds."""

    engine: str
    """Training backend name (`fsdp`, `megatron`)."""
    actor: EngineConfig
    """Policy engine config."""
    rollout_backend: str
    """Rollout backend name (`hf`, `vllm`)."""
    rollout: Any
    """`tephra.rollout.RolloutConfig` of the generation engine."""
    critic: EngineConfig | None = None
    """Value engine config (PPO with GAE), or None."""
    reference: str = "none"
    """`none` (no KL to a reference), `engine` (a frozen second engine), or `lora_base`
    (the actor's own base weights with adapters disabled)."""
    actor_objective: Any = None
    """`tephra.algos.ActorObjectiveConfig`."""
    critic_objective: Any = None
    """`tephra.algos.CriticObjectiveConfig`."""
    mini_batches: int = 1
    """Optimizer steps per RL step: the batch is cut into this many mini-batches."""
    epochs: int = 1
    """Passes over the batch per RL step."""
    untie_word_embeddings: bool = True
    """Export lm_head too for tied models (rollout engines keep a stale head otherwise)."""
    seed: int = 0
    """Seed of this rank's RNG (offset by the rank)."""
    agent_loop: str | None = None
    """Agent loop of `generate_agent` (`tephra.rollout.agent.AGENT_LOOPS`), or None when the
    run only uses the batched `generate`."""
    agent_config: Any = None
    """`tephra.rollout.agent.AgentLoopConfig` of that loop (None: its defaults)."""
    tools_file: str | None = None
    """Tools YAML the loop's tools are built from (once, on the first `generate_agent`)."""
    agent_max_in_flight: int = 64
    """Most trajectories of this rank in flight at once (their turns share batched generates)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Reserved for backend-specific settings."""


def trajectory_record(trajectory: Any) -> dict[str, Any]:
    """A `Trajectory` as a plain dict (ranks with different lengths concatenate), with the text
    the reward scores: the last assistant message (the final answer of a tool-using
    trajectory; earlier turns are tool calls)."""
    answer = next((m["content"] for m in reversed(trajectory.messages)
                   if m.get("role") == "assistant"), "")
    return {
        "sample_id": trajectory.sample_id, "prompt_ids": list(trajectory.prompt_ids),
        "response_ids": list(trajectory.response_ids),
        "response_mask": list(trajectory.response_mask),
        "log_probs": list(trajectory.response_log_probs), "num_turns": trajectory.num_turns,
        "tool_calls": trajectory.tool_calls, "tool_errors": trajectory.tool_errors,
        "finish_reason": trajectory.finish_reason, "answer": answer,
        "tool_rewards": dict(trajectory.tool_rewards),
    }


def run_agent_requests(loop: Any, requests: list[dict[str, Any]],
                       max_in_flight: int | None = None) -> list[dict[str, Any]]:
    """Run `loop` (an `AgentLoop`) on every request concurrently; one `trajectory_record` per
    request, in order. A request is a dict with `messages` (chat messages), `sample_id`
    (unique: it names the tool instances) and optionally `prompt_ids` (the rendered prompt)
    and `tool_kwargs` (per tool, keyword arguments of `Tool.create`)."""
    import asyncio

    from tephra.rollout.agent import AgentSample, run_agent_loops

    samples = [AgentSample(messages=list(r["messages"]), sample_id=str(r["sample_id"]),
                           prompt_ids=list(r["prompt_ids"]) if r.get("prompt_ids") else None,
                           tool_kwargs=dict(r.get("tool_kwargs") or {}))
               for r in requests]
    # The hf backend generates on its own thread, so a fresh event loop per call is fine.
    trajectories = asyncio.run(run_agent_loops(loop, samples, max_in_flight))
    return [trajectory_record(t) for t in trajectories]


def _on_policy_old_log_probs(loss_fn):
    """With one mini-batch and one epoch the sampling policy is the current one, so the
    old log-probs are the current log-probs without their graph; this skips a forward pass."""

    def wrapped(outputs: TensorDict, batch: TensorDict):
        if "old_log_probs" not in batch.keys():
            batch["old_log_probs"] = outputs["log_probs"].detach()
        return loss_fn(outputs, batch)

    return wrapped


class RLWorker(Worker):
    def __init__(self, rank, world_size, master_addr, master_port, threads, spec: RLWorkerSpec):
        super().__init__(rank, world_size, master_addr, master_port, threads)
        from tephra.engine_api.registry import get_engine
        from tephra.rollout.base import get_rollout

        self.spec = spec
        torch.manual_seed(spec.seed + rank)
        random.seed(spec.seed + rank)
        self.actor = get_engine(spec.engine, spec.actor)
        self.ref = None
        if spec.reference == "engine":
            self.ref = get_engine(spec.engine, spec.actor)
        self.critic = get_engine(spec.engine, spec.critic) if spec.critic is not None else None
        self.rollout = get_rollout(spec.rollout_backend, spec.rollout)
        self._actor_loss = self._critic_loss = None
        self._tokenizer = self._tools = None  # built by the first generate_agent
        if spec.actor_objective is not None:
            from tephra.algos import ActorObjective

            self._actor_loss = ActorObjective(spec.actor_objective)
        if spec.critic_objective is not None and self.critic is not None:
            from tephra.algos import CriticObjective

            self._critic_loss = CriticObjective(spec.critic_objective)
        # The rollout engine loaded the checkpoint from disk, but the engine may have
        # changed it (a value head, untied embeddings, LoRA); one sync makes them equal.
        self.sync_weights()

    # ----- generation ------------------------------------------------------------------
    @dispatch(Dispatch.DP_SPLIT)
    def generate(self, prompts: list[list[int]], sampling: Any) -> list[dict[str, Any]]:
        """Samples for this rank's prompts (prompt-major), as plain per-sample dicts so that
        ranks with different lengths concatenate."""
        out = self.rollout.generate(list(prompts), sampling)
        return [
            {"prompt_ids": out.prompt_ids[i], "response_ids": out.response_ids[i],
             "log_probs": out.log_probs[i] if out.log_probs is not None else None,
             "finish_reason": out.finish_reasons[i]}
            for i in range(len(out))
        ]

    def agent_parts(self) -> tuple[Any, dict[str, Any]]:
        """(tokenizer, tools) of the agent loop, built once per worker."""
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            from tephra.rollout.tools import load_tools

            tok = AutoTokenizer.from_pretrained(self.spec.rollout.model_path)
            if tok.pad_token_id is None:
                tok.pad_token = tok.eos_token
            self._tools = load_tools(self.spec.tools_file) if self.spec.tools_file else {}
            self._tokenizer = tok
        return self._tokenizer, self._tools

    @dispatch(Dispatch.DP_SPLIT)
    def generate_agent(self, requests: list[dict[str, Any]], sampling: Any) -> list[dict[str, Any]]:
        """Multi-turn trajectories of this rank's requests (see `run_agent_requests`) with the
        spec's agent loop and tools; `sampling.n` must be 1 (send a prompt n times)."""
        from tephra.rollout.agent import AGENT_LOOPS

        if not self.spec.agent_loop:
            raise RuntimeError("generate_agent called but RLWorkerSpec.agent_loop is not set")
        tokenizer, tools = self.agent_parts()
        loop = AGENT_LOOPS.get(self.spec.agent_loop)(
            self.rollout, tokenizer, sampling, self.spec.agent_config, tools)
        return run_agent_requests(loop, list(requests), self.spec.agent_max_in_flight)

    # ----- forward passes --------------------------------------------------------------
    @dispatch(Dispatch.DP_SPLIT)
    def compute_log_probs(self, batch: TensorDict) -> TensorDict:
        with self.actor.eval_mode():
            out = self.actor.forward(batch)
        return out.select(*[k for k in ("log_probs", "entropy") if k in out.keys()])

    @dispatch(Dispatch.DP_SPLIT)
    def compute_ref_log_probs(self, batch: TensorDict) -> TensorDict:
        if self.spec.reference == "lora_base":
            with self.actor.eval_mode(), self.actor.reference_mode():
                out = self.actor.forward(batch)
        elif self.ref is not None:
            with self.ref.eval_mode():
                out = self.ref.forward(batch)
        else:
            raise RuntimeError("compute_ref_log_probs called but the worker has no reference")
        return out.select("log_probs")

    @dispatch(Dispatch.DP_SPLIT)
    def compute_values(self, batch: TensorDict) -> TensorDict:
        with self.critic.eval_mode():
            out = self.critic.forward(batch)
        return out.select("values")

    # ----- updates ---------------------------------------------------------------------
    def _train(self, engine, loss_fn, batch: TensorDict) -> dict[str, float]:
        n = batch.batch_size[0]
        mb = self.spec.mini_batches
        size = n // mb
        totals: dict[str, float] = {}
        count = 0
        with engine.train_mode():
            for _ in range(self.spec.epochs):
                for i in range(mb):
                    metrics = engine.forward_backward(batch[i * size : (i + 1) * size], loss_fn)
                    metrics = dict(metrics)
                    metrics["grad_norm"] = float(engine.optimizer_step())
                    metrics["lr"] = float(engine.lr_scheduler_step())
                    for k, v in metrics.items():
                        totals[k] = totals.get(k, 0.0) + float(v)
                    count += 1
        return {k: v / count for k, v in totals.items()}

    @dispatch(Dispatch.DP_SPLIT)
    def update_actor(self, batch: TensorDict) -> dict[str, float]:
        loss = self._actor_loss
        if self.spec.mini_batches == 1 and self.spec.epochs == 1:
            loss = _on_policy_old_log_probs(loss)
        return self._train(self.actor, loss, batch)

    @dispatch(Dispatch.DP_SPLIT)
    def update_critic(self, batch: TensorDict) -> dict[str, float]:
        return self._train(self.critic, self._critic_loss, batch)

    # ----- weights and state -----------------------------------------------------------
    @dispatch(Dispatch.BROADCAST)
    def sync_weights(self) -> int:
        """Stream the actor's weights into the rollout engine; returns tensors moved."""
        moved = 0
        with self.actor.eval_mode():
            for bucket in self.actor.export_weights(
                untie_word_embeddings=self.spec.untie_word_embeddings
            ):
                self.rollout.update_weights(bucket)
                moved += len(bucket)
        return moved

    @dispatch(Dispatch.BROADCAST)
    def save_checkpoint(self, folder: str) -> None:
        path = Path(folder)
        self.actor.save_checkpoint(path / "actor")
        if self.critic is not None:
            self.critic.save_checkpoint(path / "critic")
        torch.save({"torch": torch.get_rng_state(), "python": random.getstate()},
                   path / f"worker_rng_rank{self.rank}.pt")

    @dispatch(Dispatch.BROADCAST)
    def load_checkpoint(self, folder: str) -> None:
        path = Path(folder)
        self.actor.load_checkpoint(path / "actor")
        if self.critic is not None:
            self.critic.load_checkpoint(path / "critic")
        state = torch.load(path / f"worker_rng_rank{self.rank}.pt", weights_only=False)
        torch.set_rng_state(state["torch"])
        random.setstate(state["python"])
        self.sync_weights()

    @dispatch(Dispatch.RANK_ZERO)
    def export_hf(self, folder: str) -> str:
        self.actor.export_hf(folder)
        return folder

    @dispatch(Dispatch.RANK_ZERO)
    def close(self) -> None:
        """Stop the rollout engine and close the agent loop's tools (MCP servers and their
        processes, sandbox folders), which this worker built; runs on every rank."""
        try:
            self.rollout.close()
        finally:
            if self._tools:
                from tephra.rollout.tools import close_tools

                tools, self._tools = self._tools, {}
                close_tools(tools.values())
