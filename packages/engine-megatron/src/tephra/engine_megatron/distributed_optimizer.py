"""Data parallelism with a ZeRO-1 distributed optimizer, from megatron-core's own parts.

- megatron's `DistributedDataParallel` wraps each model chunk: the parameters move into one
  contiguous buffer per dtype and a backward hook adds every micro-batch's gradient into a
  float32 `main_grad` buffer beside it (accumulation across micro-batches and across
  `forward_backward` calls until the step).
- `finalize_model_grads` at the step: reduce-scatters each gradient buffer over the
  data(+context)-parallel group (expert weights over the expert data-parallel group), so each
  rank receives the summed gradient of its 1/dp slice only; sums sequence-parallel norm
  gradients over the TP group; sums the tied embedding / output layer gradients over the first
  and last pipeline stages.
- megatron's `DistributedOptimizer` keeps, on each data-parallel rank, only its slice of the
  float32 master weights and of the AdamW moments (torch AdamW over slices), updates it, and
  all-gathers the updated parameters back into the buffer of every rank.

Loss scaling: the model's `TransformerConfig.calculate_per_token_loss=True` makes megatron's
DDP sum gradients over data-parallel ranks instead of averaging them, so the gradient is that
of the sum of the micro-batch losses over all ranks (the loss functions already divide by the
global token / sequence counts).

Gradient norm: sqrt(sum of g^2) over distinct entries: each rank sums its slices (replicas of
a TP-replicated weight only on TP rank 0, the last stage's copy of a tied embedding skipped
as `shared`), then the sums are added over all ranks. A non-finite norm skips the update.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig
from megatron.core.optimizer import get_megatron_optimizer
from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32
from megatron.core.transformer import TransformerConfig

from tephra.engine_api.config import OptimizerConfig, SchedulerConfig
from tephra.engine_megatron import cpu_compat
from tephra.engine_megatron.lr_schedule import LrSchedule


class DistributedAdamW:
    """AdamW with float32 master weights sharded over data-parallel ranks (ZeRO-1).

    `ddp_chunks` are the model chunks to run (megatron DDP wrappers of `chunks`); `step()`
    reduces the gradients, clips them to `optimizer.grad_clip` by the global norm, updates
    this rank's slice and gathers the parameters; it returns the norm before clipping.
    """

    def __init__(
        self,
        chunks: Sequence[torch.nn.Module],
        tconfig: TransformerConfig,
        optimizer: OptimizerConfig,
        scheduler: SchedulerConfig,
    ) -> None:
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,  # micro-batch gradients accumulate in float32
            overlap_grad_reduce=False,  # one reduce-scatter per step, after the last backward
            overlap_param_gather=False,
            use_distributed_optimizer=True,
        )
        config = MegatronOptimizerConfig(
            optimizer="adam",
            lr=optimizer.lr,
            weight_decay=optimizer.weight_decay,
            adam_beta1=optimizer.betas[0],
            adam_beta2=optimizer.betas[1],
            adam_eps=optimizer.eps,
            clip_grad=optimizer.grad_clip,
            bf16=tconfig.bf16,
            params_dtype=tconfig.params_dtype,
            use_distributed_optimizer=True,
        )
        with cpu_compat.device_scope():
            self.ddp_chunks = [DistributedDataParallel(tconfig, ddp_config, c) for c in chunks]
            # config_overrides={}: one parameter group, weight decay on every weight (as the
            # other tephra engines do); gloo side groups are only for megatron's own
            # checkpoint format, which is not used (each rank saves its slice).
            self.optimizer = get_megatron_optimizer(
                config, self.ddp_chunks, config_overrides={}, use_gloo_process_groups=False
            )
        self.grad_clip = optimizer.grad_clip
        self.schedule = LrSchedule(lambda: self.optimizer.param_groups, optimizer.lr, scheduler)

    @property
    def _parts(self) -> list:
        """megatron optimizers: dense weights, then expert weights when the model has them."""
        return [o for o in self.optimizer.chained_optimizers if not o.is_stub_optimizer]

    def master_params(self) -> list[torch.Tensor]:
        """This rank's float32 master slices (1-D), in optimizer order."""
        return [p for part in self._parts for g in part.optimizer.param_groups for p in g["params"]]

    def local_numel(self) -> int:
        """Entries of the master weights (and of each Adam moment) held by this rank."""
        return sum(p.numel() for p in self.master_params())

    def step(self) -> float:
        with cpu_compat.device_scope():
            finalize_model_grads(self.ddp_chunks)
            # copies each rank's reduced slice into its master weights' .grad (float32);
            # the found-inf flag it returns is only set with a loss scaler (fp16), never here
            self.optimizer.prepare_grads()
            norm = float(self.optimizer.get_grad_norm())
            if math.isfinite(norm):
                if self.grad_clip > 0:
                    for part in self._parts:
                        clip_grad_by_total_norm_fp32(part.get_parameters(), self.grad_clip, norm)
                self.optimizer.step_with_ready_grads()
            self.zero_grad()
        return norm

    def zero_grad(self) -> None:
        """Both are needed: the DDP buffers hold the accumulated gradients, the optimizer's
        master slices hold views of them (megatron's training loop clears both too)."""
        for chunk in self.ddp_chunks:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad(set_to_none=True)

    def lr_step(self) -> float:
        """Advance the lr schedule one step; returns the new lr."""
        return self.schedule.step()

    # ----- checkpoint: this rank's slice only ---------------------------------------------
    def state_dict(self) -> dict:
        return {
            # clones: the slices are views of whole buffers, which torch.save would write out
            "master": [p.detach().clone() for p in self.master_params()],
            "adam": [part.optimizer.state_dict() for part in self._parts],
            "schedule": self.schedule.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        master = self.master_params()
        if len(master) != len(state["master"]) or any(
            p.shape != s.shape for p, s in zip(master, state["master"])
        ):
            raise ValueError("optimizer slices do not match this layout")
        with torch.no_grad():
            for p, saved in zip(master, state["master"]):
                p.copy_(saved)
        for part, saved in zip(self._parts, state["adam"]):
            part.optimizer.load_state_dict(saved)
        self.schedule.load_state_dict(state["schedule"])
