"""The trainer's peak GPU memory on one rank, estimated from the model's size and the config, so
that a rollout server colocated on the same GPU is sized to what is left
(`tephra.rollout.colocation`).

Per rank, in bytes, for N parameters sharded over S ranks (S = tensor x pipeline x the FSDP
group: `actor.parallel.fsdp_size`, or every data-parallel rank at -1; other engines shard over
tensor x pipeline only), b the compute dtype's size and m the master dtype's:
- weights: N * m / S (the sharded master weights; 0 with `offload.params`), plus two layers
  gathered whole in the compute dtype (the one computing and the one prefetched): 2 * N / L * b;
- gradients: N * m / S; AdamW's two moments: 2 * N * 4 / S (0 with `offload.optimizer`);
  neither with LoRA (the base is frozen; the adapter's state is under 1% at rank <= 64);
- one micro-batch of T = max_tokens_per_microbatch / context tokens, split over tensor ranks:
  activations T * L * (4H + 3I) * b (attention's q, k, v and output, the MLP's gate, up and
  product, per layer) or, with gradient checkpointing, T * L * H * b (each layer's input) plus
  one layer recomputed, T * (4H + 3I) * b; the output head: with a fused log-prob head
  (engine=fsdp: `tephra.kernels` never holds all [T, V] logits) the fp32 log-probs it keeps
  for backward, at most KEEP_LOGITS_BYTES, two [block, V] fp32 buffers (2 * BLOCK_BYTES) and
  the head weight and its gradient in fp32 (2 * V * H * 4); otherwise T * V * (b + 8) (the
  logits, their fp32 log-softmax and its gradient);
- a colocated reference adds its weights (N * m / S); a colocated critic its weights, gradients
  and moments, and its own micro-batch's activations (no vocabulary logits) where they exceed
  the actor's (the two never train at once).
Recipes' extra engines (a distillation teacher, PRIME's reward model) are not counted: set
`rollout.<backend>.gpu_memory_utilization` yourself with them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tephra.engine_api.config import DTYPES
from tephra.engine_api.multimodal import is_vision_config

GIB = 1024**3
DTYPE_BYTES = {name: torch.finfo(getattr(torch, name)).bits // 8 for name in DTYPES}
ADAM_MOMENT_BYTES = 4
"""AdamW keeps its two moments in float32."""
KEEP_LOGITS_BYTES = 256 * 1024**2
"""Most fp32 log-probs the fused head keeps from forward to backward
(`tephra.kernels.chunked.KEEP_LOGITS_BYTES`)."""
BLOCK_BYTES = 64 * 1024**2
"""One block of the fused head's fp32 logits (`tephra.kernels.triton_kernels.BLOCK_BYTES`; the
CPU path's chunks are half that)."""


@dataclass(frozen=True)
class ModelSize:
    """What the estimate needs of a model."""

    params: int
    layers: int
    hidden: int
    intermediate: int
    """The MLP's inner width (4 x hidden where the config names none)."""
    vocab: int

    @classmethod
    def of_model(cls, path: str) -> ModelSize:
        """The size of the Hugging Face model at `path`, its parameters counted on the meta
        device."""
        # heavy: transformers takes seconds to import; only a colocated GPU server needs this
        from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

        config = AutoConfig.from_pretrained(path)
        auto = AutoModelForImageTextToText if is_vision_config(config) else AutoModelForCausalLM
        with torch.device("meta"):
            model = auto.from_config(config)
        text = config.get_text_config()
        hidden = text.hidden_size
        return cls(
            params=sum(p.numel() for p in model.parameters()),
            layers=text.num_hidden_layers,
            hidden=hidden,
            intermediate=getattr(text, "intermediate_size", None) or 4 * hidden,
            vocab=text.vocab_size,
        )


@dataclass(frozen=True)
class EngineShape:
    """What the estimate reads of one trained role's config (`actor`, `critic`)."""

    compute_dtype: str
    master_dtype: str
    shard: int
    """Ranks the weights, gradients and optimizer state are split over (module docstring)."""
    tensor: int
    context: int
    tokens_per_microbatch: int
    gradient_checkpointing: bool = False
    lora: bool = False
    offload_params: bool = False
    offload_optimizer: bool = False
    fused_head: bool = False
    """The engine computes log-probs block by block, never all logits at once (engine=fsdp)."""


@dataclass(frozen=True)
class TrainerMemory:
    """The parts of one rank's peak, in bytes (module docstring)."""

    weights: int
    gradients: int
    optimizer: int
    activations: int
    logits: int
    reference: int = 0
    critic: int = 0

    @property
    def peak(self) -> int:
        return (
            self.weights
            + self.gradients
            + self.optimizer
            + self.activations
            + self.logits
            + self.reference
            + self.critic
        )

    def describe(self, size: ModelSize, shard: int) -> str:
        """How the peak was found, in GiB, for the printed line."""
        parts = [
            ("weights", self.weights),
            ("grads", self.gradients),
            ("adam", self.optimizer),
            ("activations", self.activations),
            ("logits", self.logits),
            ("reference", self.reference),
            ("critic", self.critic),
        ]
        shown = " + ".join(f"{name} {value / GIB:.2f}" for name, value in parts if value)
        return f"estimated from {size.params / 1e9:.3g}B params sharded 1/{shard}: {shown} GiB"


def _state(size: ModelSize, shape: EngineShape, trains: bool) -> tuple[int, int, int]:
    """(weights, gradients, optimizer) bytes of one engine on one rank."""
    n, s = size.params, shape.shard
    master, compute = DTYPE_BYTES[shape.master_dtype], DTYPE_BYTES[shape.compute_dtype]
    stored = 0 if shape.offload_params else n * master // s
    gathered = 2 * n // size.layers * compute
    if not trains or shape.lora:
        return stored + gathered, 0, 0
    optimizer = 0 if shape.offload_optimizer else 2 * n * ADAM_MOMENT_BYTES // s
    return stored + gathered, n * master // s, optimizer


def _micro_batch(size: ModelSize, shape: EngineShape, logits: bool) -> tuple[int, int]:
    """(activations, logits) bytes of one micro-batch's forward and backward on one rank."""
    tokens = shape.tokens_per_microbatch // shape.context
    b = DTYPE_BYTES[shape.compute_dtype]
    layer = (4 * size.hidden + 3 * size.intermediate) * b
    if shape.gradient_checkpointing:
        acts = tokens * size.layers * size.hidden * b + tokens * layer
    else:
        acts = tokens * size.layers * layer
    if not logits:
        return acts // shape.tensor, 0
    if shape.fused_head:
        kept = min(tokens * size.vocab * 4, KEEP_LOGITS_BYTES)
        head = kept + 2 * BLOCK_BYTES + 2 * size.vocab * size.hidden * 4
        return acts // shape.tensor, head
    return acts // shape.tensor, tokens * size.vocab * (b + 8) // shape.tensor


def trainer_memory(
    size: ModelSize,
    actor: EngineShape,
    reference: bool = False,
    critic: EngineShape | None = None,
) -> TrainerMemory:
    """One rank's peak (module docstring): the actor, and a colocated reference / critic."""
    weights, grads, optimizer = _state(size, actor, trains=True)
    acts, logits = _micro_batch(size, actor, logits=True)
    ref = size.params * DTYPE_BYTES[actor.master_dtype] // actor.shard if reference else 0
    critic_bytes = 0
    if critic is not None:
        critic_state = sum(_state(size, critic, trains=True))
        critic_acts = _micro_batch(size, critic, logits=False)[0]
        # the critic trains after the actor: only its activations beyond the actor's count
        critic_bytes = critic_state + max(0, critic_acts - acts - logits)
    return TrainerMemory(weights, grads, optimizer, acts, logits, ref, critic_bytes)
