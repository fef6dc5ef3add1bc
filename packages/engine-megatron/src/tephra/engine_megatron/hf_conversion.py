"""Hugging Face <-> megatron weight conversion for Llama, Mistral, Qwen2, Qwen3 (dense and MoE),
Gemma-3 (text) and DeepSeek-V3 (MLA + MoE).

Our own mapping rather than megatron-bridge: bridge 0.3.1 (the last release for Python 3.11)
hard-depends on transformer-engine, which a CPU install cannot satisfy without overriding the
workspace's dependency resolution; the mapping for these architectures is a short table.

Naming: megatron names are those of `TephraGPT` (`gpt.decoder.layers.{i}...`, layer i local
to the pipeline chunk); HF names are those of the installed transformers' `state_dict()`
(transformers 5 stores MoE experts fused: `mlp.experts.gate_up_proj` `[E, 2f, h]` with gate
rows first, `mlp.experts.down_proj` `[E, h, f]`).

Layouts on megatron's side (tp = size of the tensor-parallel group of that weight):
- `linear_qkv` `[ng * (q_per_group + 2) * head_dim, h]`: per query group g, the q heads of
  g, then k_g, then v_g; TP rank r holds groups r*ng/tp ... (r+1)*ng/tp - 1.
- `linear_fc1` `[2 * f / tp, h]` on rank r: [gate rows of rank r; up rows of rank r].
- column-parallel: rows split; row-parallel (`linear_proj`, `linear_fc2`): columns split;
  embeddings/output layer: vocabulary rows split.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

_L = r"gpt\.decoder\.layers\.(?P<layer>\d+)\."
_HL = "model.layers.{layer}."


@dataclass(frozen=True)
class Rule:
    pattern: re.Pattern
    kind: str  # rep | vocab | col | row | qkv | gate_up | expert_gate_up | expert_down
    hf: tuple[str, ...]


def _rule(pattern: str, kind: str, *hf: str) -> Rule:
    return Rule(re.compile(pattern + "$"), kind, hf)


RULES = (
    _rule(r"gpt\.embedding\.word_embeddings\.weight", "vocab", "model.embed_tokens.weight"),
    _rule(r"gpt\.output_layer\.weight", "vocab", "lm_head.weight"),
    _rule(r"gpt\.decoder\.final_layernorm\.weight", "rep", "model.norm.weight"),
    _rule(r"value_head\.weight", "rep", "score.weight"),
    _rule(_L + r"input_layernorm\.weight", "rep", _HL + "input_layernorm.weight"),
    _rule(_L + r"pre_mlp_layernorm\.weight", "rep", _HL + "post_attention_layernorm.weight"),
    _rule(
        _L + r"self_attention\.linear_qkv\.weight",
        "qkv",
        *(_HL + f"self_attn.{p}_proj.weight" for p in "qkv"),
    ),
    _rule(
        _L + r"self_attention\.linear_qkv\.bias",
        "qkv",
        *(_HL + f"self_attn.{p}_proj.bias" for p in "qkv"),
    ),
    _rule(_L + r"self_attention\.linear_proj\.weight", "row", _HL + "self_attn.o_proj.weight"),
    _rule(_L + r"self_attention\.q_layernorm\.weight", "rep", _HL + "self_attn.q_norm.weight"),
    _rule(_L + r"self_attention\.k_layernorm\.weight", "rep", _HL + "self_attn.k_norm.weight"),
    _rule(
        _L + r"mlp\.linear_fc1\.weight",
        "gate_up",
        _HL + "mlp.gate_proj.weight",
        _HL + "mlp.up_proj.weight",
    ),
    _rule(_L + r"mlp\.linear_fc2\.weight", "row", _HL + "mlp.down_proj.weight"),
    _rule(_L + r"mlp\.router\.weight", "rep", _HL + "mlp.gate.weight"),
    _rule(
        _L + r"mlp\.shared_experts\.linear_fc1\.weight",
        "gate_up",
        _HL + "mlp.shared_expert.gate_proj.weight",
        _HL + "mlp.shared_expert.up_proj.weight",
    ),
    _rule(
        _L + r"mlp\.shared_experts\.linear_fc2\.weight",
        "row",
        _HL + "mlp.shared_expert.down_proj.weight",
    ),
    _rule(_L + r"mlp\.shared_experts\.gate_weight", "rep", _HL + "mlp.shared_expert_gate.weight"),
    _rule(
        _L + r"mlp\.experts\.local_experts\.(?P<expert>\d+)\.linear_fc1\.weight",
        "expert_gate_up",
        _HL + "mlp.experts.gate_up_proj",
    ),
    _rule(
        _L + r"mlp\.experts\.local_experts\.(?P<expert>\d+)\.linear_fc2\.weight",
        "expert_down",
        _HL + "mlp.experts.down_proj",
    ),
)


# Gemma-3's four norms per layer: megatron's `pre_mlp_layernorm` is HF's pre-feed-forward
# norm (not `post_attention_layernorm`, which Gemma applies to the attention output), and
# the post norms live in the bias-dropout-add slots (`model_builder.PostNormAdd`)
GEMMA_RULES = (
    _rule(_L + r"pre_mlp_layernorm\.weight", "rep", _HL + "pre_feedforward_layernorm.weight"),
    _rule(_L + r"self_attn_bda\.weight", "rep", _HL + "post_attention_layernorm.weight"),
    _rule(_L + r"mlp_bda\.weight", "rep", _HL + "post_feedforward_layernorm.weight"),
)
# DeepSeek-V3: multi-head latent attention (megatron's MLASelfAttention: its down
# projections whole on every rank (`model_builder.block_spec` says why); the up projections
# split by heads, each head's rows [nope, rope] / [k nope, v] in the
# same order as transformers'), the router's score-correction bias (a buffer on both sides)
# and an ungated shared expert under transformers' plural name
MLA_RULES = (
    _rule(_L + r"self_attention\.linear_q_proj\.weight", "col", _HL + "self_attn.q_proj.weight"),
    _rule(
        _L + r"self_attention\.linear_q_down_proj\.weight", "rep", _HL + "self_attn.q_a_proj.weight"
    ),
    _rule(
        _L + r"self_attention\.linear_q_up_proj\.weight", "col", _HL + "self_attn.q_b_proj.weight"
    ),
    _rule(
        _L + r"self_attention\.linear_kv_down_proj\.weight",
        "rep",
        _HL + "self_attn.kv_a_proj_with_mqa.weight",
    ),
    _rule(
        _L + r"self_attention\.linear_kv_up_proj\.weight", "col", _HL + "self_attn.kv_b_proj.weight"
    ),
    _rule(
        _L + r"self_attention\.q_layernorm\.weight", "rep", _HL + "self_attn.q_a_layernorm.weight"
    ),
    _rule(
        _L + r"self_attention\.kv_layernorm\.weight", "rep", _HL + "self_attn.kv_a_layernorm.weight"
    ),
    _rule(_L + r"mlp\.router\.expert_bias", "rep", _HL + "mlp.gate.e_score_correction_bias"),
    _rule(
        _L + r"mlp\.shared_experts\.linear_fc1\.weight",
        "gate_up",
        _HL + "mlp.shared_experts.gate_proj.weight",
        _HL + "mlp.shared_experts.up_proj.weight",
    ),
    _rule(
        _L + r"mlp\.shared_experts\.linear_fc2\.weight",
        "row",
        _HL + "mlp.shared_experts.down_proj.weight",
    ),
)
_FAMILY_RULES = {"gemma3_text": GEMMA_RULES + RULES, "deepseek_v3": MLA_RULES + RULES}


@dataclass(frozen=True)
class Match:
    rule: Rule
    hf_names: tuple[str, ...]
    local_layer: int | None
    local_expert: int | None

    @property
    def kind(self) -> str:
        return self.rule.kind

    @property
    def is_expert(self) -> bool:
        return self.kind.startswith("expert")


def match(name: str, layer_offset: dict[int, int], model_type: str = "") -> Match:
    """Find the rule for megatron parameter `name` of a `model_type` model; `layer_offset`
    maps a chunk-local layer index to its global (HF) index."""
    for rule in _FAMILY_RULES.get(model_type, RULES):
        m = rule.pattern.match(name)
        if m is None:
            continue
        groups = m.groupdict()
        local = int(groups["layer"]) if "layer" in groups else None
        layer = layer_offset[local] if local is not None else None
        return Match(
            rule,
            tuple(h.format(layer=layer) for h in rule.hf),
            local,
            int(groups["expert"]) if groups.get("expert") is not None else None,
        )
    raise KeyError(f"no HF mapping for megatron parameter {name!r}")


@dataclass(frozen=True)
class Heads:
    num_heads: int
    num_kv_heads: int
    head_dim: int


def to_megatron(
    m: Match,
    hf: dict[str, torch.Tensor],
    rank: int,
    size: int,
    heads: Heads,
    global_expert: int | None = None,
) -> torch.Tensor:
    """This rank's megatron tensor for match `m` from full HF tensors `hf`."""
    tensors = [hf[n] for n in m.hf_names]
    kind = m.kind
    if kind == "rep":
        return tensors[0]
    if kind in ("vocab", "col"):
        return tensors[0].chunk(size, dim=0)[rank]
    if kind == "row":
        return tensors[0].chunk(size, dim=1)[rank]
    if kind == "qkv":
        q, k, v = tensors
        ng = heads.num_kv_heads
        tail = q.shape[1:]
        fused = torch.cat(
            [q.reshape(ng, -1, *tail), k.reshape(ng, -1, *tail), v.reshape(ng, -1, *tail)], dim=1
        )
        return fused.chunk(size, dim=0)[rank].reshape(-1, *tail)
    if kind == "gate_up":
        gate, up = tensors
        return torch.cat([gate.chunk(size, dim=0)[rank], up.chunk(size, dim=0)[rank]])
    if kind == "expert_gate_up":
        gate, up = tensors[0][global_expert].chunk(2, dim=0)
        return torch.cat([gate.chunk(size, dim=0)[rank], up.chunk(size, dim=0)[rank]])
    if kind == "expert_down":
        return tensors[0][global_expert].chunk(size, dim=1)[rank]
    raise AssertionError(kind)


def from_megatron(m: Match, shards: list[torch.Tensor], heads: Heads) -> dict[str, torch.Tensor]:
    """Full HF tensors for match `m` from the shards of every rank of its TP group (rank
    order). Expert kinds return one expert's slice (`[2f, h]` / `[h, f]`); the caller stacks."""
    kind = m.kind
    if kind == "rep":
        return {m.hf_names[0]: shards[0]}
    if kind in ("vocab", "col"):
        return {m.hf_names[0]: torch.cat(shards, dim=0)}
    if kind in ("row", "expert_down"):
        return {m.hf_names[0]: torch.cat(shards, dim=1)}
    if kind == "qkv":
        ng = heads.num_kv_heads
        full = torch.cat(shards, dim=0)
        tail = full.shape[1:]
        grouped = full.reshape(ng, -1, *tail)
        q_per = heads.num_heads // ng * heads.head_dim
        q, k, v = grouped.split([q_per, heads.head_dim, heads.head_dim], dim=1)
        return {name: t.reshape(-1, *tail) for name, t in zip(m.hf_names, (q, k, v))}
    if kind in ("gate_up", "expert_gate_up"):
        halves = [s.chunk(2, dim=0) for s in shards]
        gate = torch.cat([h[0] for h in halves])
        up = torch.cat([h[1] for h in halves])
        if kind == "expert_gate_up":
            return {m.hf_names[0]: torch.cat([gate, up])}
        return {m.hf_names[0]: gate, m.hf_names[1]: up}
    raise AssertionError(kind)


_FUSED_EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def expert_checkpoint_split(hf_name: str, expert: int, t: torch.Tensor) -> dict[str, torch.Tensor]:
    """One expert's slice of a fused tensor (`[2f, h]` gate rows first, or `[h, f]`) under the
    names a checkpoint stores: transformers 5 fuses a layer's experts in memory but saves
    them per expert, as checkpoints on the Hub have them and vLLM reads them."""
    prefix = hf_name.rsplit(".", 1)[0]  # model.layers.{i}.mlp.experts
    if hf_name.endswith("gate_up_proj"):
        gate, up = t.chunk(2, dim=0)
        return {
            f"{prefix}.{expert}.gate_proj.weight": gate,
            f"{prefix}.{expert}.up_proj.weight": up,
        }
    return {f"{prefix}.{expert}.down_proj.weight": t}


def is_fused_experts(hf_name: str) -> bool:
    return hf_name.endswith(_FUSED_EXPERTS)


def checkpoint_format(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A transformers 5 state dict (fused experts `[E, ...]`) in checkpoint naming."""
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if not is_fused_experts(name):
            out[name] = t
            continue
        for e in range(t.shape[0]):
            out.update(expert_checkpoint_split(name, e, t[e]))
    return out
