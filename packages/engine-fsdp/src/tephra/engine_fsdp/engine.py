"""`FSDPEngine`: the engine contract on Hugging Face models sharded with FSDP2.

Registered as `fsdp` in the `tephra.engines` entry-point group. One class, composed of the
helpers beside it: `model_builder` (HF policy / value models), `lora` (peft adapters),
`sharding` (process group, mesh, `fully_shard`), `scorer` (log-probs/entropy/values through
`tephra.kernels`), `microbatches`, `schedulers`, `weights` (export) and `checkpoint` (DCP).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Collection, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from tensordict import TensorDict
from torch.distributed.tensor import DTensor

from tephra.engine_api import batch as B
from tephra.engine_api.adapters import LoraAdapter
from tephra.engine_api.capabilities import Capability
from tephra.engine_api.config import EngineConfig, OptimizerConfig
from tephra.engine_api.engine import Engine
from tephra.engine_api.errors import BatchError, ConfigError
from tephra.engine_api.forward_outputs import check_extra_outputs
from tephra.engine_api.loss import LossFn, reduce_metrics, shares_of
from tephra.engine_api.multimodal import (
    declared_hf_config,
    is_vision_config,
    model_has_vision,
    vision_family,
)
from tephra.engine_fsdp import (
    checkpoint,
    families,
    lora,
    microbatches,
    prefix_sharing,
    router_noise,
    routing_replay,
    sharding,
    tree_attention,
    ulysses,
    ulysses_families,
    vision,
    weights,
)
from tephra.engine_fsdp.model_builder import backbone, build_model, decoder_layers
from tephra.engine_fsdp.schedulers import build_scheduler
from tephra.engine_fsdp.scorer import TokenScorer, check_output_head

if TYPE_CHECKING:
    from peft import PeftModel

logger = logging.getLogger(__name__)


def packs(config: EngineConfig) -> bool:
    """Whether micro-batches are packed: flash and flex attention run packed sequences
    natively; SDPA and eager would need a dense mask over the whole packed stream. Left to
    the engine (`use_packing=None`), a family refused in the packed layout is padded."""
    if config.micro_batch.use_packing is None and families.refusal(config, "packed"):
        return False
    return config.micro_batch.packing(
        config.model.attn_implementation in ("flash_attention_2", "flex_attention")
    )


def flex_attention_refusal(config: EngineConfig, device: torch.device) -> str | None:
    """Why `model.attn_implementation=flex_attention` cannot run on `device`, or None.

    torch compiles CPU flex attention into a C++ kernel for the vector units it uses; its
    AVX2 build returned NaN for packed sequences (and crashed on other shapes) where the
    AVX-512 build matched SDPA within 2e-7 (torch 2.13, measured on one machine with
    `ATEN_CPU_CAPABILITY=avx2`, which makes torch and its compiler take their AVX2 paths as on
    an AVX2-only CPU). Silent NaN log-probs would wreck training, so it is refused."""
    if device.type != "cpu" or config.model.attn_implementation != "flex_attention":
        return None
    if torch.backends.cpu.get_cpu_capability() != "AVX2":
        return None
    return (
        "model.attn_implementation='flex_attention' on a CPU where torch runs AVX2 kernels "
        "(no AVX-512, or ATEN_CPU_CAPABILITY=avx2): torch's compiled CPU flex attention "
        "returns NaN there; use model.attn_implementation=sdpa (padded rows), or a machine "
        "whose CPU has AVX-512"
    )


FLEX_NO_BACKWARD = (
    "model.attn_implementation='flex_attention' on CPU trains nothing: torch's flex attention "
    "has no backward on CPU (NotImplementedError); use model.attn_implementation=sdpa to "
    "train on CPU (flex attention on CPU is for forward passes: log-probs, a reference model)"
)
"""Why a CPU engine with flex attention refuses `forward_backward` (its forward runs)."""


def sharing_supported(config: EngineConfig) -> bool:
    """`micro_batch.share_prefix` works on padded rows, so not with packing or Ulysses."""
    return not packs(config) and config.parallel.context == 1


def shares(config: EngineConfig) -> bool:
    """Whether padded micro-batches share prompt prefixes. Left to the engine
    (`share_prefix=None`): where supported, and not for a family refused in that layout."""
    if config.micro_batch.share_prefix is None and families.refusal(config, "shared_prefix"):
        return False
    return config.micro_batch.share_prefix is not False and sharing_supported(config)


class FSDPEngine(Engine):
    """FSDP2 engine. Build with `FSDPEngine.build(config)` (or `get_engine("fsdp", config)`).

    Declares `Capability.LORA` (peft adapters): `reference_mode()`, `export_adapter()` and
    `export_adapter_weights()`; and `Capability.OPTIMIZER_PARAMS`: `set_optimizer_params()`.
    Beyond the `Engine` contract (for this package's tests and helpers, not for callers of
    the contract): `model`, the FSDP-wrapped root module; `hf_model`, the transformers model
    inside it.
    """

    capabilities = frozenset({Capability.LORA, Capability.OPTIMIZER_PARAMS})

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = sharding.resolve_device(config.device)
        refusal = flex_attention_refusal(config, self.device)
        if refusal:
            raise ConfigError(refusal)
        self.owns_process_group = sharding.ensure_process_group(self.device)
        self.mesh = sharding.build_mesh(config, self.device)
        # counts and metrics are small CPU tensors: they need a group with a CPU backend
        self.cpu_group = sharding.cpu_group()
        # Ulysses: `sp` consecutive ranks share rows and split each packed sequence
        self.sp = config.parallel.context
        # flash/flex attention run packed sequences natively; SDPA and eager need a dense mask
        self.packed = packs(config)
        self.share_prefix = shares(config)
        self.sp_group = self.dp_group = self.cpu_group
        if self.sp > 1:
            self.sp_group, self.dp_group = ulysses.groups(self.sp, self.device)
        where = f"model.path={config.model.path!r}" if config.model.path else "model.hf_config"
        hf_model = build_model(config.model)
        layers = decoder_layers(hf_model, where)
        check_output_head(hf_model, config.model.role, where)
        if self.sp > 1:
            sharding.check_ulysses(config, hf_model, where)
            hf_model.config._attn_implementation = ulysses.ATTENTION_NAME
        self.vlm = is_vision_config(hf_model.config)
        if self.share_prefix and not self.vlm and hf_model.config._attn_implementation == "sdpa":
            # shared-prefix rows attend per prefix and segment (`tree_attention`); every
            # other forward is transformers' SDPA
            hf_model.config._attn_implementation = tree_attention.ATTENTION_NAME
        self.flat_tree = hf_model.config._attn_implementation == tree_attention.ATTENTION_NAME
        """Shared-prefix micro-batches run as one unpadded row (`prefix_sharing.layout`)."""
        self.peft_model: PeftModel | None = None
        """The peft model around `hf_model` (what trains) with LoRA, else None."""
        if config.lora.enabled:
            self.peft_model = lora.apply_lora(
                hf_model, config.lora, config.model.role, seed=config.model.init_seed
            )
        self.scorer = TokenScorer(
            hf_model if self.peft_model is None else self.peft_model,
            hf_model,
            config.model.role,
            config.temperature,
            config.compute_entropy,
        )
        sharding.shard_model(self.scorer, layers, self.mesh, config, self.device)
        self.model = self.scorer
        self.hf_model = hf_model
        # MoE routers replay a batch's `routed_experts` (their own top-k without it)
        self.router_replay = routing_replay.RouterReplay(hf_model)
        # routers that sample in train mode (PhiMoE) train deterministically (`router_noise`)
        self.noisy_routers = router_noise.noisy_routers(hf_model)
        router_noise.hold_deterministic(self.noisy_routers)
        # a VLM on several ranks runs its tower on every micro-batch (see `vision`)
        self.idle_vision = self.vlm and dist.is_initialized() and dist.get_world_size() > 1
        params = [p for p in self.scorer.parameters() if p.requires_grad]
        opt = config.optimizer
        self.optimizer = torch.optim.AdamW(
            params,
            lr=opt.lr,
            betas=opt.betas,
            eps=opt.eps,
            weight_decay=opt.weight_decay,
            # one fused kernel per step: 4x faster than the per-parameter loop on a CPU
            # (0.56 -> 0.14 s for 135M parameters); the list-wide foreach kernels are not
            # portable over DTensors of uneven shards
            fused=True,
        )
        self.scheduler = build_scheduler(self.optimizer, config.scheduler)
        self.step = 0
        self.skipped_updates = 0
        """Optimizer steps skipped for a non-finite gradient norm."""
        self._optimizer_on_device = True
        torch.manual_seed(config.seed + self.dp_rank)
        self._offload_optimizer()

    # ----- construction ----------------------------------------------------------------
    @classmethod
    def check_config(cls, config: EngineConfig, world_size: int = 1) -> None:
        """Refuse every option engine=fsdp does not implement (see the README, Options)."""
        super().check_config(config, world_size)
        if config.optimizer.name != "adamw":
            raise ConfigError(
                f"optimizer.name={config.optimizer.name!r}: engine=fsdp has adamw only"
            )
        sharding.check_parallel(config, world_size)
        if config.moe.replays and config.parallel.context > 1:
            raise ConfigError(
                "moe.routing_replay='rollout' with parallel.context > 1 (Ulysses): engine-fsdp "
                "replays routes on whole sequences only; set parallel.context=1"
            )
        if model_has_vision(config.model):  # a family without an adapter: before building
            vision_family(declared_hf_config(config.model))
        families.check_causal_setting(config)
        families.check_layout(config, packs(config))
        ulysses_families.check(config)
        if config.micro_batch.share_prefix and not sharing_supported(config):
            raise ConfigError(
                "micro_batch.share_prefix=true needs padded micro-batches (micro_batch."
                "use_packing=false, or null with sdpa/eager attention) and "
                "parallel.context=1; set share_prefix=null"
            )

    @classmethod
    def build(cls, config: EngineConfig) -> FSDPEngine:
        world = dist.get_world_size() if dist.is_initialized() else 1
        cls.check_config(config, world)
        return cls(config)

    # ----- topology --------------------------------------------------------------------
    @property
    def dp_rank(self) -> int:
        """Rank // parallel.context: the ranks of one Ulysses group get the same rows."""
        return dist.get_rank() // self.sp

    @property
    def dp_size(self) -> int:
        """World size / parallel.context."""
        return dist.get_world_size() // self.sp

    @property
    def is_dp_output_rank(self) -> bool:
        """Every rank of a Ulysses group returns the same gathered outputs; its first hands
        them back to the controller."""
        return dist.get_rank() % self.sp == 0

    # ----- lifecycle -------------------------------------------------------------------
    def _move_optimizer_state(self, device: torch.device) -> None:
        for state in self.optimizer.state.values():
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and key != "step":
                    state[key] = value.to(device)

    def _offload_optimizer(self) -> None:
        # FSDP's param offload already keeps the optimizer state (built on the CPU
        # shards) in CPU memory, where the step needs it; this covers offloading the
        # optimizer alone (moving it to the GPU for train_mode would part it from the params).
        if (
            self.config.offload.optimizer
            and not self.config.offload.params
            and self.device.type == "cuda"
            and self._optimizer_on_device
        ):
            self._move_optimizer_state(torch.device("cpu"))
            self._optimizer_on_device = False

    def _onload_optimizer(self) -> None:
        if not self._optimizer_on_device:
            self._move_optimizer_state(self.device)
            self._optimizer_on_device = True

    @contextmanager
    def _mode(self, train: bool) -> Iterator[None]:
        was_training = self.scorer.training
        self.scorer.train(train)
        router_noise.hold_deterministic(self.noisy_routers)
        if train:
            self._onload_optimizer()
        try:
            yield
        finally:
            self.scorer.train(was_training)
            router_noise.hold_deterministic(self.noisy_routers)
            if train:
                self._offload_optimizer()

    def train_mode(self) -> AbstractContextManager[None]:
        return self._mode(True)

    def eval_mode(self) -> AbstractContextManager[None]:
        return self._mode(False)

    @contextmanager
    def reference_mode(self) -> Iterator[None]:
        """Forward passes inside run the base model (peft's adapters disabled): the reference
        policy's log-probs, with no second model in memory. Needs `lora.rank > 0`."""
        adapters = self._adapters(
            "reference_mode()",
            "without adapters the base model is being trained, so build a separate engine "
            "for the reference policy",
        )
        with adapters.disable_adapter():
            yield

    def _adapters(self, method: str, fix: str) -> PeftModel:
        """The peft model; a `ConfigError` naming `method` and `fix` without LoRA."""
        if self.peft_model is None:
            raise ConfigError(f"{method} needs LoRA (lora.rank > 0): {fix}")
        return self.peft_model

    # ----- compute ---------------------------------------------------------------------
    def _validate(self, batch: TensorDict) -> TensorDict:
        """A checked shallow copy of `batch` with position ids filled in."""
        B.validate_batch(batch)
        batch = batch.copy()
        if B.POSITION_IDS not in batch.keys():
            batch[B.POSITION_IDS] = B.positions_from_mask(batch[B.ATTENTION_MASK])
        vocab = self.hf_model.config.get_text_config().vocab_size
        ids = batch[B.INPUT_IDS][batch[B.ATTENTION_MASK].bool()]
        if ids.numel() and int(ids.max()) >= vocab:
            raise BatchError(
                f"batch['input_ids'] holds token id {int(ids.max())} >= the model's vocab size "
                f"{vocab}; the tokenizer and model do not match"
            )
        vision.check_batch(batch, self.hf_model.config, self.sp)
        if B.ROUTED_EXPERTS in batch.keys() and not self.config.moe.replays:
            # the rollout's routes replay with moe.routing_replay=rollout only (a critic
            # handed the policy's batch ignores them)
            del batch[B.ROUTED_EXPERTS]
        if B.ROUTED_EXPERTS in batch.keys():
            self.router_replay.check(batch)
            if self.sp > 1:
                raise BatchError(
                    "batch['routed_experts'] with parallel.context > 1 (Ulysses): engine-fsdp "
                    "replays routes on whole sequences only; set parallel.context=1"
                )
        return batch

    def _outputs(
        self, mb: TensorDict, extra: tuple[str, ...] = ()
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """Per-token outputs `[b, t]` of one padded micro-batch (aligned to tokens, 0 off
        the response), plus the zero `anchor` for the loss; `extra`: the requested
        `EXTRA_FORWARD_OUTPUTS` (checked by `forward`)."""
        attn = mb[B.ATTENTION_MASK]
        resp = mb[B.RESPONSE_MASK]
        # kept until the next micro-batch: a recomputed forward (gradient checkpointing, in
        # this micro-batch's backward) replays the same routes
        self.router_replay.set_micro_batch(mb, self.packed)
        if self.sp > 1:
            return self._sequence_parallel_outputs(mb, extra)
        # the kernel computes sum pi^2 in its pass over the vocabulary, only when asked
        sum_sq = "sum_pi_squared" in extra
        pos: torch.Tensor | None = None
        pixels: dict[str, torch.Tensor] = {}
        idle: dict[str, torch.Tensor] | None = None  # a blank image for the tower (`vision`)
        if self.vlm:  # pixel inputs and mRoPE position ids
            pos, pixels = vision.model_inputs(
                backbone(self.hf_model), self.hf_model.config, mb, self.packed, self.device
            )
            if not pixels and self.idle_vision:
                idle = vision.idle_inputs(self.hf_model.config, self.device)
        if self.packed:
            packed = B.pack(
                mb.select(B.INPUT_IDS, B.POSITION_IDS, B.RESPONSE_MASK, B.ATTENTION_MASK)
            )
            ids = packed[B.INPUT_IDS][None]
            label_mask = B.label_positions(packed[B.RESPONSE_MASK])[None]
            # attention_mask=None + restarting position ids is how HF models see packing
            pos = packed[B.POSITION_IDS][None] if pos is None else pos
            out = self.scorer(
                ids.to(self.device),
                pos.to(self.device),
                None,
                label_mask.to(self.device),
                idle_vision=idle,
                **pixels,
                sum_pi_squared=sum_sq,
            )
            sel = label_mask[0].bool()
            size = ids.shape[1]
        else:
            label_mask = B.label_positions(resp) * attn
            pos = mb[B.POSITION_IDS] if pos is None else pos
            tree = (
                prefix_sharing.layout(mb[B.INPUT_IDS], attn, pos, label_mask, self.flat_tree)
                # replayed routes follow the plain [b, t] layout, not the shared-prefix tree
                if self.share_prefix and not self.vlm and self.router_replay.targets is None
                else None
            )
            ids = mb[B.INPUT_IDS]
            # rows run from column 0 (left padding moved to the end), so a model that reads
            # the row by column (DeepSeek-V4's compressor windows, RWKV's recurrence over the
            # pad tokens) sees each sequence as it sees it alone; image rows and replayed
            # routes keep the batch's columns, which their inputs are aligned to
            shift = (
                None
                if tree is not None or self.vlm or self.router_replay.targets is not None
                else microbatches.leading_padding(attn)
            )
            if shift is not None:
                ids, attn, pos, label_mask = (
                    microbatches.roll_rows(x, -shift) for x in (ids, attn, pos, label_mask)
                )
            if tree is not None:
                tree = tree.to(self.device)
            out = self.scorer(
                ids.to(self.device),
                pos.to(self.device),
                attn.to(self.device),
                label_mask.to(self.device),
                tree=tree,
                idle_vision=idle,
                **pixels,
                sum_pi_squared=sum_sq,
            )
            sel = label_mask.bool()
            size = None
        result = {}
        for key, values in out.items():
            if key == "anchor":
                continue
            per_hidden = values.new_zeros(sel.shape)
            per_hidden[sel.to(values.device)] = values
            per_token = B.align_to_tokens(per_hidden)
            if size is not None:  # packed [1, N] -> padded [b, t]
                per_token = B.unpack(per_token, attn.to(values.device))
            elif shift is not None:  # back to the batch's columns
                per_token = microbatches.roll_rows(per_token, shift)
            result[key] = per_token
        return result, out["anchor"]

    def _sequence_parallel_outputs(
        self, mb: TensorDict, extra: tuple[str, ...] = ()
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """`_outputs` under Ulysses: the packed stream `[N]` is padded to `T = sp * t`
        (the padding is a segment of its own, never labelled), this rank scores tokens
        `[r t, (r + 1) t)` and the per-token floats `[t]` are all-gathered into `[T]`.
        Micro-batches are packed here whatever `micro_batch.use_packing` says (it still
        decides how the token budget is counted)."""
        attn = mb[B.ATTENTION_MASK]
        packed = B.pack(mb.select(B.INPUT_IDS, B.POSITION_IDS, B.RESPONSE_MASK, B.ATTENTION_MASK))
        ids, pos = packed[B.INPUT_IDS], packed[B.POSITION_IDS]
        label_mask = B.label_positions(packed[B.RESPONSE_MASK])
        n = ids.shape[0]
        total = ulysses.padded_length(n, self.sp)
        pad = total - n
        # the padding is a sequence of its own (positions from 0, no labels) of a real token:
        # a model's padding id may embed to zeros, whose gradient some models make infinite
        # (Gemma 3n's AltUp: the root of the mean square of a hidden state that stays 0)
        ids = torch.cat([ids, ids.new_full((pad,), int(ids[0]))])
        pos = torch.cat([pos, torch.arange(pad, dtype=pos.dtype)])
        label_mask = torch.cat([label_mask, label_mask.new_zeros(pad)])
        next_tokens = torch.cat([ids[1:], ids.new_zeros(1)])
        t = total // self.sp
        r = dist.get_rank(self.sp_group)
        local = slice(r * t, (r + 1) * t)
        with ulysses.sequence_context(self.sp_group, self.sp, pos):
            out = self.scorer(
                ids[local][None].to(self.device),
                pos[local][None].to(self.device),
                None,
                label_mask[local][None].to(self.device),
                next_tokens[local][None].to(self.device),
                sum_pi_squared="sum_pi_squared" in extra,
            )
        sel = label_mask[local].bool()
        result = {}
        for key, values in out.items():
            if key == "anchor":
                continue
            per_hidden = values.new_zeros(t)
            per_hidden[sel.to(values.device)] = values
            full = ulysses.GatherShards.apply(per_hidden, self.sp_group, self.sp, r)[:n]
            per_token = B.align_to_tokens(full)  # [n]
            result[key] = B.unpack(per_token, attn.to(values.device))
        return result, out["anchor"]

    def forward(self, batch: TensorDict, *, extra_outputs: Collection[str] = ()) -> TensorDict:
        extra = check_extra_outputs(extra_outputs, self.config.model.role)
        batch = self._validate(batch)
        budget = self.config.micro_batch.forward_budget
        field = (
            "forward_max_tokens_per_microbatch"
            if self.config.micro_batch.forward_max_tokens_per_microbatch
            else "max_tokens_per_microbatch"
        )
        plan = microbatches.plan(batch, budget, self.packed, field, self.cpu_group)
        packed_parts: dict[str, list[torch.Tensor]] = {}
        with torch.no_grad():
            for mb in plan:
                outputs, _ = self._outputs(mb.data, extra)
                if mb.filler:
                    continue
                attn = mb.data[B.ATTENTION_MASK].bool()
                for key, value in outputs.items():
                    packed_parts.setdefault(key, []).append(value.cpu()[attn])
        attn = batch[B.ATTENTION_MASK]
        fields = {key: B.unpack(torch.cat(parts), attn) for key, parts in packed_parts.items()}
        return TensorDict(fields, batch_size=batch.batch_size)

    def forward_backward(self, batch: TensorDict, loss_fn: LossFn) -> dict[str, float]:
        if self.device.type == "cpu" and self.config.model.attn_implementation == "flex_attention":
            raise ConfigError(FLEX_NO_BACKWARD)
        batch = self._validate(batch)
        plan = microbatches.plan(
            batch,
            self.config.micro_batch.max_tokens_per_microbatch,
            self.packed,
            "max_tokens_per_microbatch",
            self.cpu_group,
        )
        real = [mb.data for mb in plan if not mb.filler]
        B.set_global_normalisers(real, process_group=self.dp_group)
        total_loss = 0.0
        metric_sums: dict[str, float] = {}
        shares: set[str] = set()
        for mb in plan:
            outputs, anchor = self._outputs(mb.data)
            if mb.filler:
                loss = anchor + sum(v.sum() * 0.0 for v in outputs.values())
            else:
                out_td = TensorDict(outputs, batch_size=mb.data.batch_size)
                loss, metrics = loss_fn(out_td, mb.data.to(self.device))
                total_loss += float(loss.detach())
                shares |= shares_of(metrics)
                for key, value in metrics.items():
                    metric_sums[key] = metric_sums.get(key, 0.0) + float(value)
                # FSDP averages gradients over all ranks; the contract asks for the
                # gradient of the sum over data-parallel ranks. The sp ranks of a Ulysses
                # group each back-propagate their own tokens' share, which together make
                # one group's gradient: hence the factor world size = dp_size * sp.
                loss = loss * self.dp_size * self.sp + anchor
            loss.backward()
        return self._reduce_metrics(total_loss, metric_sums, shares, len(real))

    def _reduce_metrics(
        self, loss: float, sums: dict[str, float], shares: set[str], count: int
    ) -> dict[str, float]:
        keys = sorted(sums)
        t = torch.tensor([loss, float(count), *[sums[k] for k in keys]], dtype=torch.float64)
        if self.dp_size > 1:
            dist.all_reduce(t, group=self.dp_group)
        totals = {key: float(t[2 + i]) for i, key in enumerate(keys)}
        return {"loss": float(t[0]), **reduce_metrics(totals, shares, float(t[1]))}

    def optimizer_step(self) -> float:
        params = [p for p in self.scorer.parameters() if p.requires_grad and p.grad is not None]
        clip = self.config.optimizer.grad_clip
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm=clip if clip > 0 else math.inf)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        grad_norm = float(norm)
        if math.isfinite(grad_norm):
            self.optimizer.step()
            self.step += 1
        else:  # a NaN/inf loss or gradient: keep the weights, count and say so
            self.skipped_updates += 1
            logger.warning(
                "optimizer step skipped: gradient norm is %s (a NaN or inf loss); "
                "the weights are unchanged (%d skipped so far). Look for inf "
                "rewards or advantages, or lower optimizer.lr",
                grad_norm,
                self.skipped_updates,
            )
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm

    def set_optimizer_params(
        self,
        *,
        lr: float,
        betas: tuple[float, float],
        eps: float,
        weight_decay: float,
        grad_clip: float,
    ) -> None:
        # validated as the config's own fields are, with the same messages
        settings = OptimizerConfig(
            lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, grad_clip=grad_clip
        )
        self.config.optimizer = settings
        for group in self.optimizer.param_groups:
            group.update(lr=lr, betas=settings.betas, eps=eps, weight_decay=weight_decay)
            group["initial_lr"] = lr
        self.scheduler.base_lrs = [lr for _ in self.optimizer.param_groups]

    def lr_scheduler_step(self) -> float:
        self.scheduler.step()
        return float(self.scheduler.get_last_lr()[0])

    # ----- weights ---------------------------------------------------------------------
    def export_weights(
        self, bucket_bytes: int = 512 << 20, untie_word_embeddings: bool = False
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        items = weights.iter_full_weights(self.hf_model, self.device, untie_word_embeddings)
        return weights.buckets(items, bucket_bytes)

    def export_hf(self, path: str | Path) -> None:
        model_cfg = self.config.model
        tokenizer_dir = model_cfg.tokenizer_path or model_cfg.path
        weights.write_hf_folder(Path(path), self.hf_model, self.device, tokenizer_dir)

    def export_adapter(self, path: str | Path) -> None:
        self._adapters(
            "export_adapter()", "without adapters there is none; export the model with export_hf"
        )
        weights.write_adapter_folder(
            Path(path), self.hf_model, self.device, self.config.lora, self.config.model.path
        )

    def export_adapter_weights(self) -> LoraAdapter:
        self._adapters(
            "export_adapter_weights()",
            "without adapters there is none; sync the full weights with export_weights",
        )
        tensors = weights.adapter_tensors(self.hf_model, self.device)
        return LoraAdapter(self.config.lora.rank, self.config.lora.alpha, tensors)

    def load_adapter_weights(self, adapter: LoraAdapter) -> None:
        self._adapters(
            "load_adapter_weights()",
            "without adapters there is none to load; build the engine with lora.rank > 0",
        )
        lora_cfg = self.config.lora
        if (adapter.rank, adapter.alpha) != (lora_cfg.rank, lora_cfg.alpha):
            raise ConfigError(
                f"load_adapter_weights(): the adapter has rank {adapter.rank}, alpha "
                f"{adapter.alpha}; this engine lora.rank={lora_cfg.rank}, lora.alpha="
                f"{lora_cfg.alpha}: load it into an engine built with the adapter's"
            )
        weights.load_adapter_tensors(self.hf_model, adapter.tensors, self.device)
        # a fresh optimizer and schedule, as `__init__` builds them (settings kept: they
        # are `config.optimizer`, which `set_optimizer_params` updates)
        self.optimizer.zero_grad(set_to_none=True)
        self.optimizer.state.clear()
        self._optimizer_on_device = True
        self.scheduler = self._fresh_scheduler()
        self.step = 0
        self._offload_optimizer()

    def _fresh_scheduler(self) -> torch.optim.lr_scheduler.LambdaLR:
        """The schedule at its start over the current settings (`config.optimizer.lr`)."""
        for group in self.optimizer.param_groups:
            group["lr"] = group["initial_lr"] = self.config.optimizer.lr
        return build_scheduler(self.optimizer, self.config.scheduler)

    def save_checkpoint(self, path: str | Path) -> None:
        self._onload_optimizer()
        checkpoint.save(
            Path(path), self.scorer, self.optimizer, self.scheduler, self.step, self.device
        )
        self._offload_optimizer()

    def load_checkpoint(self, path: str | Path) -> None:
        self._onload_optimizer()
        self.step = checkpoint.load(
            Path(path), self.scorer, self.optimizer, self.scheduler, self.device
        )
        # a checkpoint is taken between steps: gradients accumulated before belong to no step
        self.optimizer.zero_grad(set_to_none=True)
        self._offload_optimizer()
