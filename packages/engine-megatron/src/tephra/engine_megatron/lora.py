"""LoRA on megatron's tensor-parallel linears: peft's adapters, split like the weights they adapt.

The update of an adapted HF linear is W' = W + (alpha / rank) * B @ A (A: [rank, in], B:
[out, rank]; peft's semantics and initialisation: A drawn by peft from `model.init_seed`, B
zero). Megatron fuses HF linears (q/k/v into `linear_qkv`, gate/up into `linear_fc1`); each HF
module keeps its own A and B, and the adapter of a fused linear adds the deltas of its parts
into the fused output in megatron's layout. Only the adapters train (plus a critic's fresh
value head); with the adapters disabled the model is exactly the base model, the reference
policy without a second copy.

Splitting over tensor parallelism (tp ranks; `sp`: sequence parallel):
- column-parallel (`linear_qkv`, `linear_fc1`): A whole on every rank, B split by output rows
  like the weight. y = A x is the same on every rank; its gradient is summed over the TP
  group (`copy_to_tensor_model_parallel_region`), so A's gradient is whole on every rank.
  With sp each rank has a sequence chunk of x: A x is gathered along the sequence and A's
  partial gradient is summed over TP by megatron with the norms' (`sequence_parallel`).
- row-parallel (`linear_proj`, `linear_fc2`): A split by input columns like the weight, B
  whole. A x is a partial sum, reduced over TP (or reduce-scattered along the sequence with
  sp; then B's gradient is partial and summed like a norm's).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel
from safetensors.torch import save_file
from torch import nn

from tephra.engine_api.config import LoraConfig
from tephra.engine_api.errors import ConfigError

if TYPE_CHECKING:
    from tephra.engine_megatron.model_builder import TephraGPT

ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
SUPPORTED_TARGETS = ATTENTION_TARGETS + MLP_TARGETS

# HF module (under model.layers.{i}.) -> (megatron linear under the layer, part, parallel kind)
_HF_TO_MEGATRON = {
    "self_attn.q_proj": ("self_attention.linear_qkv", "q", "column"),
    "self_attn.k_proj": ("self_attention.linear_qkv", "k", "column"),
    "self_attn.v_proj": ("self_attention.linear_qkv", "v", "column"),
    "self_attn.o_proj": ("self_attention.linear_proj", "o", "row"),
    "mlp.gate_proj": ("mlp.linear_fc1", "gate", "column"),
    "mlp.up_proj": ("mlp.linear_fc1", "up", "column"),
    "mlp.down_proj": ("mlp.linear_fc2", "down", "row"),
}
_PARTS = {
    "self_attention.linear_qkv": ("q", "k", "v"),
    "self_attention.linear_proj": ("o",),
    "mlp.linear_fc1": ("gate", "up"),
    "mlp.linear_fc2": ("down",),
}
_HF_MODULE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_PEFT_PARAM = re.compile(r"^base_model\.model\.(.+)\.lora_(A|B)\.default\.weight$")


def is_adapter(name: str) -> bool:
    """Whether megatron parameter `name` belongs to an adapter (`....lora.A.q`)."""
    return ".lora." in name


def check_config(cfg: LoraConfig, is_moe: bool | None) -> None:
    """What engine-megatron's LoRA refuses, before any rank starts (`is_moe`: None when the
    model's shape is not readable yet)."""
    if cfg.dropout:
        raise ConfigError(
            f"lora.dropout={cfg.dropout}: engine-megatron's adapters run without dropout "
            "(a dropout mask would have to agree across tensor-parallel ranks); set "
            "lora.dropout=0 or use engine=fsdp"
        )
    allowed = ATTENTION_TARGETS if is_moe else SUPPORTED_TARGETS
    why = (
        "an MoE model's experts, router and shared expert take no adapters on engine-megatron"
        if is_moe
        else "engine-megatron adapts the attention and dense MLP linears"
    )
    if isinstance(cfg.target_modules, str):
        if cfg.target_modules != "all-linear":
            raise ConfigError(
                f"lora.target_modules={cfg.target_modules!r}: engine-megatron takes "
                f"'all-linear' or a list of module names from {list(allowed)}"
            )
        if is_moe:
            raise ConfigError(
                f"lora.target_modules='all-linear' on a mixture-of-experts model: {why}; "
                f"set lora.target_modules={list(ATTENTION_TARGETS)}"
            )
        return
    bad = [t for t in cfg.target_modules if t not in allowed]
    if bad or not cfg.target_modules:
        raise ConfigError(
            f"lora.target_modules={cfg.target_modules!r}: {why}; choose names from {list(allowed)}"
        )


def initial_adapters(
    hf_model: nn.Module, cfg: LoraConfig, seed: int
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{HF module name: (A, B)} as peft initialises them on `hf_model` under `seed` (the
    same draw as engine-fsdp's, so both engines start from the same adapters). Wraps
    `hf_model` in place: take its state dict before."""
    # imported here: peft takes seconds to import and only LoRA runs need it
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    peft_cfg = PeftLoraConfig(
        r=cfg.rank,
        # peft annotates lora_alpha `int` but divides it (scaling = lora_alpha / r): a float
        # alpha is what it computes with
        lora_alpha=cfg.alpha,  # type: ignore[arg-type]
        lora_dropout=cfg.dropout,
        target_modules=cfg.target_modules,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            peft_model = get_peft_model(hf_model, peft_cfg)
        except ValueError as exc:
            raise ConfigError(f"lora.target_modules={cfg.target_modules!r}: {exc}") from exc
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for name, p in peft_model.named_parameters():
        m = _PEFT_PARAM.match(name)
        if m is not None:
            pairs.setdefault(m.group(1), {})[m.group(2)] = p.detach().float().clone()
    out = {}
    for module, ab in pairs.items():
        hm = _HF_MODULE.match(module)
        if hm is None or hm.group(2) not in _HF_TO_MEGATRON:
            raise ConfigError(
                f"lora.target_modules={cfg.target_modules!r} adapts {module!r}, which "
                f"engine-megatron cannot adapt; choose names from {list(SUPPORTED_TARGETS)}"
            )
        out[module] = (ab["A"], ab["B"])
    return out


@dataclass(frozen=True)
class FusedLayout:
    """How a column-parallel linear's local output is laid out: per part, its local width;
    `groups` > 1 interleaves the parts per query group (`linear_qkv`), else they follow
    one another (`linear_fc1`: gate rows, then up rows)."""

    widths: dict[str, int]
    groups: int

    def compose(self, deltas: dict[str, torch.Tensor], like: torch.Tensor) -> torch.Tensor:
        """Parts' deltas `[..., width_p]` (missing parts: zero) -> the fused `[..., sum]`."""
        lead = like.shape[:-1]
        pieces = [
            deltas[p] if p in deltas else like.new_zeros(*lead, w) for p, w in self.widths.items()
        ]
        if self.groups == 1:
            return torch.cat(pieces, dim=-1)
        grouped = [t.reshape(*lead, self.groups, -1) for t in pieces]
        return torch.cat(grouped, dim=-1).reshape(*lead, -1)


class LinearAdapter(nn.Module):
    """The adapters of one megatron linear: `A[part]`, `B[part]` as this TP rank holds them,
    added to the linear's output by a forward hook while `enabled`."""

    def __init__(
        self,
        kind: str,
        parts: dict[str, tuple[torch.Tensor, torch.Tensor]],
        layout: FusedLayout | None,
        scaling: float,
        sequence_parallel: bool,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.kind, self.layout, self.scaling = kind, layout, scaling
        self.sequence_parallel = sequence_parallel
        self.enabled = True
        self.A = nn.ParameterDict({p: nn.Parameter(a.to(dtype)) for p, (a, _) in parts.items()})
        self.B = nn.ParameterDict({p: nn.Parameter(b.to(dtype)) for p, (_, b) in parts.items()})
        split = self.B if kind == "column" else self.A
        for p in self.A.values() if kind == "column" else self.B.values():
            # whole on every TP rank; with sp its gradient is partial (a sequence chunk)
            p.sequence_parallel = sequence_parallel
        for p in split.values():
            tensor_parallel.set_tensor_model_parallel_attributes(
                p, True, 0 if kind == "column" else 1, 1
            )

    def hook(self, module: nn.Module, args: tuple, output: Any) -> Any:
        if not self.enabled:
            return output
        out, bias = output
        x = args[0]
        names = list(self.A)
        ranks = [self.A[p].shape[0] for p in names]
        y = F.linear(x, torch.cat([self.A[p] for p in names]))  # [s(/tp), b, sum ranks]
        if self.kind == "column":
            if self.sequence_parallel:
                y = tensor_parallel.gather_from_sequence_parallel_region(y)
            else:
                y = tensor_parallel.copy_to_tensor_model_parallel_region(y)
            ys = dict(zip(names, y.split(ranks, dim=-1)))
            deltas = {p: F.linear(ys[p], self.B[p]) for p in names}
            assert self.layout is not None
            delta = self.layout.compose(deltas, out)
        else:
            if self.sequence_parallel:
                y = tensor_parallel.reduce_scatter_to_sequence_parallel_region(y)
            else:
                y = tensor_parallel.reduce_from_tensor_model_parallel_region(y)
            delta = F.linear(y, self.B[names[0]])
        return out + self.scaling * delta.to(out.dtype), bias

    def weight_delta(self, weight: torch.Tensor) -> torch.Tensor:
        """scaling * B @ A in the local layout of `weight` (float32), for merged exports."""
        deltas = {p: self.B[p].float() @ self.A[p].float() for p in self.A}
        if self.kind == "row":
            return self.scaling * next(iter(deltas.values()))
        assert self.layout is not None
        fused = self.layout.compose({p: d.T for p, d in deltas.items()}, weight.float().T)
        return self.scaling * fused.T


class Adapters:
    """Every adapter of an engine's model chunks, with the HF module each part stands for."""

    def __init__(self, cfg: LoraConfig) -> None:
        self.cfg = cfg
        self.scaling = cfg.alpha / cfg.rank
        # (adapter, part, HF module name)
        self.entries: list[tuple[LinearAdapter, str, str]] = []
        self.by_weight: dict[int, LinearAdapter] = {}
        """id of an adapted linear's weight -> its adapter (for merged exports)."""

    def attach(
        self,
        chunks: Sequence[TephraGPT],
        initial: dict[str, tuple[torch.Tensor, torch.Tensor]],
        heads: Any,
        sequence_parallel: bool,
        dtype: torch.dtype,
    ) -> None:
        """Add this rank's slice of the `initial` adapters to the linears of `chunks`."""
        tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
        wanted: dict[tuple[int, str], dict[str, tuple[torch.Tensor, torch.Tensor, str]]] = {}
        for module, (a, b) in initial.items():
            hm = _HF_MODULE.match(module)
            assert hm is not None  # checked by initial_adapters
            linear, part, kind = _HF_TO_MEGATRON[hm.group(2)]
            if kind == "column":
                a, b = a, b.chunk(tp, dim=0)[rank]
            else:
                a, b = a.chunk(tp, dim=1)[rank], b
            wanted.setdefault((int(hm.group(1)), linear), {})[part] = (a, b, module)
        for chunk in chunks:
            for layer in chunk.gpt.decoder.layers:
                index = layer.layer_number - 1
                for linear_name, parts in _PARTS.items():
                    found = wanted.get((index, linear_name))
                    if not found:
                        continue
                    linear = layer.get_submodule(linear_name)
                    kind = "column" if len(parts) > 1 else "row"
                    layout = _layout(linear_name, linear, heads, tp) if kind == "column" else None
                    adapter = LinearAdapter(
                        kind,
                        {p: (a, b) for p, (a, b, _) in found.items()},
                        layout,
                        self.scaling,
                        sequence_parallel,
                        dtype,
                    )
                    linear.lora = adapter
                    linear.register_forward_hook(adapter.hook)
                    self.by_weight[id(linear.weight)] = adapter
                    for p, (_, _, module) in found.items():
                        self.entries.append((adapter, p, module))

    def set_enabled(self, enabled: bool) -> None:
        for adapter in {id(a): a for a, _, _ in self.entries}.values():
            adapter.enabled = enabled

    def full_tensors(self) -> dict[str, torch.Tensor]:
        """This rank's adapters completed over TP, under peft's file names
        (`base_model.model.<module>.lora_A.weight`), float32. Collective over the TP group."""
        tp = ps.get_tensor_model_parallel_world_size()
        group = ps.get_tensor_model_parallel_group()
        out = {}
        for adapter, part, module in self.entries:
            a, b = adapter.A[part].detach(), adapter.B[part].detach()
            split, dim = (b, 0) if adapter.kind == "column" else (a, 1)
            if tp > 1:
                shards = [torch.empty_like(split) for _ in range(tp)]
                dist.all_gather(shards, split.contiguous(), group=group)
                whole = torch.cat(shards, dim=dim)
                a, b = (a, whole) if adapter.kind == "column" else (whole, b)
            out[f"base_model.model.{module}.lora_A.weight"] = a.float().cpu().contiguous()
            out[f"base_model.model.{module}.lora_B.weight"] = b.float().cpu().contiguous()
        return out

    def gather(self) -> dict[str, torch.Tensor]:
        """Every adapter, complete, on every rank (`full_tensors` of every pipeline stage):
        data-parallel rank 0 of each stage contributes its own. Collective."""
        mine = self.full_tensors()
        keep = (
            ps.get_data_parallel_rank(with_context_parallel=True) == 0
            and ps.get_tensor_model_parallel_rank() == 0
        )
        gathered: list = [None] * dist.get_world_size()
        # small: rank x 2 matrices per adapted linear
        dist.all_gather_object(gathered, mine if keep else {})
        return {k: v for part in gathered for k, v in part.items()}

    def write(self, path: Path, base_path: str | None) -> None:
        """Write the adapters as peft does (`adapter_model.safetensors` and
        `adapter_config.json`). Collective: every rank completes its adapters over TP; data-
        parallel rank 0 of each pipeline stage sends them to rank 0, which writes."""
        # imported here: peft takes seconds to import and only LoRA runs need it
        from peft import LoraConfig as PeftLoraConfig

        state = self.gather()
        if dist.get_rank() == 0:
            targets = sorted({k.split(".lora_")[0].rsplit(".", 1)[-1] for k in state})
            path.mkdir(parents=True, exist_ok=True)
            save_file(state, str(path / "adapter_model.safetensors"), metadata={"format": "pt"})
            PeftLoraConfig(
                r=self.cfg.rank,
                # peft annotates lora_alpha `int` but divides it (scaling = lora_alpha / r)
                lora_alpha=self.cfg.alpha,  # type: ignore[arg-type]
                lora_dropout=self.cfg.dropout,
                target_modules=targets,
                base_model_name_or_path=base_path,
                task_type="CAUSAL_LM",
            ).save_pretrained(str(path))
        dist.barrier()


def _layout(linear_name: str, linear: nn.Module, heads: Any, tp: int) -> FusedLayout:
    if linear_name == "self_attention.linear_qkv":
        groups = heads.num_kv_heads // tp
        q = heads.num_heads // heads.num_kv_heads * heads.head_dim
        d = heads.head_dim
        return FusedLayout({"q": groups * q, "k": groups * d, "v": groups * d}, groups)
    half = (
        linear.get_parameter("weight").shape[0] // 2
    )  # linear_fc1: [gate rows; up rows] of this rank
    return FusedLayout({"gate": half, "up": half}, 1)
