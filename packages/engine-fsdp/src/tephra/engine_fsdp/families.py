"""Which model families engine=fsdp refuses in which micro-batch layout, and why.

A layout is how `FSDPEngine` lays a micro-batch out for the model: `padded` rows with an
attention mask, `packed` sequences end to end in one row (position ids restart per
sequence, no mask), or `shared_prefix` (a prompt's samples run the prompt once, each
sample's tokens attending to it through a segment mask). Attention layers see sequence
boundaries in all three through the mask or the position ids; a layer that keeps a recurrent
state (linear attention, state-space layers) does not, so in the packed and shared-prefix
layouts it would carry one sequence's state into the next. Other families are wrong in a
layout for a cause of their own (a causal mask built without the position ids, ALiBi or
compressor windows by column, an attention that bypasses transformers' interface); each
refusal below names it. Those combinations are refused before anything is built (`FSDPEngine.check_config`, which the apps call before Ray starts).
The family matrix test (`tephra.engine_fsdp.family_matrix`) checks every other combination
against a plain transformers forward.
"""

from __future__ import annotations

from typing import Any

from tephra.engine_api.config import EngineConfig
from tephra.engine_api.errors import ConfigError
from tephra.engine_api.multimodal import declared_hf_config

LAYOUTS = ("padded", "packed", "shared_prefix")
"""The micro-batch layouts, in the order of the support table."""

LAYOUT_OVERRIDES: dict[str, dict[str, Any]] = {
    "padded": {"micro_batch.use_packing": False, "micro_batch.share_prefix": False},
    "packed": {"micro_batch.use_packing": True, "micro_batch.share_prefix": False},
    "shared_prefix": {"micro_batch.use_packing": False, "micro_batch.share_prefix": True},
}
"""The engine config overrides that select each layout."""

LAYOUT_FIX = {
    "padded": "engine=fsdp cannot train this family; choose a model of a family listed as "
    "supported in docs/models.md",
    "packed": "set micro_batch.use_packing=false (padded rows) and parallel.context=1",
    "shared_prefix": "set micro_batch.share_prefix=false (or null: on where supported)",
}
"""How a user leaves a refused layout."""

RECURRENT = (
    "its linear-attention / state-space layers keep a recurrent state across tokens that "
    "neither the packed row's position ids nor the shared-prefix segment mask reach, so one "
    "sequence's state flows into the next"
)
CONVOLUTION = (
    "its attention runs a causal convolution along the row over the query and key "
    "projections (and a delayed state over the values), which neither the packed row's "
    "position ids nor the shared-prefix segment mask reach, so one sequence's tokens flow "
    "into the next"
)
SHORT_CONVOLUTION = (
    "its short-convolution layers mix each token with the tokens before it in the row, which "
    "neither the packed row's position ids nor the shared-prefix segment mask reach, so one "
    "sequence's last tokens flow into the next"
)
KV_CONVOLUTION = (
    "its attention runs a short causal convolution along the row over the key and value "
    "projections, which neither the packed row's position ids nor the shared-prefix segment "
    "mask reach, so one sequence's last tokens flow into the next"
)
SLIDING_SHARED = (
    "the shared-prefix segment mask replaces its sliding-window (or chunked) attention mask, "
    "so a token attends to keys beyond its window"
)
SLIDING_PACKED = (
    "a packed row reaches its sliding-window / sink attention without a mask, and that "
    "attention does not rebuild the sequence boundaries from the position ids"
)
NO_SEGMENT_MASK = (
    "its attention does not take the 4D segment mask the shared-prefix layout passes "
    "(transformers fails on it)"
)

MASK_WITHOUT_POSITIONS = (
    "its model builds its causal mask without the position ids (transformers' "
    "create_causal_mask is not handed them), so in a packed row each sequence attends to the "
    "sequences packed before it"
)
ALIBI_BY_COLUMN = (
    "its ALiBi bias is computed from each key's column in the row, not from its position id, "
    "so in a shared-prefix row a sample's distance to the prompt also counts the other "
    "samples' tokens in between"
)
NO_POSITION_IDS = (
    "its decoder takes no position ids: it numbers positions by the token's column in the "
    "row and builds its causal mask without them, so a packed or shared-prefix sequence after "
    "the first gets the wrong positions and sees the sequences before it"
)
OWN_ATTENTION_SWITCH = (
    "its attention chooses between its own SDPA and eager code by the attention "
    "implementation's name instead of calling transformers' attention interface, so the "
    "shared-prefix tree attention never runs and the row's placeholder mask lets every token "
    "see every other"
)
COMPRESSED_BY_COLUMN = (
    "its compressed attention (CSA / HCA) pools every compress-rate consecutive columns of the "
    "row into one key-value entry whatever the position ids or the segment mask say, so a "
    "packed sequence's entries take in the sequence before it and a shared-prefix sample's "
    "the other samples"
)
ROW_CAUSAL_MASK = (
    "its attention applies a fixed lower-triangular mask over the row's columns, so in a "
    "packed row each sequence attends to the sequences packed before it"
)
BIDIRECTIONAL = (
    "its forward marks every token as context, which attends to the whole row both ways (the "
    "logits at a position change with the tokens after it), so its log-prob of a sequence is "
    "not a product of next-token probabilities; it also finds padding by token id 0 counted "
    "from a left-padded row"
)
PATCHES_BY_ROW = (
    "it groups the row's bytes into patches (where its patcher model's next-byte entropy "
    "crosses a threshold) over the whole row, whatever the position ids or the segment mask "
    "say, so a packed sequence's patches take in the sequence before it and a shared-prefix "
    "sample's the other samples"
)
NGRAM_STREAM = (
    "its logits come from its first n-gram predicting stream, not from the decoder's last "
    "hidden state, which engine=fsdp's scorer feeds the output head"
)


REFUSED: dict[str, dict[str, str]] = {
    "afmoe": {"packed": SLIDING_PACKED, "shared_prefix": SLIDING_SHARED},
    "bailing_hybrid": {"packed": RECURRENT, "shared_prefix": RECURRENT},
    "bamba": {"packed": RECURRENT, "shared_prefix": RECURRENT},
    "bart": {"packed": NO_POSITION_IDS, "shared_prefix": NO_POSITION_IDS},
    "beam": {"shared_prefix": SLIDING_SHARED},
    "bert-generation": {"packed": MASK_WITHOUT_POSITIONS},
    "bigbird_pegasus": {"packed": NO_POSITION_IDS, "shared_prefix": NO_POSITION_IDS},
    "biogpt": {"packed": MASK_WITHOUT_POSITIONS},
    "blenderbot": {"packed": NO_POSITION_IDS, "shared_prefix": NO_POSITION_IDS},
    "blenderbot-small": {"packed": NO_POSITION_IDS, "shared_prefix": NO_POSITION_IDS},
    "blt": {"packed": PATCHES_BY_ROW, "shared_prefix": PATCHES_BY_ROW},
    "bloom": {"packed": MASK_WITHOUT_POSITIONS, "shared_prefix": NO_SEGMENT_MASK},
    "cohere2": {"shared_prefix": SLIDING_SHARED},
    "cohere2_moe": {"shared_prefix": SLIDING_SHARED},
    "cpmant": {"padded": BIDIRECTIONAL, "packed": BIDIRECTIONAL, "shared_prefix": BIDIRECTIONAL},
    "cwm": {"shared_prefix": SLIDING_SHARED},
    "deepseek_v4": {"packed": COMPRESSED_BY_COLUMN, "shared_prefix": COMPRESSED_BY_COLUMN},
    "doge": {"shared_prefix": SLIDING_SHARED},
    "dots3_note_text": {"shared_prefix": SLIDING_SHARED},
    "exaone4": {"shared_prefix": SLIDING_SHARED},
    "exaone_moe": {"shared_prefix": SLIDING_SHARED},
    "falcon": {"packed": MASK_WITHOUT_POSITIONS, "shared_prefix": OWN_ATTENTION_SWITCH},
    "falcon_h1": {"packed": RECURRENT, "shared_prefix": RECURRENT},
    "falcon_mamba": {"packed": RECURRENT, "shared_prefix": RECURRENT},
    "flint": {"shared_prefix": SLIDING_SHARED},
    "gemma2": {"shared_prefix": SLIDING_SHARED},
    "gemma3_text": {"shared_prefix": SLIDING_SHARED},
    "gemma3n_text": {"shared_prefix": SLIDING_SHARED},
    "gemma4_text": {"shared_prefix": SLIDING_SHARED},
    "gemma4_unified_text": {"shared_prefix": SLIDING_SHARED},
    "gpt_oss": {"packed": SLIDING_PACKED, "shared_prefix": SLIDING_SHARED},
    "granite_swa": {"shared_prefix": SLIDING_SHARED},
    "granitemoe_swa": {"shared_prefix": SLIDING_SHARED},
    "granitemoehybrid": {"packed": RECURRENT, "shared_prefix": RECURRENT},
    "inkling2_text": {"packed": KV_CONVOLUTION, "shared_prefix": KV_CONVOLUTION},
    "inkling_text": {"packed": KV_CONVOLUTION, "shared_prefix": KV_CONVOLUTION},
    "jamba": {"packed": RECURRENT, "shared_prefix": RECURRENT},
    "kimi_linear": {"packed": RECURRENT, "shared_prefix": RECURRENT},
    "kolibri1": {"shared_prefix": SLIDING_SHARED},
    "lfm2": {"packed": SHORT_CONVOLUTION, "shared_prefix": SHORT_CONVOLUTION},
    "lfm2_moe": {"packed": SHORT_CONVOLUTION, "shared_prefix": SHORT_CONVOLUTION},
    "lfm3": {"packed": RECURRENT, "shared_prefix": RECURRENT},
    "llama4_text": {"shared_prefix": SLIDING_SHARED},
    "mamba": {"packed": RECURRENT, "shared_prefix": RECURRENT},
    "mbart": {"packed": NO_POSITION_IDS, "shared_prefix": NO_POSITION_IDS},
    "mamba2": {"packed": RECURRENT, "shared_prefix": RECURRENT},
    "marian": {"packed": NO_POSITION_IDS, "shared_prefix": NO_POSITION_IDS},
    "mimo_v2_flash": {"shared_prefix": SLIDING_SHARED},
    "minimax": {"packed": RECURRENT, "shared_prefix": RECURRENT},
    "ministral": {"shared_prefix": SLIDING_SHARED},
    "ministral3": {"shared_prefix": SLIDING_SHARED},
    "mistral": {"shared_prefix": SLIDING_SHARED},
    "mixtral": {"shared_prefix": SLIDING_SHARED},
    "mpt": {"packed": MASK_WITHOUT_POSITIONS, "shared_prefix": ALIBI_BY_COLUMN},
    "mvp": {"packed": NO_POSITION_IDS, "shared_prefix": NO_POSITION_IDS},
    "nemotron_h": {"packed": RECURRENT, "shared_prefix": RECURRENT},
    "olmo3": {"shared_prefix": SLIDING_SHARED},
    "olmo_hybrid": {"packed": RECURRENT, "shared_prefix": RECURRENT},
    "openai-gpt": {"packed": ROW_CAUSAL_MASK, "shared_prefix": NO_SEGMENT_MASK},
    "opt": {"packed": MASK_WITHOUT_POSITIONS},
    "pegasus": {"packed": NO_POSITION_IDS, "shared_prefix": NO_POSITION_IDS},
    "phi3": {"shared_prefix": SLIDING_SHARED},
    "phimoe": {"shared_prefix": SLIDING_SHARED},
    "plbart": {"packed": NO_POSITION_IDS, "shared_prefix": NO_POSITION_IDS},
    "prophetnet": {"padded": NGRAM_STREAM, "packed": NGRAM_STREAM, "shared_prefix": NGRAM_STREAM},
    "qwen2": {"shared_prefix": SLIDING_SHARED},
    "qwen2_moe": {"shared_prefix": SLIDING_SHARED},
    "qwen3": {"shared_prefix": SLIDING_SHARED},
    "qwen3_5_moe_text": {"packed": RECURRENT, "shared_prefix": RECURRENT},
    "qwen3_5_text": {"packed": RECURRENT, "shared_prefix": RECURRENT},
    "qwen3_moe": {"shared_prefix": SLIDING_SHARED},
    "qwen3_next": {"packed": RECURRENT, "shared_prefix": RECURRENT},
    "qwen4_exp_text": {"packed": RECURRENT, "shared_prefix": RECURRENT},
    "recurrent_gemma": {"packed": RECURRENT, "shared_prefix": RECURRENT},
    "rwkv": {"packed": RECURRENT, "shared_prefix": RECURRENT},
    "smollm3": {"shared_prefix": SLIDING_SHARED},
    "starcoder2": {"shared_prefix": SLIDING_SHARED},
    "trocr": {"packed": NO_POSITION_IDS, "shared_prefix": NO_POSITION_IDS},
    "vaultgemma": {"shared_prefix": SLIDING_SHARED},
    "xglm": {"packed": MASK_WITHOUT_POSITIONS},
    "xlstm": {"packed": RECURRENT, "shared_prefix": RECURRENT},
    "zamba": {"packed": RECURRENT, "shared_prefix": RECURRENT},
    "zamba2": {"packed": RECURRENT, "shared_prefix": RECURRENT},
    "zaya": {"packed": CONVOLUTION, "shared_prefix": CONVOLUTION},
}
"""model_type -> {layout: why the engine's outputs would be wrong there}: what the family
matrix found (a family refused `padded` is refused in every layout). A vision-language
family is refused where its text family is."""


CAUSAL_SETTING: dict[str, tuple[str, Any]] = {
    **{
        f: ("is_decoder", True)
        for f in (
            "bert",
            "bert-generation",
            "big_bird",
            "camembert",
            "data2vec-text",
            "electra",
            "ernie",
            "megatron-bert",
            "rembert",
            "roberta",
            "roberta-prelayernorm",
            "roc_bert",
            "roformer",
            "xlm-roberta",
            "xlm-roberta-xl",
            "xmod",
        )
    },
    "xlnet": ("attn_type", "uni"),
}
"""Families whose causal LM attends causally only with this config field set so (transformers
runs it bidirectionally otherwise: the BERT-style encoders without `is_decoder: true`, XLNet
with its default `attn_type: bi`) -> (field, value)."""


WINDOW_KEYS = ("sliding_window", "attention_chunk_size")
"""The config fields that give a sliding-window or chunked attention its size."""


def model_configs_of(config: EngineConfig) -> list[dict[str, Any]]:
    """The model config `config.model` declares (its `hf_config`, or `model.path`'s
    config.json, read without building anything), then its text model's where it has one."""
    data = declared_hf_config(config.model)
    text = data.get("text_config")
    return [data] + ([text] if isinstance(text, dict) else [])


def model_types_of(config: EngineConfig) -> list[str]:
    """The model type `config.model` names, then its text model's where it has one."""
    found = [d.get("model_type") for d in model_configs_of(config)]
    return [t for t in found if isinstance(t, str)]


SWITCHED_WINDOW = ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "smollm3")
"""Families whose sliding window is on only where the config says `use_sliding_window: true`
(their default is false: the released Qwen2.5 / Qwen3 / SmolLM3 configs)."""


def window_turned_off(hf_config: dict[str, Any]) -> bool:
    """Whether a sliding-window family's config turns its window off: `use_sliding_window:
    false` (or left out in a `SWITCHED_WINDOW` family, whose default is false), or every
    window size field it sets is null or 0 (and it sets one: a field left out takes the
    family's default, which may be a window)."""
    if hf_config.get("use_sliding_window") is False:
        return True
    if hf_config.get("model_type") in SWITCHED_WINDOW and not hf_config.get("use_sliding_window"):
        return True
    given = [k for k in WINDOW_KEYS if k in hf_config]
    return bool(given) and not any(hf_config[k] for k in given)


def layout_refusal(
    model_type: str | None, layout: str, hf_config: dict[str, Any] | None = None
) -> str | None:
    """Why engine=fsdp refuses `model_type` in `layout` (a message naming both and the
    fix), or None. A sliding-window refusal does not apply to an `hf_config` whose window is
    turned off (`window_turned_off`): its attention is then plain causal attention."""
    why = REFUSED.get(model_type or "", {}).get(layout)
    if why in (SLIDING_SHARED, SLIDING_PACKED) and hf_config and window_turned_off(hf_config):
        return None
    if why is None:
        return None
    return (
        f"model_type={model_type!r} in the {layout} micro-batch layout: {why}; {LAYOUT_FIX[layout]}"
    )


def refusal(config: EngineConfig, layout: str) -> str | None:
    """`layout_refusal` of the model `config` names (or of its text model)."""
    for hf_config in model_configs_of(config):
        model_type = hf_config.get("model_type")
        why = layout_refusal(model_type if isinstance(model_type, str) else None, layout, hf_config)
        if why:
            return why
    return None


def check_causal_setting(config: EngineConfig) -> None:
    """Refuse a `CAUSAL_SETTING` family whose config does not set its field so: its causal LM
    would attend both ways, so a token's log-prob would see the tokens after it."""
    for hf_config in model_configs_of(config):
        model_type = hf_config.get("model_type")
        if not isinstance(model_type, str) or model_type not in CAUSAL_SETTING:
            continue
        field, value = CAUSAL_SETTING[model_type]
        if hf_config.get(field) != value:
            raise ConfigError(
                f"model_type={model_type!r} with {field}={hf_config.get(field)!r}: transformers "
                f"runs this family's causal LM bidirectionally unless its config says "
                f"{field}: {value!r} (every token would attend to the tokens after it, so its "
                f"log-probs would not be next-token probabilities); set {field}: {value!r} in "
                "model.hf_config (or in config.json under model.path)"
            )


def check_layout(config: EngineConfig, packed: bool) -> None:
    """Refuse the layouts `config` asks for that its model family is wrong in: every
    layout when the family is refused padded, packing when `packed` (as the engine resolved
    `use_packing`) or under Ulysses (which packs), sharing when `share_prefix=true`. A
    setting left to the engine (`null`) steers clear of a refused layout instead."""
    asked = ["padded"]
    if packed or config.parallel.context > 1:
        asked.append("packed")
    if config.micro_batch.share_prefix:
        asked.append("shared_prefix")
    for layout in asked:
        why = refusal(config, layout)
        if why:
            raise ConfigError(why)
