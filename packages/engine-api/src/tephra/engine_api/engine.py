"""The training-engine contract: the only thing algorithms and the controller see of a backend.

Who calls what: the controller builds one engine per rank (SPMD; every rank makes the same
calls in the same order), asks it for its data-parallel coordinates (`dp_rank`, `dp_size`,
`is_dp_output_rank`) to hand each rank its share of the batch, and calls `forward` for
log-probs/values, `forward_backward` + `optimizer_step` + `lr_scheduler_step` to train, and
`export_weights` to refresh the rollout engine. Losses come from `tephra.algos` through the
`loss_fn` argument; a backend never imports an algorithm.

Optional parts (`tephra.engine_api.capabilities.Capability`) are methods here too: a backend
that implements one lists it in `capabilities`; for the others the defaults below refuse with
a `ConfigError` naming the option, so a caller never probes an engine for a method.

Batches follow `tephra.engine_api.batch` (padded `[batch, seq]` TensorDicts).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import ClassVar

import torch
from tensordict import TensorDict

from tephra.engine_api.adapters import LoraAdapter
from tephra.engine_api.capabilities import Capability
from tephra.engine_api.config import EngineConfig
from tephra.engine_api.errors import ConfigError
from tephra.engine_api.loss import LossFn
from tephra.engine_api.multimodal import declared_hf_config


class Engine(ABC):
    """A model being trained, sharded however the backend likes, behind one API."""

    config: EngineConfig

    capabilities: ClassVar[frozenset[Capability]] = frozenset()
    """The optional parts of the contract this backend implements (none by default)."""

    @classmethod
    @abstractmethod
    def build(cls, config: EngineConfig) -> Engine:
        """Build the model, optimizer and scheduler from `config` on every rank.

        Called once per rank, after `torch.distributed` is initialised (or without it for a
        single process). Raises `ConfigError` for a model folder that is missing or a
        setting the backend does not support.
        """

    @classmethod
    def check_config(cls, config: EngineConfig, world_size: int = 1) -> None:
        """Refuse, with a `ConfigError` naming the field and the fix, every option of
        `config` this backend does not support at `world_size` ranks, without building
        anything: apps call it when their config loads, before any process starts, and
        `build` calls it again. The default refuses the options of the capabilities the
        backend does not declare (`lora.rank > 0` without `Capability.LORA`) and accepts
        everything else the config validated; a backend that overrides it calls it too."""
        if config.lora.enabled and Capability.LORA not in cls.capabilities:
            raise ConfigError(
                f"lora.rank={config.lora.rank}: {cls.__name__} has no LoRA support "
                f"({cls.__name__}.capabilities lacks Capability.LORA); set lora.rank=0 or use "
                "an engine that declares it"
            )
        declared = declared_hf_config(config.model)
        experts = ("num_experts", "num_local_experts", "n_routed_experts")
        if (
            config.moe.replays
            and "model_type" in declared
            and not any(declared.get(k) for k in experts)
        ):
            raise ConfigError(
                f"moe.routing_replay='rollout' on a {declared['model_type']!r} model, which "
                "has no experts to route; set moe.routing_replay=off"
            )

    @classmethod
    def _refuse(cls, capability: Capability, method: str) -> ConfigError:
        """The error of calling `method`, part of `capability`, on a backend without it."""
        return ConfigError(
            f"{method} needs Capability.{capability.name}, which {cls.__name__} does not "
            f"declare ({cls.__name__}.capabilities = "
            f"{sorted(c.name for c in cls.capabilities)}); use an engine that declares it"
        )

    # ----- lifecycle -------------------------------------------------------------------
    @abstractmethod
    def train_mode(self) -> AbstractContextManager[None]:
        """Context in which `forward_backward` / `optimizer_step` run: parameters and
        optimizer state are on the device (onloaded if offloaded), dropout is on."""

    @abstractmethod
    def eval_mode(self) -> AbstractContextManager[None]:
        """Context in which `forward` / `export_weights` run: parameters on the device,
        optimizer state may stay offloaded, dropout off."""

    def reference_mode(self) -> AbstractContextManager[None]:
        """Context in which `forward` runs the base model with the LoRA adapters off: the
        reference policy's log-probs, with no second model in memory. Entered inside
        `eval_mode()`. Part of `Capability.LORA` (the default refuses); a backend with it
        raises `ConfigError` naming `lora.rank` when the engine was built without adapters."""
        raise self._refuse(Capability.LORA, "reference_mode()")

    # ----- compute ---------------------------------------------------------------------
    @abstractmethod
    def forward(self, batch: TensorDict, *, extra_outputs: Collection[str] = ()) -> TensorDict:
        """Per-token outputs of this rank's `batch` without building a graph.

        batch: padded layout, `[B, T]` (see `tephra.engine_api.batch`).
        extra_outputs: names from `tephra.engine_api.forward_outputs.EXTRA_FORWARD_OUTPUTS`
          to compute as well (`sum_pi_squared`); `check_extra_outputs` refuses others.
        returns: TensorDict `[B]` with, aligned to `batch["input_ids"]` (`[B, T]`, float32):
          - policy: `log_probs` (log p(token_t | tokens_<t) / temperature-scaled) and, if
            `config.compute_entropy`, `entropy` of the distribution token_t was drawn from;
            each requested extra output (`sum_pi_squared`: sum_v p(v | tokens_<t)^2 of that
            distribution, computed with the log-probs, never as a `[T, vocab]` tensor);
          - value: `values` (V of the state before token_t).
        Positions where `response_mask` is 0 hold 0. Micro-batching by
        `config.micro_batch.forward_budget` happens inside.
        """

    @abstractmethod
    def forward_backward(self, batch: TensorDict, loss_fn: LossFn) -> dict[str, float]:
        """Accumulate gradients of `loss_fn` over this rank's `batch`.

        The engine splits `batch` into micro-batches by token budget, sets the global
        normalisers (`global_token_count`, `global_seq_count`: response tokens and
        sequences over the whole step, all ranks, with the rows the caller left out that
        the optional `left_out_token_count` / `left_out_seq_count` columns record) on each
        micro-batch, computes the same outputs as `forward` but with a graph, and
        back-propagates
        `loss_fn(outputs, micro_batch)`. The loss function returns each micro-batch's
        contribution to the global loss (already divided by the global normaliser); the
        engine makes the gradient equal the gradient of the sum over micro-batches and
        data-parallel ranks, whatever the split.

        returns: metrics: `loss` (the global loss, summed over micro-batches and ranks) and
        the mean of each metric `loss_fn` returned, over micro-batches and ranks.
        Gradients stay accumulated until `optimizer_step`.
        """

    @abstractmethod
    def optimizer_step(self) -> float:
        """Clip gradients to `optimizer.grad_clip`, step the optimizer, zero gradients.

        returns: the global gradient norm before clipping (same value on every rank).
        A non-finite norm skips the update (and is returned so the caller sees it).
        """

    def set_optimizer_params(
        self,
        *,
        lr: float,
        betas: tuple[float, float],
        eps: float,
        weight_decay: float,
        grad_clip: float,
    ) -> None:
        """Use these AdamW settings from the next `optimizer_step` on (`grad_clip` 0: no
        clipping), replacing `config.optimizer`'s; the optimizer's state (moments, step count)
        is kept. A learning-rate schedule, if stepped later, scales from `lr`. Part of
        `Capability.OPTIMIZER_PARAMS` (the default refuses)."""
        raise self._refuse(Capability.OPTIMIZER_PARAMS, "set_optimizer_params()")

    @abstractmethod
    def lr_scheduler_step(self) -> float:
        """Advance the learning-rate schedule by one optimizer step; returns the new lr."""

    # ----- weights ---------------------------------------------------------------------
    @abstractmethod
    def export_weights(
        self, bucket_bytes: int = 512 << 20, untie_word_embeddings: bool = False
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Yield the full (unsharded) weights in Hugging Face naming, in buckets.

        Each bucket is a list of `(hf_name, tensor)` of at most about `bucket_bytes`; every
        rank must iterate (gathers are collective) and every rank receives full tensors.
        LoRA adapters are merged into the base weights. With `untie_word_embeddings`, a
        model with tied embeddings also yields `lm_head.weight` (rollout engines such as
        vLLM keep a stale head otherwise). Called by the controller for weight sync.
        """

    @abstractmethod
    def save_checkpoint(self, path: str | Path) -> None:
        """Save model, optimizer, scheduler and RNG state (sharded) under `path`.

        Collective: every rank calls it with the same path. Training resumed from it by
        `load_checkpoint` continues bitwise as if never stopped.
        """

    @abstractmethod
    def load_checkpoint(self, path: str | Path) -> None:
        """Restore what `save_checkpoint` wrote; gradients accumulated before the call are
        dropped (a checkpoint lies between steps). Raises `CheckpointError` naming the path
        when it is missing or was written for another model."""

    @abstractmethod
    def export_hf(self, path: str | Path) -> None:
        """Write a Hugging Face folder (config, safetensors, tokenizer when known) that
        transformers and vLLM load with identical logits. Collective; rank 0 writes."""

    def export_adapter(self, path: str | Path) -> None:
        """Write the LoRA adapter alone as peft saves it (`adapter_config.json`,
        `adapter_model.safetensors`, `base_model_name_or_path` = `config.model.path`):
        `peft.PeftModel.from_pretrained(base, path)` over the base model gives this engine's
        outputs. Collective; rank 0 writes. Part of `Capability.LORA` (the default refuses);
        a backend with it raises `ConfigError` naming `lora.rank` without adapters."""
        raise self._refuse(Capability.LORA, "export_adapter()")

    def export_adapter_weights(self) -> LoraAdapter:
        """The LoRA adapter alone, in memory, for an adapter-only weight sync: its rank,
        alpha and full A / B matrices named as peft saves them (float32, CPU), the same
        matrices `export_adapter` writes. Collective: every rank calls it and every rank
        receives the whole adapter. Part of `Capability.LORA` (the default refuses); a
        backend with it raises `ConfigError` naming `lora.rank` without adapters."""
        raise self._refuse(Capability.LORA, "export_adapter_weights()")

    def load_adapter_weights(self, adapter: LoraAdapter) -> None:
        """Make `adapter`'s matrices the engine's LoRA weights and start training afresh from
        them, as an engine just built with those weights would: the optimizer's state
        (moments, step count) cleared, the learning-rate schedule back at its start,
        gradients dropped; the optimizer settings (`config.optimizer`, as
        `set_optimizer_params` last left them) and the RNG are kept. `adapter` holds what
        `export_adapter_weights()` returns: every adapted module's A and B, this engine's
        rank and alpha; a `ConfigError` names a missing, unexpected or misshapen matrix, or
        another rank or alpha (`lora.rank`, `lora.alpha`). Collective: every
        rank passes the whole adapter. Part of `Capability.LORA` (the default refuses); a
        backend with it raises `ConfigError` naming `lora.rank` without adapters."""
        raise self._refuse(Capability.LORA, "load_adapter_weights()")

    # ----- topology --------------------------------------------------------------------
    @property
    @abstractmethod
    def dp_rank(self) -> int:
        """This rank's index among the data-parallel ranks (which share of a batch it gets)."""

    @property
    @abstractmethod
    def dp_size(self) -> int:
        """Number of data-parallel ranks (how many shares a batch is split into)."""

    @property
    @abstractmethod
    def is_dp_output_rank(self) -> bool:
        """Whether this rank hands its share's results back to the controller: exactly one
        rank per `dp_rank` does (its tensor / pipeline / context peers compute the same
        outputs and return nothing)."""
