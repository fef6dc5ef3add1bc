"""`MegatronEngine`: the engine contract on megatron-core (TP, SP, PP, EP, CP, DP).

One class composed with helpers it owns: `model_builder` (GPTModel chunks and heads),
`hf_conversion` (weight mapping), `parallel_setup` (process groups), `micro_batches`
(layout of a micro-batch for the model), `checkpoint`, and `cpu_compat` (everything a
CUDA-less machine needs; no branch on the device lives here).

Per step: `forward_backward` cuts this rank's batch into micro-batches by token budget,
writes the global normalisers (summed over the data-parallel group), and runs megatron's
pipeline schedule (no pipelining, 1F1B or interleaved); the loss function sees the same
`[b, t]` outputs as `forward`. Gradients are summed over micro-batches into megatron DDP's
float32 buffers and reduce-scattered over data-parallel ranks in `optimizer_step`, so the
gradient is that of the sum of the micro-batch losses over all ranks, whatever the split;
each data-parallel rank then updates only its slice of the float32 master weights and Adam
state (ZeRO-1, `distributed_optimizer`).
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Callable, Collection, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tensordict import TensorDict
from transformers import AutoConfig

from tephra.engine_api import batch as B
from tephra.engine_api.adapters import LoraAdapter
from tephra.engine_api.capabilities import Capability
from tephra.engine_api.config import EngineConfig
from tephra.engine_api.engine import Engine
from tephra.engine_api.errors import BatchError, ConfigError
from tephra.engine_api.forward_outputs import check_extra_outputs
from tephra.engine_api.loss import LossFn, reduce_metrics, shares_of
from tephra.engine_api.multimodal import declared_hf_config, model_has_vision
from tephra.engine_megatron import cpu_compat

cpu_compat.apply()

from megatron.core import parallel_state as ps  # noqa: E402
from megatron.core import tensor_parallel  # noqa: E402
from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: E402
from megatron.core.tensor_parallel import VocabParallelEmbedding  # noqa: E402

from tephra.engine_megatron import checkpoint as ckpt  # noqa: E402
from tephra.engine_megatron import hf_conversion as conv  # noqa: E402
from tephra.engine_megatron import lora, parallel_setup, routing_replay  # noqa: E402
from tephra.engine_megatron.core_attention import choose_kernel  # noqa: E402
from tephra.engine_megatron.distributed_optimizer import DistributedAdamW  # noqa: E402
from tephra.engine_megatron.hf_loading import load_hf  # noqa: E402
from tephra.engine_megatron.micro_batches import (  # noqa: E402
    ModelInputs,
    cp_gather,
    natural_shape,
    prepare,
)
from tephra.engine_megatron.model_builder import (  # noqa: E402
    ModelShape,
    TephraGPT,
    model_shape,
    sparse_layers,
    transformer_config,
)
from tephra.engine_megatron.weight_export import HFStream, gather_hf_weights  # noqa: E402

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_shape(p: Any, s: ModelShape) -> None:
    """The model's shape (`s`) splits over the parallel layout `p` (a ParallelConfig)."""
    if s.vocab_size % p.tensor:
        raise ConfigError(
            f"vocab_size={s.vocab_size} is not divisible by parallel.tensor="
            f"{p.tensor}; choose a tensor-parallel size that divides it"
        )
    if s.num_kv_heads % p.tensor:
        raise ConfigError(
            f"the model's num_key_value_heads={s.num_kv_heads} is not divisible by "
            f"parallel.tensor={p.tensor} (each tensor-parallel rank holds whole "
            f"key/value heads); set parallel.tensor to one of "
            f"{_divisors(s.num_kv_heads)}"
        )
    layers_per = p.pipeline * p.virtual_pipeline
    if s.num_layers % layers_per:
        raise ConfigError(
            f"num_hidden_layers={s.num_layers} is not divisible by "
            f"parallel.pipeline * parallel.virtual_pipeline={layers_per}"
        )
    if s.mla and p.tensor > 1 and not p.sequence_parallel:
        raise ConfigError(
            f"parallel.tensor={p.tensor} without parallel.sequence_parallel for deepseek_v3: "
            "MLA's replicated down projections get their RoPE key's gradient from every "
            "tensor-parallel rank's heads only through sequence parallel's reduce-scatter "
            "(and megatron needs it with MoE anyway); set parallel.sequence_parallel=true"
        )
    if s.mla and p.context > 1:
        raise ConfigError(
            "parallel.context > 1 is not supported by engine-megatron for deepseek_v3 (the "
            "ring attention needs equal query and value head sizes, MLA's differ); set "
            "parallel.context=1"
        )
    if (p.expert > 1 or p.expert_tensor > 1) and not s.num_experts:
        raise ConfigError("parallel.expert/expert_tensor > 1 needs a mixture-of-experts model")
    if s.num_experts and s.num_experts % p.expert:
        raise ConfigError(
            f"num_experts={s.num_experts} is not divisible by parallel.expert={p.expert}"
        )


def declared_shape(model: Any) -> ModelShape | None:
    """The shape of the model a `ModelConfig` names, from its config.json alone; None when
    that is not readable yet (a named model built on first use: the engine checks it then)."""
    data = declared_hf_config(model)
    if "model_type" not in data:
        return None
    try:
        hf_config = AutoConfig.for_model(**data)
    except (ValueError, KeyError, TypeError):
        return None  # an unknown model type: loading it reports that
    return model_shape(hf_config)


def _pop_tensor(batch: TensorDict, key: str) -> torch.Tensor:
    """`batch.pop(key)` of a tensor field (tensordict types fields as tensors or nested)."""
    value = batch.pop(key)
    assert isinstance(value, torch.Tensor)
    return value


class MegatronEngine(Engine):
    """megatron-core backend. Build with `MegatronEngine.build(config)` on every rank.

    Declares `Capability.LORA` (`lora`: peft's adapters on the tensor-parallel linears):
    `reference_mode()`, `export_adapter()` and `export_adapter_weights()`."""

    capabilities = frozenset({Capability.LORA})

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.check_config(config, dist.get_world_size() if dist.is_initialized() else 1)
        parallel_setup.initialize(config.parallel)
        cpu_compat.seed_model_parallel_rng(config.seed)
        adapt = (
            partial(lora.initial_adapters, cfg=config.lora, seed=config.model.init_seed)
            if config.lora.enabled
            else None
        )
        self.hf_config, hf_state, self.tokenizer_path, initial = load_hf(config.model, adapt)
        self.shape = model_shape(self.hf_config)
        self._check_shape(config)
        self.device = (
            torch.device("cpu")
            if cpu_compat.cuda_absent()
            else torch.device("cuda", torch.cuda.current_device())
        )
        self.dtype = _DTYPES[config.precision.compute_dtype(self.device.type)]
        self.tconfig = transformer_config(
            self.hf_config,
            config.parallel,
            self.dtype,
            config.parallel.moe_token_dispatcher,
            config.model.gradient_checkpointing,
        )
        self.attention_kernel = choose_kernel(
            config.model.attn_implementation,
            self.dtype,
            self.device.type == "cuda",
            config.parallel.context,
        )
        if self.shape.mla:
            # MLA's query/key heads are larger than its value heads: the torch kernel (torch
            # SDPA per sequence) takes that; the flash-attn / TE paths here assume equal sizes
            self.attention_kernel = "torch"
        vpp = config.parallel.virtual_pipeline
        with cpu_compat.device_scope():
            self.chunks = [
                TephraGPT(
                    self.tconfig,
                    self.hf_config,
                    config.model.role,
                    vp if vpp > 1 else None,
                    config.temperature,
                    value_head_seed=config.model.init_seed,
                    compute_entropy=config.compute_entropy,
                    attention_kernel=self.attention_kernel,
                )
                for vp in range(vpp)
            ]
        self._load_hf_state(hf_state)
        del hf_state
        self._mark_tensor_parallel()
        self._keep_padding_row()
        self.adapters: lora.Adapters | None = None
        if initial is not None:  # (with LoRA)
            self.adapters = lora.Adapters(config.lora)
            self.adapters.attach(
                self.chunks, initial, self._heads, self.tconfig.sequence_parallel, self.dtype
            )
            self._freeze_base()
        for chunk in self.chunks:  # built on the CPU (use_cpu_initialization); buffers too
            chunk.to(self.device)
        # DDP buffers + AdamW on this data-parallel rank's slice of the float32 masters
        self.optimizer = DistributedAdamW(
            self.chunks, self.tconfig, config.optimizer, config.scheduler
        )
        self._fb_func = get_forward_backward_func()
        self._training = False
        # routing replay: every router answers its top-k from a `Replay` (own choice unless
        # a batch carries `routed_experts`)
        self._replays = routing_replay.attach(self.chunks) if self.shape.num_experts else {}
        self._chunk_of = {id(d): id(c) for d, c in zip(self.optimizer.ddp_chunks, self.chunks)}
        pattern = sparse_layers(self.hf_config) if self.shape.num_experts else []
        self._moe_index = {g: sum(pattern[:g]) for g, sparse in enumerate(pattern) if sparse}

    # ----- construction -------------------------------------------------------------------
    @classmethod
    def build(cls, config: EngineConfig) -> MegatronEngine:
        return cls(config)

    @classmethod
    def check_config(cls, config: EngineConfig, world_size: int = 1) -> None:
        """What engine-megatron refuses: LoRA, offload, fp16, non-fp32 master weights or
        gradient reduction, FSDP shard groups, a transformers attention kernel other than the
        default (megatron-core runs its own attention), parallel sizes that do not divide."""
        cls._check_supported(config)
        super().check_config(config, world_size)
        if config.micro_batch.share_prefix:
            raise ConfigError(
                "micro_batch.share_prefix=true is an engine-fsdp feature; "
                "engine-megatron runs every row whole; set share_prefix=null"
            )
        p = config.parallel
        if config.precision.reduce_dtype != "float32":
            raise ConfigError(
                f"precision.reduce_dtype={config.precision.reduce_dtype!r}: "
                "engine-megatron reduces gradients in float32; set float32"
            )
        if p.fsdp_size != -1:
            raise ConfigError(
                f"parallel.fsdp_size={p.fsdp_size} is an engine-fsdp setting; "
                "engine-megatron shards the optimizer over data-parallel ranks "
                "(distributed optimizer): leave it at -1"
            )
        if config.model.attn_implementation not in ("sdpa", "flash_attention_2"):
            raise ConfigError(
                f"model.attn_implementation={config.model.attn_implementation!r}: "
                "engine-megatron runs its own per-sequence attention: 'sdpa' (the best "
                "installed kernel) or 'flash_attention_2' (flash-attn only)"
            )
        if config.model.attn_implementation == "flash_attention_2":
            if importlib.util.find_spec("flash_attn") is None:
                raise ConfigError(
                    "model.attn_implementation='flash_attention_2' but flash-attn is not "
                    "installed; install flash-attn (CUDA) or set model.attn_implementation=sdpa"
                )
            if p.context > 1:
                raise ConfigError(
                    "model.attn_implementation='flash_attention_2' with parallel.context > 1: "
                    "context parallel runs the torch kernel; set model.attn_implementation=sdpa"
                )
        p.data_parallel_size(world_size)
        expert_world = p.expert * p.expert_tensor * p.pipeline
        if world_size % expert_world:
            raise ConfigError(
                f"world size {world_size} is not divisible by parallel.expert * "
                f"parallel.expert_tensor * parallel.pipeline = {expert_world}"
            )
        if config.moe.replays and config.model.gradient_checkpointing and p.pipeline > 1:
            raise ConfigError(
                "moe.routing_replay='rollout' with model.gradient_checkpointing and "
                "parallel.pipeline > 1: a micro-batch's recomputed forward would replay another "
                "micro-batch's routes; turn gradient checkpointing or pipelining off"
            )
        if p.virtual_pipeline > 1 and p.pipeline == 1:
            raise ConfigError("parallel.virtual_pipeline > 1 needs parallel.pipeline > 1")
        shape = declared_shape(config.model)
        if shape is not None:  # the model's shape against the layout, before any rank starts
            check_shape(p, shape)
            if shape.mla and config.moe.replays:
                raise ConfigError(
                    "moe.routing_replay='rollout' is not supported by engine-megatron for "
                    "deepseek_v3 (replayed gates follow softmax routing, DeepSeek-V3's is "
                    "sigmoid); set moe.routing_replay=off"
                )

    @staticmethod
    def _check_supported(config: EngineConfig) -> None:
        if config.lora.enabled:
            shape = declared_shape(config.model)
            if shape is not None and shape.mla:
                raise ConfigError(
                    "lora.rank > 0 is not supported by engine-megatron for deepseek_v3 (no "
                    "adapters on MLA's latent projections yet); set lora.rank=0 or use "
                    "engine=fsdp"
                )
            lora.check_config(config.lora, None if shape is None else bool(shape.num_experts))
        if config.offload.params or config.offload.optimizer:
            raise ConfigError(
                "offload.params / offload.optimizer are not supported by "
                "engine-megatron; set them to false"
            )
        if config.precision.param_dtype == "float16":
            raise ConfigError(
                "precision.param_dtype='float16' is not supported by "
                "engine-megatron (no loss scaling); use bfloat16 or float32"
            )
        if config.precision.master_dtype != "float32":
            raise ConfigError(
                f"precision.master_dtype={config.precision.master_dtype!r}: "
                "engine-megatron keeps float32 master weights; set float32"
            )
        if model_has_vision(config.model):
            raise ConfigError(
                "model: a vision-language model (its config has vision_config, e.g. "
                "Qwen2-VL) is not supported by engine-megatron; use engine=fsdp "
                "for images in prompts"
            )
        if config.device == "cuda" and cpu_compat.cuda_absent():
            raise ConfigError("device='cuda' but CUDA is not available; use device=auto")
        if config.device == "cpu" and not cpu_compat.cuda_absent():
            raise ConfigError(
                "device='cpu' but CUDA is visible, and engine-megatron runs on the "
                "GPU whenever one is visible (megatron-core has no CPU switch); give "
                "the ranks GPUs (resources.gpus_per_rank=1) or hide them "
                "(CUDA_VISIBLE_DEVICES=)"
            )

    def _check_shape(self, config: EngineConfig) -> None:
        check_shape(config.parallel, self.shape)

    # ----- names and groups ---------------------------------------------------------------
    def _layer_offsets(self, chunk: TephraGPT) -> dict[int, int]:
        return {i: layer.layer_number - 1 for i, layer in enumerate(chunk.gpt.decoder.layers)}

    def _shard_coords(self, m: conv.Match) -> tuple[int, int, object]:
        """(rank, size, group) of the tensor-parallel group that splits this weight."""
        if m.is_expert:
            return (
                ps.get_expert_tensor_parallel_rank(),
                ps.get_expert_tensor_parallel_world_size(),
                ps.get_expert_tensor_parallel_group(),
            )
        return (
            ps.get_tensor_model_parallel_rank(),
            ps.get_tensor_model_parallel_world_size(),
            ps.get_tensor_model_parallel_group(),
        )

    def _global_expert(self, m: conv.Match) -> int | None:
        if m.local_expert is None:
            return None
        local_count = self.shape.num_experts // self.config.parallel.expert
        return ps.get_expert_model_parallel_rank() * local_count + m.local_expert

    @property
    def _heads(self) -> conv.Heads:
        return conv.Heads(self.shape.num_heads, self.shape.num_kv_heads, self.shape.head_dim)

    def _load_hf_state(self, hf_state: dict[str, torch.Tensor]) -> None:
        if self.shape.tie_word_embeddings and "lm_head.weight" not in hf_state:
            hf_state["lm_head.weight"] = hf_state["model.embed_tokens.weight"]
        with torch.no_grad():
            for chunk in self.chunks:
                offsets = self._layer_offsets(chunk)
                for name, param in chunk.hf_weights():
                    m = conv.match(name, offsets, self.shape.model_type)
                    if name == "value_head.weight" and "score.weight" not in hf_state:
                        continue  # a fresh critic head (seeded by model.init_seed)
                    rank, size, _ = self._shard_coords(m)
                    value = conv.to_megatron(
                        m, hf_state, rank, size, self._heads, self._global_expert(m)
                    )
                    if value.shape != param.shape:
                        raise ConfigError(
                            f"weight {m.hf_names} gives shape {list(value.shape)} for megatron "
                            f"{name} {list(param.shape)}: the HF folder does not match its config"
                        )
                    param.copy_(value.to(param.dtype))

    def _mark_tensor_parallel(self) -> None:
        """Tag every split weight `tensor_model_parallel`, as megatron's layers do only when
        they initialise weights themselves (`perform_initialization=False` skips it): the
        optimizer's grad norm counts an untagged weight on TP rank 0 alone, as a replica."""
        for chunk in self.chunks:
            offsets = self._layer_offsets(chunk)
            for name, param in chunk.named_parameters():
                kind = conv.match(name, offsets, self.shape.model_type).kind
                if kind.startswith("expert"):
                    # megatron tags experts as such (`allreduce=False`: gradients summed over
                    # the expert data-parallel group) only at expert_parallel > 1 and
                    # otherwise takes them for dense weights, reduced over the dense
                    # data-parallel group. At expert_tensor < tensor that group leaves out
                    # the tensor-parallel ranks, which hold replicas of the experts and
                    # route their own tokens: each replica stepped on its own share of the
                    # gradient. The expert data-parallel group is right in every layout.
                    param.allreduce = False  # type: ignore[attr-defined]
                if kind != "rep" and not hasattr(param, "tensor_model_parallel"):
                    dim = 1 if kind in ("row", "expert_down") else 0
                    tensor_parallel.set_tensor_model_parallel_attributes(param, True, dim, 1)

    def _freeze_base(self) -> None:
        """With LoRA only the adapters train, and a critic's value head (new, with no base
        weights to start from); megatron's DDP and optimizer then hold only those."""
        for chunk in self.chunks:
            for name, param in chunk.named_parameters():
                train = lora.is_adapter(name) or (
                    self.config.model.role == "value" and name.startswith("value_head.")
                )
                param.requires_grad_(train)

    def exported_value(self, param: torch.Tensor) -> torch.Tensor:
        """`param` as exported: with an adapter on its linear, merged in this rank's layout,
        W + (alpha / rank) * B @ A computed in float32 (as engine-fsdp merges)."""
        adapter = self.adapters.by_weight.get(id(param)) if self.adapters is not None else None
        if adapter is not None:
            return (param.float() + adapter.weight_delta(param)).to(param.dtype)
        return param.detach()

    def _keep_padding_row(self) -> None:
        """transformers builds the input embedding with `padding_idx=pad_token_id`: the lookup
        of that id passes no gradient to the table, even where a policy sampled the id as a
        real token (and the row is often zero, so its gradient through the norm would be
        huge). Block the same gradient here, at the lookup's output, so that a tied output
        layer still trains the row as transformers' does."""
        pad = getattr(self.hf_config, "pad_token_id", None)
        if pad is None:
            return

        def block_pad_lookups(
            module: VocabParallelEmbedding, args: tuple[torch.Tensor, ...], output: torch.Tensor
        ) -> torch.Tensor:
            is_pad = args[0] == pad  # [b, s]
            if module.reduce_scatter_embeddings:  # sequence parallel: output is [s / tp, b, h]
                is_pad = is_pad.transpose(0, 1)
                n = is_pad.shape[0] // module.tp_group.size()
                is_pad = is_pad[module.tp_group.rank() * n : (module.tp_group.rank() + 1) * n]
            return torch.where(is_pad[..., None], output.detach(), output)

        for chunk in self.chunks:
            emb = getattr(chunk.gpt, "embedding", None)
            if emb is not None:  # the first pipeline stage
                emb.word_embeddings.register_forward_hook(block_pad_lookups)

    # ----- lifecycle ----------------------------------------------------------------------
    @contextlib.contextmanager
    def reference_mode(self) -> Iterator[None]:
        """Forward passes inside run the base model (adapters off): the reference policy's
        log-probs, with no second model in memory. Needs `lora.rank > 0`."""
        if self.adapters is None:
            raise ConfigError(
                "reference_mode() needs LoRA (lora.rank > 0): without adapters the base "
                "model is being trained, so build a separate engine for the reference"
            )
        self.adapters.set_enabled(False)
        try:
            yield
        finally:
            self.adapters.set_enabled(True)

    @contextlib.contextmanager
    def train_mode(self) -> Iterator[None]:
        for c in self.chunks:
            c.train()
        self._training = True
        try:
            yield
        finally:
            self._training = False

    @contextlib.contextmanager
    def eval_mode(self) -> Iterator[None]:
        for c in self.chunks:
            c.eval()
        yield

    # ----- compute ------------------------------------------------------------------------
    def forward(self, batch: TensorDict, *, extra_outputs: Collection[str] = ()) -> TensorDict:
        extra = check_extra_outputs(extra_outputs, self.config.model.role)
        B.validate_batch(batch)
        asked = "sum_pi_squared" in extra
        for c in self.chunks:
            c.sum_pi_squared = asked
        try:
            with torch.no_grad():
                outputs, _ = self._run(
                    batch,
                    loss_fn=None,
                    budget=self.config.micro_batch.forward_budget,
                    field_name="forward_max_tokens_per_microbatch",
                )
        finally:
            for c in self.chunks:
                c.sum_pi_squared = False
        assert outputs is not None  # `_run` returns the outputs when loss_fn is None
        return outputs

    def forward_backward(self, batch: TensorDict, loss_fn: LossFn) -> dict[str, float]:
        B.validate_batch(batch)
        _, metrics = self._run(
            batch,
            loss_fn=loss_fn,
            budget=self.config.micro_batch.max_tokens_per_microbatch,
            field_name="max_tokens_per_microbatch",
        )
        return metrics

    def _check_replay(self, batch: TensorDict) -> None:
        """A batch with `routed_experts`: an MoE model, routes of its shape, and no layout in
        which a recomputed forward would read another micro-batch's routes."""
        if not self.shape.num_experts:
            raise BatchError(
                "batch['routed_experts'] is for mixture-of-experts models; this model has "
                "no experts: leave the field out"
            )
        if self.tconfig.recompute_granularity and ps.get_pipeline_model_parallel_world_size() > 1:
            raise BatchError(
                "batch['routed_experts'] with model.gradient_checkpointing and "
                "parallel.pipeline > 1: the recomputed forward of a micro-batch would replay "
                "another's routes; turn one of them off"
            )
        routing_replay.check_routes(
            batch,
            len(self._moe_index),
            self.tconfig.moe_router_topk,
            self.shape.num_experts,
        )

    def _output_keys(self) -> list[str | None]:
        """The name of each slot of the model's last dimension: values, or log-probs,
        entropy (None: a slot of zeros without compute_entropy) and sum pi^2 when forward
        was asked for it."""
        if self.config.model.role == "value":
            return ["values"]
        keys = ["log_probs", "entropy" if self.config.compute_entropy else None]
        if self.chunks[-1].sum_pi_squared:
            keys.append("sum_pi_squared")
        return keys

    def _run(  # noqa: C901, PLR0915 (older than the limit; to split)
        self, batch: TensorDict, loss_fn: LossFn | None, budget: int, field_name: str
    ) -> tuple[TensorDict | None, dict[str, float]]:
        """Run the pipeline schedule over this rank's batch. Returns (`[B, T]` outputs when
        `loss_fn` is None, metrics when it is given)."""
        # packed by default (no padding through the MLPs): attention runs per sequence from
        # the attention plan on every kernel, so packing costs no dense mask anywhere
        packed = self.config.micro_batch.packing(varlen_attention=True)
        n_rows, seq_len = batch[B.INPUT_IDS].shape
        window = self.shape.sliding_window
        # the torch kernel applies the window; the ring (context parallel), flash-attn and
        # TransformerEngine paths attend to every earlier token, exact only up to it
        windowless = self.attention_kernel != "torch" or self.config.parallel.context > 1
        if windowless and window is not None and int(B.sequence_lengths(batch).max()) > window:
            raise BatchError(
                f"a sequence of {int(B.sequence_lengths(batch).max())} tokens is longer than "
                f"the model's sliding_window={window}, which the {self.attention_kernel!r} "
                f"attention kernel with parallel.context={self.config.parallel.context} does "
                "not apply: shorten the sequences, use the torch kernel without context "
                "parallel, or engine=fsdp"
            )
        # the rollout's routes replay with moe.routing_replay=rollout; otherwise they are
        # ignored (e.g. a critic handed the policy's batch)
        replay = self.config.moe.replays and B.ROUTED_EXPERTS in batch.keys()
        if replay:
            self._check_replay(batch)
        elif B.ROUTED_EXPERTS in batch.keys():
            batch = batch.exclude(B.ROUTED_EXPERTS)
        indexed = batch.clone(False)
        indexed["_row"] = torch.arange(n_rows)
        indexed["_col"] = torch.arange(seq_len).expand(n_rows, seq_len)
        mbs = B.split_by_token_budget(indexed, budget, packed, field_name=field_name)
        rows = [_pop_tensor(mb, "_row") for mb in mbs]
        cols = [_pop_tensor(mb, "_col")[0] for mb in mbs]
        B.set_global_normalisers(mbs, ps.get_data_parallel_group())
        real = len(mbs)
        # MoE dispatch communicates across data-parallel ranks inside every micro-batch:
        # every rank must run the same number of them (extra ones carry no trained token
        # and their outputs are dropped).
        count = torch.tensor([real])
        dist.all_reduce(
            count,
            op=dist.ReduceOp.MAX,
            group=ps.get_data_parallel_group(with_context_parallel=True),
        )
        target = int(count)
        if len(self.chunks) > 1:
            # the interleaved schedule needs a multiple of the number of stages
            pp = ps.get_pipeline_model_parallel_world_size()
            target = -(-target // pp) * pp
        while len(mbs) < target:
            dummy = mbs[-1][:1].clone()
            dummy[B.RESPONSE_MASK] = torch.zeros_like(dummy[B.RESPONSE_MASK])
            mbs.append(dummy)

        slots = self._output_keys()
        keys = [k for k in slots if k is not None]
        full = {k: torch.zeros(n_rows, seq_len) for k in keys}
        loss_sum = torch.zeros(())
        metric_sums: dict[str, float] = {}
        shares: set[str] = set()
        sp = self.config.parallel.tensor if self.tconfig.sequence_parallel else 1
        shape = None
        allgather_moe = bool(self.shape.num_experts) and (
            self.tconfig.moe_token_dispatcher_type == "allgather"
            or self.config.parallel.expert_tensor > 1
        )
        if ps.get_pipeline_model_parallel_world_size() > 1 or allgather_moe:
            # pipeline stages exchange fixed shapes; the allgather dispatcher (and expert
            # tensor parallelism) gather equal token counts across data-parallel ranks
            shapes = [natural_shape(mb, packed, sp) for mb in mbs]
            dims = torch.tensor([max(r for r, _ in shapes), max(s for _, s in shapes)])
            if allgather_moe:
                dist.all_reduce(
                    dims,
                    op=dist.ReduceOp.MAX,
                    group=ps.get_data_parallel_group(with_context_parallel=True),
                )
            shape = (int(dims[0]), int(dims[1]))
        prepared = [prepare(mb, packed, sp, shape) for mb in mbs]
        targets = [
            routing_replay.replay_targets(x, mb[B.ROUTED_EXPERTS], sp) if replay else None
            for x, mb in zip(prepared, mbs)
        ]
        inputs = [x.to(self.device) for x in prepared]
        del prepared

        def forward_step(
            data_iterator: Iterator[int], model: torch.nn.Module
        ) -> tuple[torch.Tensor, Callable[[torch.Tensor], tuple[Any, ...]]]:
            idx = next(data_iterator)
            x: ModelInputs = inputs[idx]
            for layer, r in self._replays.get(self._chunk_of[id(model)], []):
                t = targets[idx]
                r.target = None if t is None else t[:, self._moe_index[layer]]
            out = model(x.input_ids, x.position_ids, x.attention_plan, x.labels)

            def loss_func(
                out_tensor: torch.Tensor,
            ) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
                nonlocal loss_sum
                per_pos = cp_gather(out_tensor)  # [b_rows, S, k] in natural order
                token_out = x.to_tokens(per_pos)  # [b, t, k] aligned to tokens, 0 off response
                mb = mbs[idx].to(self.device)
                outputs = TensorDict(
                    {k: token_out[..., j] for j, k in enumerate(slots) if k is not None},
                    batch_size=[mb.batch_size[0]],
                )
                if idx >= real:  # padding micro-batch: keep the graph, contribute nothing
                    return out_tensor.sum() * 0.0, torch.tensor(1), {}
                if loss_fn is None:
                    for k in keys:
                        full[k][rows[idx][:, None], cols[idx][None, :]] = outputs[k].detach().cpu()
                    return out_tensor.sum().detach() * 0.0, torch.tensor(1), {}
                loss, metrics = loss_fn(outputs, mb)
                loss_sum = loss_sum + loss.detach().float().cpu()
                shares.update(shares_of(metrics))
                for k, v in metrics.items():
                    metric_sums[k] = metric_sums.get(k, 0.0) + float(v)
                return loss, torch.tensor(1), {}

            return out, loss_func

        vpp = len(self.chunks)
        iters = [iter(range(len(inputs))) for _ in range(vpp)]
        with cpu_compat.device_scope():
            model = self.optimizer.ddp_chunks
            self._fb_func(
                forward_step_func=forward_step,
                data_iterator=iters if vpp > 1 else iters[0],
                model=model if vpp > 1 else model[0],
                num_microbatches=len(inputs),
                seq_length=max(x.seq_length for x in inputs),
                micro_batch_size=max(x.input_ids.shape[0] for x in inputs),
                forward_only=loss_fn is None,
            )
        last_pp_rank = ps.get_pipeline_model_parallel_last_rank()
        pp_group = ps.get_pipeline_model_parallel_group()
        if loss_fn is None:
            stacked = torch.stack([full[k] for k in keys])
            if ps.get_pipeline_model_parallel_world_size() > 1:
                dist.broadcast(stacked, src=last_pp_rank, group=pp_group)
            return TensorDict({k: stacked[j] for j, k in enumerate(keys)}, batch_size=[n_rows]), {}
        # (loss sum, metric sums, the names of the shares among them)
        result = [(float(loss_sum), metric_sums, shares)]
        if ps.get_pipeline_model_parallel_world_size() > 1:
            # only the last stage ran the loss (and knows the metric names)
            dist.broadcast_object_list(result, src=last_pp_rank, group=pp_group)
        total, sums, shares = result[0]
        names = sorted(sums)
        vec = torch.tensor([total, float(real)] + [sums[n] for n in names], dtype=torch.float64)
        dist.all_reduce(vec, group=ps.get_data_parallel_group())
        totals = {n: float(vec[2 + j]) for j, n in enumerate(names)}
        return None, {"loss": float(vec[0]), **reduce_metrics(totals, shares, float(vec[1]))}

    # ----- optimisation -------------------------------------------------------------------
    @property
    def master(self) -> list[torch.Tensor]:
        """This rank's float32 master-weight slices (1-D views into flat buffers)."""
        return self.optimizer.master_params()

    def optimizer_step(self) -> float:
        """Reduce-scatter the gradients, clip by the global norm, update this rank's slice,
        all-gather the parameters; a non-finite norm skips the update. Returns the norm."""
        return self.optimizer.step()

    def lr_scheduler_step(self) -> float:
        return self.optimizer.lr_step()

    # ----- weights ------------------------------------------------------------------------
    def hf_weights(self, untie_word_embeddings: bool = False) -> dict[str, torch.Tensor]:
        """Every full HF-named tensor on every rank (collective)."""
        return gather_hf_weights(self, untie_word_embeddings)

    def export_weights(
        self, bucket_bytes: int = 512 << 20, untie_word_embeddings: bool = False
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Streamed (`weight_export.HFStream`): no rank holds more than its shards and about
        one bucket; every rank iterates and receives every tensor."""
        bucket: list[tuple[str, torch.Tensor]] = []
        size = 0
        for name, tensor in HFStream(self, None, untie_word_embeddings):
            nbytes = tensor.numel() * tensor.element_size()
            if bucket and size + nbytes > bucket_bytes:
                yield bucket
                bucket, size = [], 0
            bucket.append((name, tensor))
            size += nbytes
        if bucket:
            yield bucket

    def export_hf(self, path: str | Path) -> None:
        """The full model in HF format; with LoRA the adapters are merged into it."""
        ckpt.export_hf(self, Path(path))

    def export_adapter(self, path: str | Path) -> None:
        """The LoRA adapters alone, as peft writes them (`PeftModel.from_pretrained` loads
        the folder over the base model). Collective; rank 0 writes."""
        if self.adapters is None:
            raise ConfigError(
                "export_adapter() needs LoRA (lora.rank > 0): without adapters there is "
                "none; export the model with export_hf"
            )
        self.adapters.write(Path(path), self.config.model.path)

    def export_adapter_weights(self) -> LoraAdapter:
        """The LoRA adapters alone, on every rank (gathered over pipeline stages and
        tensor-parallel shards). Collective."""
        if self.adapters is None:
            raise ConfigError(
                "export_adapter_weights() needs LoRA (lora.rank > 0): without adapters there "
                "is none; sync the full weights with export_weights"
            )
        return LoraAdapter(self.config.lora.rank, self.config.lora.alpha, self.adapters.gather())

    def load_adapter_weights(self, adapter: LoraAdapter) -> None:
        """Not implemented by engine=megatron (its distributed optimizer keeps fp32 main
        copies of the tensor-parallel adapter shards, which a weights-only restore would have
        to rebuild): refused."""
        raise ConfigError(
            "load_adapter_weights() is not implemented by engine=megatron (part of "
            "Capability.LORA that this engine lacks); restore an adapter with its optimizer "
            "state through save_checkpoint / load_checkpoint, or use engine=fsdp"
        )

    def save_checkpoint(self, path: str | Path) -> None:
        ckpt.save(self, Path(path))

    def load_checkpoint(self, path: str | Path) -> None:
        ckpt.load(self, Path(path))

    # ----- topology -----------------------------------------------------------------------
    @property
    def dp_rank(self) -> int:
        return ps.get_data_parallel_rank()

    @property
    def dp_size(self) -> int:
        return ps.get_data_parallel_world_size()

    @property
    def is_dp_output_rank(self) -> bool:
        """Every rank of a data-parallel replica returns the same outputs (the last pipeline
        stage broadcasts them); its first tensor/pipeline/context rank hands them back."""
        return (
            ps.get_tensor_model_parallel_rank() == 0
            and ps.get_pipeline_model_parallel_rank() == 0
            and ps.get_context_parallel_rank() == 0
        )
