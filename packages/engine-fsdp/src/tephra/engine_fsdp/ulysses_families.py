"""Which model families engine=fsdp refuses under Ulysses sequence parallelism
(`parallel.context > 1`), and why.

Ulysses packs every micro-batch (a family refused in the packed layout, `families.REFUSED`,
is refused under Ulysses with that reason) and replaces the model's attention with
`ulysses.ATTENTION_NAME`, which exchanges q/k/v heads for tokens around a causal attention
(with the sliding window the layer hands it, if any) over each whole packed sequence. A
family whose attention is more than that (sinks, a chunked attention, a window or a mask
that reaches attention only through the mask, a sparse-attention indexer) or does not go
through transformers' attention interface at all (each rank would attend over its own shard
of the tokens only) gives wrong log-probs or fails there; `ULYSSES_REFUSED` names them, as
the 2-rank family matrix (`family_matrix_ulysses`) found them.
"""

from __future__ import annotations

from typing import Any

from tephra.engine_api.config import EngineConfig
from tephra.engine_api.errors import ConfigError
from tephra.engine_fsdp.families import layout_refusal, model_configs_of, window_turned_off

ULYSSES_FIX = "set parallel.context=1 (data parallelism only)"
"""How a user leaves a refused Ulysses run."""

WINDOW_IN_MASK = (
    "its sliding window reaches attention only through the attention mask (the layer "
    "passes no sliding_window to the attention function), and Ulysses attention takes no "
    "mask, so a token would see keys beyond its window"
)
SINKS = (
    "its attention sinks (s_aux) are not implemented by engine=fsdp's Ulysses attention "
    "(it raises on them)"
)
DYNAMIC_MASK = (
    "its attention masks keys dynamically (a mask computed from the values, handed to the "
    "attention function), which Ulysses attention does not take"
)
CHUNKED = (
    "its chunked attention (attention_chunk_size) is not implemented by engine=fsdp's Ulysses "
    "attention, which attends over each whole packed sequence, so a token would see keys "
    "outside its chunk"
)
OWN_ATTENTION = (
    "its attention runs its own code instead of transformers' attention interface, so "
    "Ulysses' head exchange never runs and each rank attends over its own shard of the "
    "tokens only"
)
SPARSE_INDEXER = (
    "its sparse-attention indexer (DeepSeek Sparse Attention) chooses each query's keys "
    "from the attention mask outside transformers' attention interface, over the rank's own "
    "shard of the tokens, and Ulysses passes no mask (transformers fails on it)"
)

PER_LAYER_HEADS = (
    "its attention sizes are per layer (per_layer_config), and Ulysses splits heads by one "
    "model-wide head count (transformers raises AmbiguousGlobalPerLayerAttributeError)"
)

ULYSSES_REFUSED: dict[str, str] = {
    "doge": DYNAMIC_MASK,
    **{f: SINKS for f in ("flint", "granite_swa", "granitemoe_swa", "mimo_v2_flash")},
    "phimoe": WINDOW_IN_MASK,
    "llama4_text": CHUNKED,
    **{f: OWN_ATTENTION for f in ("codegen", "gpt_neo", "gpt_neox_japanese", "gptj")},
    "dots3_note_text": PER_LAYER_HEADS,
    **{f: SPARSE_INDEXER for f in ("axk2", "deepseek_v32", "glm_moe_dsa", "hy_v4")},
}
"""model_type -> why engine=fsdp's Ulysses attention is wrong for it (families the packed
layout runs; a vision-language family is refused where its text family is)."""

WINDOWED = (WINDOW_IN_MASK, CHUNKED)
"""Refusals that do not apply to a config whose window is turned off."""


def ulysses_refusal(
    model_type: str | None, sp: int, hf_config: dict[str, Any] | None = None
) -> str | None:
    """Why engine=fsdp refuses `model_type` under Ulysses at `parallel.context=sp` (a
    message naming the family, the layout and the fix), or None: the packed layout's
    refusal (Ulysses packs), or `ULYSSES_REFUSED`'s, unless it is a window that `hf_config`
    turns off (`families.window_turned_off`)."""
    packed = layout_refusal(model_type, "padded", hf_config) or layout_refusal(
        model_type, "packed", hf_config
    )
    if packed:
        return packed
    why = ULYSSES_REFUSED.get(model_type or "")
    if why is None or (why in WINDOWED and hf_config and window_turned_off(hf_config)):
        return None
    return (
        f"model_type={model_type!r} in the Ulysses layout (parallel.context={sp}): {why}; "
        f"{ULYSSES_FIX}"
    )


def check(config: EngineConfig) -> None:
    """Refuse `config`'s model family (or its text model's) under Ulysses when
    `parallel.context > 1` (`ulysses_refusal`)."""
    sp = config.parallel.context
    if sp == 1:
        return
    for hf_config in model_configs_of(config):
        model_type = hf_config.get("model_type")
        why = ulysses_refusal(model_type if isinstance(model_type, str) else None, sp, hf_config)
        if why:
            raise ConfigError(why)


ULYSSES_COLUMN = "Ulysses SP=2"
"""The support table's column of `ulysses_status`."""

ULYSSES_LEGEND = (
    "**Ulysses SP=2** (`parallel.context=2`, 2 gloo ranks): **Y**: the comparisons above",
    "with the tiny model split over 2 ranks by Ulysses (each rank runs half of every packed",
    "micro-batch's tokens; attention exchanges heads for tokens): log-probs and entropy",
    "within 1e-5, and the update's gradient of every parameter within 1e-5. Ulysses packs,",
    "so a family refused packed is refused here for that reason. Every family **Y** padded",
    "is also checked on 2 data-parallel ranks (FSDP world size 2, padded rows, each rank one",
    "prompt's 3 rows): the update's gradients after FSDP's reduce-scatter equal the plain",
    "model's over all 6 rows within 1e-5. All of them run in the default test suite",
    "(`test_engine_fsdp_families_ulysses.py`: one start of 2 processes for every family,",
    "about 90 s of CPU time, 2-3 minutes on a shared 2-core machine).",
)
"""The support table's legend of the Ulysses column and the data-parallel check."""


def ulysses_status(model_type: str, packed_status: str) -> str:
    """The support table's Ulysses cell of a text family: the packed layout's status where
    that is not Y (refused, not buildable), else `refused (reason)` or `Y`."""
    if not packed_status.startswith("Y"):
        return packed_status
    why = ULYSSES_REFUSED.get(model_type)
    return f"refused ({why})" if why else packed_status
