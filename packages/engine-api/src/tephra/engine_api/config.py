"""Typed, validated configuration of a training engine.

Every field says its unit. Validation happens on construction (`__post_init__`) and the
message names the field, the value it got and what it accepts. Backends read these configs;
fields a backend does not support are refused by that backend, not silently ignored.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from tephra.core.config import from_dict
from tephra.engine_api.errors import ConfigError
from tephra.engine_api.fastest_dtype import AUTO, resolve_dtype
from tephra.engine_api.lr_schedules import SCHEDULES

DTYPES = ("float32", "bfloat16", "float16")


def _choice(section: str, name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(
            f"{section}.{name}={value!r} is not allowed; choose one of {list(allowed)}"
        )


def _positive(section: str, name: str, value: float, *, zero_ok: bool = False) -> None:
    # NaN compares false with everything, so `value < 0` alone lets it (and inf) through
    if not math.isfinite(value) or value < 0 or (value == 0 and not zero_ok):
        bound = ">= 0" if zero_ok else "> 0"
        what = "" if math.isfinite(value) else "a finite number "
        raise ConfigError(f"{section}.{name}={value!r} must be {what}{bound}")


@dataclass
class ModelConfig:
    """Which model to train and how to build it."""

    path: str | None = None
    """Local Hugging Face folder (config.json + weights). Either this or `hf_config`."""
    hf_config: dict[str, Any] | None = None
    """A transformers config as a dict (must hold `model_type`), to build a randomly
    initialised model without a folder: tests and toy runs."""
    tokenizer_path: str | None = None
    """Folder of the tokenizer; defaults to `path`. Engines only need it for `export_hf`."""
    role: str = "policy"
    """`policy`: causal LM giving log-probs and entropy; `value`: critic giving a scalar
    value per token from a linear head on the last hidden state."""
    attn_implementation: str = "sdpa"
    """transformers attention kernel: `sdpa` (default, runs everywhere), `eager`, or
    `flash_attention_2` (CUDA only)."""
    gradient_checkpointing: bool = False
    """Recompute activations in backward to save memory (about 30% slower)."""
    trust_remote_code: bool = False
    """Allow model code shipped inside the folder (only for folders you trust)."""
    init_seed: int = 0
    """Seed of the random initialisation when built from `hf_config` (and of the value head)."""

    def __post_init__(self) -> None:
        if (self.path is None) == (self.hf_config is None):
            raise ConfigError(
                "model: set exactly one of model.path (a local Hugging Face folder) or "
                f"model.hf_config (a config dict); got path={self.path!r}, "
                f"hf_config={'set' if self.hf_config is not None else None}"
            )
        if self.hf_config is not None and "model_type" not in self.hf_config:
            raise ConfigError("model.hf_config must hold 'model_type' (e.g. 'qwen2' or 'llama')")
        _choice("model", "role", self.role, ("policy", "value"))
        _choice(
            "model",
            "attn_implementation",
            self.attn_implementation,
            ("sdpa", "eager", "flash_attention_2", "flex_attention"),
        )


@dataclass
class OptimizerConfig:
    """AdamW and gradient clipping."""

    name: str = "adamw"
    """Optimizer; `adamw` is the one every backend supports."""
    lr: float = 1e-6
    """Peak learning rate (after warmup)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam betas."""
    eps: float = 1e-8
    """Adam epsilon."""
    weight_decay: float = 0.01
    """Decoupled weight decay."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping."""

    def __post_init__(self) -> None:
        _choice("optimizer", "name", self.name, ("adamw",))
        _positive("optimizer", "lr", self.lr)
        _positive("optimizer", "weight_decay", self.weight_decay, zero_ok=True)
        _positive("optimizer", "grad_clip", self.grad_clip, zero_ok=True)
        betas = tuple(self.betas)  # YAML gives lists
        if len(betas) != 2 or not all(0 <= b < 1 for b in betas):
            raise ConfigError(f"optimizer.betas={self.betas!r} must be two numbers in [0, 1)")
        self.betas = (betas[0], betas[1])


@dataclass
class SchedulerConfig:
    """Learning-rate schedule, stepped once per optimizer step."""

    name: str = "constant"
    """`constant`, `cosine` (to `min_lr_ratio` at `total_steps`), or `wsd`
    (warmup-stable-decay: constant, then linear decay over the last `decay_ratio`)."""
    warmup_steps: int = 0
    """Linear warmup over this many optimizer steps W: step s < W runs at (s + 1) / W of the
    peak, so the first step already moves and step W - 1 runs at the peak (every engine)."""
    total_steps: int = 0
    """Length of the schedule in optimizer steps; required by `cosine` and `wsd`."""
    min_lr_ratio: float = 0.0
    """Final lr as a fraction of the peak (`cosine`, `wsd`)."""
    decay_ratio: float = 0.1
    """`wsd` only: fraction of `total_steps` spent decaying."""

    def __post_init__(self) -> None:
        _choice("scheduler", "name", self.name, tuple(SCHEDULES.names()))
        _positive("scheduler", "warmup_steps", self.warmup_steps, zero_ok=True)
        if self.name != "constant" and self.total_steps <= self.warmup_steps:
            raise ConfigError(
                f"scheduler.total_steps={self.total_steps} must be > scheduler.warmup_steps="
                f"{self.warmup_steps} for scheduler.name={self.name!r}"
            )
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"scheduler.min_lr_ratio={self.min_lr_ratio} must be in [0, 1]")
        if not 0 < self.decay_ratio <= 1:
            raise ConfigError(f"scheduler.decay_ratio={self.decay_ratio} must be in (0, 1]")


@dataclass
class MicroBatchConfig:
    """How a rank's share of a batch is cut into micro-batches."""

    max_tokens_per_microbatch: int = 8192
    """Token budget of one micro-batch on one rank. Packed: real tokens; padded:
    sequences x longest sequence. A single sequence longer than this is an error."""
    use_packing: bool | None = None
    """Concatenate sequences without padding (position ids restart per sequence). None: the
    engine packs where attention runs packed sequences without a dense mask (flash-attention
    or flex attention; Megatron's Transformer Engine on GPU) and pads elsewhere: on CPU a
    packed micro-batch of 32 rows costs ~32x the attention of padded rows."""
    forward_max_tokens_per_microbatch: int | None = None
    """Budget for `forward` (no backward, so it can be larger); defaults to the above."""
    share_prefix: bool | None = None
    """Padded rows that begin with the same unscored tokens (a prompt's n samples) run them
    once, each row's remaining tokens attending to them through a segment mask: the same
    outputs and gradients, about half the tokens for GRPO-shaped batches. None: on where the
    engine supports it (engine-fsdp on padded rows without sequence parallelism); True:
    refused where it does not; False: off."""

    def __post_init__(self) -> None:
        _positive("micro_batch", "max_tokens_per_microbatch", self.max_tokens_per_microbatch)
        if self.forward_max_tokens_per_microbatch is not None:
            _positive(
                "micro_batch",
                "forward_max_tokens_per_microbatch",
                self.forward_max_tokens_per_microbatch,
            )

    @property
    def forward_budget(self) -> int:
        return self.forward_max_tokens_per_microbatch or self.max_tokens_per_microbatch

    def packing(self, varlen_attention: bool) -> bool:
        """Whether to pack: `use_packing` when set, else whether the engine's attention
        handles packed sequences natively (`varlen_attention`)."""
        return varlen_attention if self.use_packing is None else self.use_packing


@dataclass
class PrecisionConfig:
    """Numeric types: parameters for compute, gradient reduction, master weights."""

    param_dtype: str = "float32"
    """dtype of the weights used in forward/backward (`bfloat16` for mixed precision;
    `auto`: bfloat16 where the device computes it faster than float32, timed once per machine,
    see `tephra.engine_api.fastest_dtype`)."""
    reduce_dtype: str = "float32"
    """dtype of the gradient reduction across data-parallel ranks."""
    master_dtype: str = "float32"
    """dtype of the weights the optimizer updates (keep float32)."""

    def __post_init__(self) -> None:
        _choice("precision", "param_dtype", self.param_dtype, (*DTYPES, AUTO))
        for name in ("reduce_dtype", "master_dtype"):
            _choice("precision", name, getattr(self, name), DTYPES)

    def compute_dtype(self, device_type: str) -> str:
        """`param_dtype`, with `auto` resolved for the device (`cpu`, `cuda`). Collective
        when `auto` under an initialised process group (engines build on every rank): rank
        0's measurement is every rank's choice, so all ranks compute in one dtype."""
        choice = resolve_dtype(self.param_dtype, device_type)
        if self.param_dtype == AUTO:
            if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
                box = [choice]
                dist.broadcast_object_list(box, src=0)
                choice = box[0]
        return choice


@dataclass
class OffloadConfig:
    """Keep state in CPU memory between uses (for GPUs shared with the rollout engine)."""

    params: bool = False
    """Parameters live on CPU and are moved to the device for compute."""
    optimizer: bool = False
    """Optimizer state lives on CPU."""


LORA_VISION = ("frozen", "adapt")
"""`LoraConfig.vision` choices."""


@dataclass
class LoraConfig:
    """Low-rank adapters (through peft). `rank=0` trains the full model."""

    rank: int = 0
    """Adapter rank; 0 disables LoRA."""
    alpha: float = 16.0
    """Scaling numerator: the update is (alpha / rank) * B @ A."""
    dropout: float = 0.0
    """Dropout on the adapter input."""
    target_modules: list[str] | str = "all-linear"
    """Module names to adapt, or `all-linear`."""
    vision: str = "frozen"
    """A vision-language model's vision tower: `frozen` (adapters in the language model only,
    the tower's weights fixed) or `adapt` (the tower's linear layers get adapters too)."""

    def __post_init__(self) -> None:
        _positive("lora", "rank", self.rank, zero_ok=True)
        if self.vision not in LORA_VISION:
            raise ConfigError(
                f"lora.vision={self.vision!r}: use one of {list(LORA_VISION)} (frozen keeps "
                "the vision tower fixed, adapt puts adapters in it too)"
            )
        if not 0 <= self.dropout < 1:
            raise ConfigError(f"lora.dropout={self.dropout} must be in [0, 1)")

    @property
    def enabled(self) -> bool:
        return self.rank > 0


@dataclass
class ParallelConfig:
    """Parallel sizes. Data parallel is what remains: world_size / (tp * pp * cp)."""

    tensor: int = 1
    """Tensor-parallel size (Megatron)."""
    pipeline: int = 1
    """Pipeline-parallel size (Megatron)."""
    virtual_pipeline: int = 1
    """Model chunks per pipeline rank (interleaved 1F1B when > 1)."""
    context: int = 1
    """Context-parallel size: the sequence split across ranks."""
    expert: int = 1
    """Expert-parallel size for mixture-of-experts layers."""
    expert_tensor: int = 1
    """Tensor-parallel size inside each expert."""
    sequence_parallel: bool = False
    """Shard activations along the sequence in tensor-parallel regions (needs tensor > 1)."""
    fsdp_size: int = -1
    """FSDP shard group size; -1 shards over all data-parallel ranks."""
    moe_token_dispatcher: str = "alltoall"
    """How tokens reach their experts under expert parallelism: `alltoall` (default) or
    `allgather` (Megatron; backends without expert parallelism accept only the default)."""

    def __post_init__(self) -> None:
        for name in (
            "tensor",
            "pipeline",
            "virtual_pipeline",
            "context",
            "expert",
            "expert_tensor",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"parallel.{name}={getattr(self, name)} must be >= 1")
        _choice(
            "parallel", "moe_token_dispatcher", self.moe_token_dispatcher, ("alltoall", "allgather")
        )
        if self.sequence_parallel and self.tensor == 1:
            raise ConfigError("parallel.sequence_parallel=True needs parallel.tensor > 1")

    def model_parallel_size(self) -> int:
        return self.tensor * self.pipeline * self.context

    def data_parallel_size(self, world_size: int) -> int:
        mp = self.model_parallel_size()
        if world_size % mp:
            raise ConfigError(
                f"world size {world_size} is not divisible by parallel.tensor * parallel.pipeline"
                f" * parallel.context = {mp}"
            )
        return world_size // mp


@dataclass
class EngineSections:
    """The sections of an engine's config besides the model: what a trained role of an app
    sets (apps compose this class instead of repeating its fields)."""

    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """Optimizer and gradient clipping."""
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    """Learning-rate schedule."""
    micro_batch: MicroBatchConfig = field(default_factory=MicroBatchConfig)
    """Micro-batching by token budget and packing."""
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    """Mixed precision."""
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    """CPU offload of parameters and optimizer state."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA adapters."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Parallel sizes."""

    def sections(self) -> dict[str, Any]:
        """The sections by name (to build an `EngineConfig` from them)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(EngineSections)}


@dataclass
class EngineConfig(EngineSections):
    """Everything a backend needs to build an engine: the model and the sections."""

    model: ModelConfig = field(kw_only=True)
    """The model to train."""
    temperature: float = 1.0
    """Sampling temperature the log-probs are computed under: logits are divided by it, so
    they match the rollout engine's log-probs of the sampled tokens."""
    compute_entropy: bool = True
    """Also return per-token entropy from `forward` / to the loss."""
    seed: int = 0
    """Seed of everything random in the engine (dropout, data order inside the engine)."""
    device: str = "auto"
    """`auto` (CUDA when available, else CPU), `cuda` or `cpu`."""

    def __post_init__(self) -> None:
        # Accept plain dicts (from YAML / OmegaConf) for every section.
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            sub = _SECTIONS.get(f.name)
            if sub is not None and isinstance(value, dict):
                setattr(self, f.name, from_dict(sub, value, prefix=f.name + "."))
        _positive("engine", "temperature", self.temperature)
        _choice("engine", "device", self.device, ("auto", "cuda", "cpu"))


_SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "optimizer": OptimizerConfig,
    "scheduler": SchedulerConfig,
    "micro_batch": MicroBatchConfig,
    "precision": PrecisionConfig,
    "offload": OffloadConfig,
    "lora": LoraConfig,
    "parallel": ParallelConfig,
}


def apply_overrides(config: Any, overrides: dict[str, Any]) -> Any:
    """Return a copy of a (nested) dataclass config with dotted keys replaced.

    `apply_overrides(cfg, {"micro_batch.use_packing": False})`. Unknown keys raise.
    Validation runs again on every rebuilt section.
    """
    grouped: dict[str, dict[str, Any]] = {}
    direct: dict[str, Any] = {}
    for key, value in overrides.items():
        head, _, rest = key.partition(".")
        if rest:
            grouped.setdefault(head, {})[rest] = value
        else:
            direct[key] = value
    names = {f.name for f in dataclasses.fields(config)}
    for head in list(grouped) + list(direct):
        if head not in names:
            raise ConfigError(f"unknown config key {head!r}; valid keys: {sorted(names)}")
    for head, sub in grouped.items():
        direct[head] = apply_overrides(getattr(config, head), sub)
    return dataclasses.replace(config, **direct)
