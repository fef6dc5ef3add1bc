"""The model-family matrix: every causal-LM family of the installed transformers, built tiny,
checked in each micro-batch layout against a plain transformers model run on each sequence
alone: `FSDPEngine.forward`'s log-probs and entropy, and the gradients of one GRPO-style
update (`FSDPEngine.forward_backward` of `update_loss`); and the support table
(docs/models.md) that states the result.

A tiny config is the family's own default config with every size made small (2 layers,
hidden 64, vocabulary 256) and its special parts kept on: each per-layer list (`layer_types`,
`mlp_layer_types`, ...) keeps one layer of each of its first two kinds, so a hybrid keeps a
linear-attention and a full-attention layer, a sliding-window family a sliding and a full
layer (window 4, shorter than the test's sequences), a MoE family a dense and a sparse layer
(4 experts, 2 per token), an MLA family its low-rank projections.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from tensordict import TensorDict
from torch.distributed.tensor import DTensor
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from tephra.engine_api import batch as B
from tephra.engine_api.config import EngineConfig, ModelConfig, apply_overrides
from tephra.engine_api.errors import ConfigError
from tephra.engine_api.loss import Share
from tephra.engine_fsdp.families import CAUSAL_SETTING, LAYOUT_OVERRIDES, LAYOUTS, REFUSED
from tephra.engine_fsdp.model_builder import auto_class
from tephra.engine_fsdp.scorer import LOGITS_DIVIDED
from tephra.engine_fsdp.testing import padded_batch
from tephra.engine_fsdp.ulysses_families import ULYSSES_COLUMN, ULYSSES_LEGEND, ulysses_status

if TYPE_CHECKING:
    from tephra.engine_fsdp.engine import FSDPEngine

VOCAB = 256
"""Vocabulary of every tiny config (token ids of the test batches are below it)."""

SIZES: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 128,
    # the same sizes under other names: encoder-decoder families' decoders (BART, Marian,
    # Pegasus, ...), CTRL, CPM-Ant, Moshi, OPT
    "d_model": 64,
    "encoder_layers": 2,
    "decoder_layers": 2,
    "encoder_attention_heads": 4,
    "decoder_attention_heads": 4,
    "encoder_ffn_dim": 128,
    "decoder_ffn_dim": 128,
    "ffn_dim": 128,
    "dff": 128,
    "dim_ff": 128,
    # RoCBERT's glyph and pronunciation embeddings
    "shape_vocab_size": VOCAB,
    "pronunciation_vocab_size": VOCAB,
    "shape_embed_dim": 16,
    "pronunciation_embed_dim": 16,
    # per-layer token embeddings (Gemma 3n, Gemma 4)
    "vocab_size_per_layer_input": VOCAB,
    "hidden_size_per_layer_input": 16,
    # KV sharing (Gemma 3n) needs a producing layer of each kind before the sharing ones,
    # which 2 layers do not have
    "num_kv_shared_layers": 0,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    # sliding / chunked attention: shorter than the test's sequences, so the window bites
    "sliding_window": 4,
    "attention_chunk_size": 4,
    # mixture of experts: a dense first layer, then a routed one
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "num_experts_per_token": 2,
    "top_k_experts": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "n_group": 1,
    "topk_group": 1,
    "num_expert_group": 1,
    "first_k_dense_replace": 1,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    # multi-head latent attention
    "q_lora_rank": 32,
    "kv_lora_rank": 32,
    "qk_rope_head_dim": 16,
    "qk_nope_head_dim": 16,
    "qk_head_dim": 32,
    "v_head_dim": 32,
    # linear attention (Gated DeltaNet, KDA) and state-space layers
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_num_heads": 4,
    "linear_head_dim": 16,
    "state_size": 8,
    "ssm_state_size": 8,
    "mamba_d_state": 8,
    "mamba_n_heads": 8,
    "mamba_head_dim": 16,
    "mamba_n_groups": 1,
    "n_groups": 1,
    "time_step_rank": 8,
    "chunk_size": 8,
}
"""Sizes set on every family's config where the config has the attribute."""

_WINDOW_ON = {
    "use_sliding_window": True,
    "layer_types": ["full_attention", "sliding_attention"],
    "max_window_layers": 1,
}
"""A `SWITCHED_WINDOW` family's sliding window switched on (a full, then a sliding layer)."""

FAMILY_SIZES: dict[str, dict[str, Any]] = {
    **{f: dict(_WINDOW_ON) for f in ("qwen2", "qwen2_moe", "qwen3", "smollm3")},
    "qwen3_moe": {"use_sliding_window": True},  # every layer slides
    # its default leaves the shared expert's width unset (None), which its MoE multiplies
    "dots1": {"n_shared_experts": 1},
    # its default names no RoPE per layer type, which its rotary embedding looks up
    "cohere_compass_text": {
        "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0}},
        "logit_scale": 4.0,  # its default is None (no scaling): see the head's values below
    },
    # its default has attention layers only; the released LFM2 models mix in short
    # convolutions, which the matrix must see
    "lfm2": {"layer_types": ["conv", "full_attention"], "full_attn_idxs": [1]},
    # its default leaves the layer kinds unset (None), which every layer reads
    "lfm2_moe": {"layer_types": ["conv", "full_attention"]},
    # its QSA indexer's sizes are unset (None) by default, which the indexer divides
    "qwen4_exp_text": {
        "indexer_n_heads": 4,
        "indexer_kv_heads": 1,
        "indexer_head_dim": 16,
        "indexer_budget": 8,
        "indexer_compress_ratio": 4,
    },
    # validated: heads x head_dim = hidden x expand (64 x 2)
    "mamba2": {"num_heads": 8},
    # validated: one expert per token
    "zaya": {"num_experts_per_tok": 1},
    # rotary dimensions within the tiny head_dim 16 (their defaults, 64, exceed it)
    "codegen": {"rotary_dim": 8},
    "gptj": {"rotary_dim": 8},
    # its config refuses num_hidden_layers (`UNSET`): the decoder's count under its own name
    "prophetnet": {"num_encoder_layers": 2, "num_decoder_layers": 2},
    # a causal LM only as a decoder (transformers asserts it); its axial position embedding
    # factors the longest sequence (8 x 16 = max_position_embeddings) and the hidden size
    # (32 + 32); attention_head_size is its head_dim
    "reformer": {
        "is_decoder": True,
        "axial_pos_shape": [8, 16],
        "axial_pos_embds_dim": [32, 32],
        "attention_head_size": 16,
    },
    # its byte n-gram hash embeddings have a vocabulary of their own; the global
    # transformer's width is cross_attn_k (2) x the local encoder's, which the local models
    # read as hidden_size_global
    "blt": {
        "encoder_hash_byte_group_vocab": 64,
        "encoder_config": {"hidden_size_global": 128},
        "decoder_config": {"hidden_size_global": 128},
        "global_config": {"hidden_size": 128, "head_dim": 32},
    },
    # validated: a sliding layer's head_dim is its qk_nope_head_dim + qk_rope_head_dim
    # (24 scaled from 192, + 16), which the scaled per-layer override does not keep alone
    "dots3_note_text": {
        "per_layer_config": {
            "1": {
                "num_attention_heads": 2,
                "num_key_value_heads": 2,
                "kv_lora_rank": 64,
                "qk_nope_head_dim": 24,
                "head_dim": 40,
            }
        }
    },
    # validated: d_head = d_model / n_head
    "xlnet": {"d_head": 16},
    # its hybrid layers share one transformer block (tied across them), which transformers
    # refuses to tie with a single hybrid layer: both layers hybrid (a Mamba mixer and the
    # shared block each); its dt rank is sized by its own name. At the default
    # initialisation (0.02) its Mamba state carries so little that a packed row's leak from
    # one sequence into the next stays under 1e-5 on the test batch (7e-4 after a one-token
    # prompt): 0.1 makes it show (0.2 packed) and keeps the padded layout within 2e-6
    "zamba": {
        "layers_block_type": ["hybrid", "hybrid"],
        "mamba_dt_rank": 8,
        "initializer_range": 0.1,
    },
    # its vision tower's tiles, global layers and the layers it taps (their concatenation
    # is the projector's input); its second text layer a cross-attention one (the default
    # puts them from layer 3 on)
    "mllama": {
        "vision_config": {
            "image_size": 56,
            "num_global_layers": 1,
            "intermediate_layers_indices": [0],
            "vision_output_dim": 128,
        },
        "text_config": {"cross_attention_layers": [1]},
    },
    # its audio tower's convolutions have widths of their own; chunk_size (SIZES') is the
    # audio encoder's attention chunking there, off (-1) by default
    "phi4_multimodal": {
        "audio_config": {
            "num_blocks": 2,
            "ext_pw_out_channel": 64,
            "depthwise_separable_out_channel": 64,
            "nemo_conv_channels": 64,
            "chunk_size": -1,
        }
    },
    # sizes under its own names, in nested configs; its attention reads a rope_theta that
    # the default attention config lacks and clamps by clip_qkv, which it leaves None
    # (DBRX's released config clips at 8)
    "dbrx": {
        "d_model": 64,
        "n_heads": 4,
        "attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
        "ffn_config": {"moe_num_experts": 4, "moe_top_k": 2, "ffn_hidden_size": 32},
    },
    # the output head's scales and soft-caps (`scorer.head_transform_of`) at values the tiny
    # model's logits (about +-0.5) feel: the defaults are 1 (Granite, HyperCLOVA X, Falcon-H1,
    # Compass) or a cap of 30, which bends such logits by less than 1e-5
    **{f: {"logits_scaling": 0.25} for f in sorted(LOGITS_DIVIDED)},
    "hyperclovax": {"logits_scaling": 4.0},
    "falcon_h1": {"lm_head_multiplier": 4.0},
    **{
        f: {"final_logit_softcapping": 0.3}
        for f in ("beam", "gemma2", "gemma3n_text", "inkling2_text", "nanochat", "vaultgemma")
    },
    "recurrent_gemma": {"logits_soft_cap": 0.3},
    "xlstm": {"output_logit_soft_cap": 0.3},
}
"""Sizes of the families whose config `SIZES` does not reach, set on top of them."""


PREDICTION_HEAD = (
    "its output head runs a prediction transform (dense, activation, norm) before the output "
    "projection, which engine=fsdp's scorer does not run"
)
NO_LAYERS = (
    "it declares no decoder layer class (_no_split_modules), and its layers are not one "
    "repeated module either (parallel lists of attentions, feed-forwards and norms), so FSDP "
    "has no layer to shard"
)
VISION_UNSUPPORTED = (
    "its config has a vision tower (vision_config), so engine=fsdp builds its "
    "image-text-to-text model, and engine=fsdp has no vision adapter for its family "
    "(tephra.engine_api.multimodal.VISION_FAMILIES: LLaVA, Qwen2-VL, Qwen2.5-VL)"
)
BUILD_REFUSALS = {
    PREDICTION_HEAD: r"the output head runs a prediction transform",
    NO_LAYERS: r"found no decoder layers to shard",
    VISION_UNSUPPORTED: r"vision-language model_type '\w+' is not supported",
}
"""The engine's own refusals (at build, from the built model) -> its message."""

NOT_RUN: dict[str, tuple[str, str]] = {
    "bert": ("refused", PREDICTION_HEAD),
    "big_bird": ("refused", PREDICTION_HEAD),
    "camembert": ("refused", PREDICTION_HEAD),
    "data2vec-text": ("refused", PREDICTION_HEAD),
    "electra": ("refused", PREDICTION_HEAD),
    "ernie": ("refused", PREDICTION_HEAD),
    "gemma4_assistant": (
        "not buildable",
        "it is Gemma 4's speculative-decoding assistant, not a language model of its own: its "
        "forward ignores input_ids and takes the target model's hidden states (inputs_embeds, "
        "backbone_hidden_size wide) and the key/value states the target shares with every one "
        "of its layers; transformers' default config also fails its own validation "
        "(hidden_size_per_layer_input must be 0)",
    ),
    "git": ("refused", VISION_UNSUPPORTED),
    "megatron-bert": ("refused", PREDICTION_HEAD),
    "mllama": ("refused", VISION_UNSUPPORTED),
    "modernbert-decoder": ("refused", PREDICTION_HEAD),
    "musicgen": (
        "not buildable",
        "its causal LM (MusicgenForCausalLM) decodes num_codebooks parallel streams of audio "
        "codes with one output head each (lm_heads), and is built from the nested decoder "
        "config (musicgen_decoder), which AutoModelForCausalLM does not map; from the "
        "musicgen config it maps, transformers raises AttributeError ('MusicgenConfig' "
        "object has no attribute 'dropout')",
    ),
    "musicgen_melody": (
        "not buildable",
        "its causal LM (MusicgenMelodyForCausalLM) decodes num_codebooks parallel streams of "
        "audio codes with one output head each (lm_heads), and is built from the nested "
        "decoder config (musicgen_melody_decoder), which AutoModelForCausalLM does not map; "
        "from the musicgen_melody config it maps, transformers raises AttributeError "
        "('MusicgenMelodyConfig' object has no attribute 'dropout')",
    ),
    "phi4_multimodal": ("refused", VISION_UNSUPPORTED),
    "reformer": (
        "error",
        "in train mode its axial position embeddings take rows of exactly "
        "prod(axial_pos_shape) tokens (transformers raises ValueError on any other length), "
        "which engine=fsdp's micro-batches (padded to their longest row, or packed) are not",
    ),
    "rembert": ("refused", PREDICTION_HEAD),
    "roberta": ("refused", PREDICTION_HEAD),
    "roberta-prelayernorm": ("refused", PREDICTION_HEAD),
    "roc_bert": ("refused", PREDICTION_HEAD),
    "roformer": ("refused", PREDICTION_HEAD),
    "xlm": ("refused", NO_LAYERS),
    "xlm-roberta": ("refused", PREDICTION_HEAD),
    "xlm-roberta-xl": ("refused", PREDICTION_HEAD),
    "xlnet": (
        "error",
        "transformers' XLNet forward (attn_type: uni) adds a padded batch's mask to its causal "
        "mask in place, and the causal mask's batch dimension is 1: RuntimeError on any "
        "padded micro-batch of more than one row",
    ),
    "xmod": ("refused", PREDICTION_HEAD),
}

"""model_type -> (status, reason) of the families not run through the layouts: `refused`
(the engine refuses them when it builds them: `BUILD_REFUSALS`), `not buildable` (no tiny
model: transformers fails on the tiny config, or it stays large) or `error` (the engine
fails loudly on them)."""


def causal_lm_families() -> list[str]:
    """Every model type the installed transformers maps to a `*ForCausalLM` class, sorted."""
    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _two_kinds(values: list[Any]) -> list[int]:
    """The two layers a per-layer list keeps: the first of each of its first two kinds
    (layers 0 and 1 when it has one kind), in layer order."""
    firsts: list[int] = []
    for i, v in enumerate(values):
        if all(values[j] != v for j in firsts):
            firsts.append(i)
        if len(firsts) == 2:
            break
    if len(firsts) == 1:
        firsts = [0, min(1, len(values) - 1)]
    return firsts


def _settable(default: PretrainedConfig, data: dict[str, Any], key: str) -> bool:
    """Whether the config takes `key`: a field of its own (`to_dict`), an alias of one
    (`attribute_map`) or a property with a setter (LongCat-Flash's `num_hidden_layers`);
    not a read-only property such as Falcon's `head_dim`. Decided without reading the
    field: a heterogeneous config (Gemma 4) refuses reading a per-layer one."""
    prop = getattr(type(default), key, None)
    settable = isinstance(prop, property) and prop.fset is not None
    return key in data or key in getattr(default, "attribute_map", {}) or settable


def _scaled(value: Any, default_value: Any, tiny: Any) -> Any:
    """A per-layer override of a size, scaled as the tiny size `tiny` scales the family's
    global one (Gemma 4's full-attention layers' head_dim 512 against 256 -> 32); other
    overrides as they are."""
    numbers = (value, default_value, tiny)
    if not all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in numbers):
        return value
    return max(1, round(tiny * value / default_value))


def _tiny(default: PretrainedConfig) -> dict[str, Any]:
    """The keyword arguments that make `default` (a family's default config) tiny."""
    data = default.to_dict()
    kwargs = {k: v for k, v in SIZES.items() if _settable(default, data, k)}
    layers = getattr(default, "num_hidden_layers", None)  # through an alias (GPT-Neo's)
    kept = [0, 1]  # the layers a per-layer list keeps (`layer_types` decides first)
    if layers and isinstance(data.get("layer_types"), list) and len(data["layer_types"]) == layers:
        kept = _two_kinds(data["layer_types"])
    for key, value in data.items():
        if isinstance(value, list) and layers and len(value) == layers and layers > 2:
            index = kept if key == "layer_types" else _two_kinds(value)
            # a per-layer size (Gemma 3n's intermediate_size) takes the tiny size
            kwargs[key] = [SIZES[key]] * 2 if key in SIZES else [value[i] for i in index]
        if "dropout" in key or "pdrop" in key:
            kwargs[key] = 0.0
    if "kv_lora_rank" in kwargs:  # MLA expands its latent keys to every query head
        kwargs["num_key_value_heads"] = SIZES["num_attention_heads"]
    overrides = data.get("per_layer_config")
    if isinstance(overrides, dict) and overrides and layers and layers > 2:
        # per-layer overrides (Gemma 4's `{"05": {"head_dim": 512}}`) follow their layers to
        # the kept positions, their sizes scaled like the global ones
        kwargs["per_layer_config"] = {
            str(new): {k: _scaled(v, data.get(k), kwargs.get(k)) for k, v in overrides[key].items()}
            for new, old in enumerate(kept)
            for key in overrides
            if int(key) == old
        }
    return kwargs


def text_family(model_type: str) -> str | None:
    """The text model type inside a composite (vision-language) family, where transformers
    also maps it to a causal LM (`qwen3_5` -> `qwen3_5_text`); None for a text family."""
    try:
        default = AutoConfig.for_model(model_type)
        text = default.get_text_config()
    except Exception:  # no valid default config, or several text configs (encoder, decoder)
        return None
    if text is default or text.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return None
    return str(text.model_type)


UNSET: dict[str, tuple[str, ...]] = {
    "prophetnet": ("num_hidden_layers",),  # raises: set num_decoder_layers instead
    "xlnet": ("max_position_embeddings",),  # raises: it has no sequence length limit
}
"""`SIZES` a family's config refuses to take (its setter raises), left out of its tiny
config."""

NESTED_SIZES: dict[str, tuple[str, ...]] = {
    "blt": ("patcher_config", "encoder_config", "decoder_config", "global_config"),
    "mllama": ("text_config", "vision_config"),
    "emu3": ("text_config",),
    "git": ("vision_config",),
    "phi4_multimodal": ("vision_config", "audio_config"),
}
"""The nested configs a family's causal LM builds (its decoder's sizes, or a tower it
always builds) that `SIZES` does not reach at the top level: made tiny the same way (their
`FAMILY_SIZES` entries are merged into them)."""


def tiny_config(model_type: str) -> dict[str, Any]:
    """The tiny `hf_config` dict of `model_type` (see the module docstring)."""
    default = AutoConfig.for_model(model_type)
    tiny = {k: v for k, v in _tiny(default).items() if k not in UNSET.get(model_type, ())}
    nested = NESTED_SIZES.get(model_type, ())
    for key in nested:
        sub = getattr(default, key)
        tiny[key] = {**sub.to_dict(), **_tiny(sub)}
    for key, value in FAMILY_SIZES.get(model_type, {}).items():
        tiny[key] = {**tiny[key], **value} if key in nested else value
    if model_type in CAUSAL_SETTING:  # a causal LM only so (BERT-style decoders, XLNet)
        field, value = CAUSAL_SETTING[model_type]
        tiny[field] = value
    return {"model_type": model_type, **tiny}


MAX_PARAMETERS = 2_000_000
"""A tiny config above this many parameters kept a large part the sizes do not reach."""


class NotTiny(Exception):
    """The family's config could not be made tiny (or its model not built from it)."""


def parameter_count(hf_config: dict[str, Any]) -> int:
    """Parameters of the family's causal LM for `hf_config`, counted on the meta device
    (nothing allocated)."""
    data = dict(hf_config)
    config = AutoConfig.for_model(data.pop("model_type"), **data)
    with torch.device("meta"):
        model = auto_class(config, "policy").from_config(config)
    return sum(p.numel() for p in model.parameters())


def build_reference(hf_config: dict[str, Any]) -> PreTrainedModel:
    """The family's plain transformers causal LM (eager attention, float32, eval mode): the
    class the engine builds (`auto_class`; image-text-to-text where the config has a vision
    tower, e.g. GIT, Mllama)."""
    data = dict(hf_config)
    config = AutoConfig.for_model(data.pop("model_type"), **data)
    model: PreTrainedModel = auto_class(config, "policy").from_config(
        config, dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


def test_batch(seed: int = 0) -> TensorDict:
    """GRPO-shaped rows: 2 prompts (left-padded, 4-8 tokens) with 3 responses each
    (right-padded, 2-7 tokens), so that shared-prefix micro-batches share."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, VOCAB, (int(n),), generator=g) for n in (5, 8)]
    rows = [
        (p, torch.randint(3, VOCAB, (int(torch.randint(2, 8, (1,), generator=g)),), generator=g))
        for p in prompts
        for _ in range(3)
    ]
    return padded_batch(rows)


def reference_outputs(model: torch.nn.Module, batch: TensorDict) -> dict[str, torch.Tensor]:
    """Log-probs and entropy `[b, t]` (aligned to tokens, 0 off the response) from the plain
    model run on each sequence alone: no padding, no mask, positions 0.. ."""
    attn = batch[B.ATTENTION_MASK].bool()
    resp = batch[B.RESPONSE_MASK].bool()
    lp = torch.zeros(attn.shape)
    ent = torch.zeros(attn.shape)
    with torch.no_grad():
        for i in range(attn.shape[0]):
            cols = attn[i].nonzero()[:, 0]
            ids = batch[B.INPUT_IDS][i, cols][None]
            logits = model(input_ids=ids, use_cache=False).logits[0].float()
            logp = torch.log_softmax(logits, -1)
            token_lp = logp[:-1].gather(-1, ids[0, 1:, None])[:, 0]
            token_ent = -(logp.exp() * logp).sum(-1)[:-1]
            keep = resp[i, cols[1:]]
            lp[i, cols[1:][keep]] = token_lp[keep]
            ent[i, cols[1:][keep]] = token_ent[keep]
    return {"log_probs": lp, "entropy": ent}


ADVANTAGES = (1.0, -0.5, 0.25, -1.0, 0.5, 0.75)
"""Fixed advantage of each `test_batch` row (a GRPO group of 3 per prompt) for the update."""

ENTROPY_COEFF = 0.1
"""The update's entropy bonus: its gradient goes through the engine's entropy too."""

UPDATE_TOKENS_PER_MICROBATCH = 42
"""`micro_batch.max_tokens_per_microbatch` of the update: `test_batch`'s rows (10-14 tokens)
run in 2 micro-batches of unequal token counts (a prompt's 3 rows each, padded or
shared-prefix; rows 0-3 and 4-5 packed), so each micro-batch's loss needs the step's global
normaliser. `forward` keeps one micro-batch (`forward_max_tokens_per_microbatch`)."""


def update_batch(batch: TensorDict) -> TensorDict:
    """`batch` with each row's `ADVANTAGES` value on its response tokens (`advantages`)."""
    out = batch.copy()
    adv = torch.tensor(ADVANTAGES[: batch.batch_size[0]], dtype=torch.float32)
    out["advantages"] = adv[:, None] * batch[B.RESPONSE_MASK].float()
    return out


def update_loss(outputs: TensorDict, batch: TensorDict) -> tuple[torch.Tensor, dict[str, float]]:
    """The GRPO policy gradient at the sampling policy (importance ratio 1, so no clipping)
    with an entropy bonus, token-mean over the step: this micro-batch's part

        sum_{b,t} m (-A_b log pi - ENTROPY_COEFF H) / N

    with N = `global_token_count` (the step's response tokens over every micro-batch), as
    `tephra.algos.ActorObjective` aggregates its terms."""
    mask = batch[B.RESPONSE_MASK].float()
    per_token = -batch["advantages"] * outputs["log_probs"] - ENTROPY_COEFF * outputs["entropy"]
    loss = (per_token * mask).sum() / batch[B.GLOBAL_TOKEN_COUNT][0]
    return loss, {"update_loss": Share(float(loss.detach()))}


def reference_gradients(
    model: torch.nn.Module, batch: TensorDict, train: bool = True
) -> dict[str, torch.Tensor]:
    """Every parameter's gradient (zeros where none) of `update_loss`'s step recomputed on
    the plain model (in train mode, as the engine trains, unless `train` is False), one
    sequence alone at a time: each sequence's `sum_t (-A log pi - ENTROPY_COEFF H) / N` with
    N the batch's response tokens, back-propagated and summed."""
    attn = batch[B.ATTENTION_MASK].bool()
    resp = batch[B.RESPONSE_MASK].bool()
    tokens = float(resp.sum())
    was_training = model.training
    model.train(train)
    model.zero_grad(set_to_none=True)
    try:
        for i in range(attn.shape[0]):
            cols = attn[i].nonzero()[:, 0]
            ids = batch[B.INPUT_IDS][i, cols][None]
            logits = model(input_ids=ids, use_cache=False).logits[0].float()
            logp = torch.log_softmax(logits, -1)[:-1]
            token_lp = logp.gather(-1, ids[0, 1:, None])[:, 0]
            token_ent = -(logp.exp() * logp).sum(-1)
            keep = resp[i, cols[1:]]
            per_token = -ADVANTAGES[i] * token_lp - ENTROPY_COEFF * token_ent
            (per_token[keep].sum() / tokens).backward()
        grads = {
            n: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone()
            for n, p in model.named_parameters()
        }
    finally:
        model.zero_grad(set_to_none=True)
        model.train(was_training)
    return grads


def engine_gradients(engine: FSDPEngine) -> dict[str, torch.Tensor]:
    """Every parameter's accumulated gradient in the engine, gathered whole (zeros where
    none), by its name in the transformers model."""
    out = {}
    for n, p in engine.hf_model.named_parameters():
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        out[n] = (g.full_tensor() if isinstance(g, DTensor) else g).detach().cpu().clone()
    return out


def gradient_gap(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> tuple[float, str]:
    """The largest gradient difference over every parameter, and its parameter: absolute,
    except for a parameter whose largest reference gradient exceeds 1, where it is divided
    by that (RWKV's embedding gradients reach 119 in float32; 1e-5 is then rounding)."""
    if got.keys() != want.keys():
        raise AssertionError(
            f"engine parameters {sorted(got.keys() ^ want.keys())} are not the plain model's"
        )
    gap, where = 0.0, ""
    for name, g in want.items():
        if not g.numel():
            continue
        d = float((got[name] - g).abs().max()) / max(1.0, float(g.abs().max()))
        if not math.isfinite(d):
            return math.inf, name
        if d > gap:
            gap, where = d, name
    return gap, where


SAMPLED_ROUTING = {
    "phimoe": "its SparseMixer router samples its experts and a random estimate of their "
    "gradient in train mode; engine=fsdp trains it with the router in eval mode (the top 2 "
    "by score, the gates' plain gradient: the routing its old log-probs came from, unlike "
    "its pre-training recipe), so its update is compared with the plain model's in eval mode",
}
"""Families whose router samples in train mode -> how their update is checked. The engine
trains them with the router deterministic (`tephra.engine_fsdp.router_noise`); the matrix
compares the engine's update (in train mode) with the plain model's in eval mode."""


def attention(model_type: str) -> str:
    """`sdpa` where the family's causal LM supports it, else `eager` (Gemma 2's soft-capped
    attention scores, gpt-oss's sinks: transformers runs them eagerly)."""
    config = AutoConfig.for_model(model_type)
    cls = _causal_lm_class(config)
    return "sdpa" if getattr(cls, "_supports_sdpa", False) else "eager"


def _causal_lm_class(config: PretrainedConfig) -> type:
    # transformers annotates the lazy mapping's values as the tokenizer mapping's pairs; a
    # model mapping holds one class per config class
    return AutoModelForCausalLM._model_mapping[type(config)]  # type: ignore[return-value]


def engine_config(
    model_type: str, layout: str, changes: dict[str, Any] | None = None
) -> EngineConfig:
    """A float32 CPU engine config of the family's tiny model in `layout` (its config
    fields `changes` set on top of the tiny sizes)."""
    hf_config = {**tiny_config(model_type), **(changes or {})}
    model = ModelConfig(hf_config=hf_config, init_seed=0, attn_implementation=attention(model_type))
    base = EngineConfig(model=model, device="cpu")
    budgets = {
        "micro_batch.max_tokens_per_microbatch": UPDATE_TOKENS_PER_MICROBATCH,
        "micro_batch.forward_max_tokens_per_microbatch": 8192,
    }
    return apply_overrides(base, {**budgets, **LAYOUT_OVERRIDES[layout]})


@dataclass
class LayoutCheck:
    """One family in one layout: the engine's refusal (None when it runs the layout) and the
    largest log-prob and entropy gaps to the reference over response tokens, of an engine
    built past the refusal (so a test can show the refusal is needed); in a layout the
    engine runs, the largest gradient gap of one update (`update_loss`) to
    `reference_gradients` over every parameter, and that parameter (None in a refused
    layout), and the largest reference gradient (what the gap is measured against)."""

    refusal: str | None
    log_probs: float
    entropy: float
    gradients: float | None = None
    worst_parameter: str = ""
    gradient_scale: float = 0.0

    def matches(self, tol: float = 1e-5) -> bool:
        update = self.gradients is None or self.gradients <= tol
        return self.log_probs <= tol and self.entropy <= tol and update


def check_family(
    model_type: str, layouts: tuple[str, ...] = LAYOUTS, changes: dict[str, Any] | None = None
) -> dict[str, LayoutCheck]:
    """Run the family's tiny model (with its config fields `changes`) through
    `FSDPEngine.forward` in each of `layouts` and compare with `reference_outputs` of the
    engine's exported weights; in each layout the engine does not refuse, one
    `FSDPEngine.forward_backward` of `update_loss` too, compared with `reference_gradients`.
    Raises `NotTiny` when the tiny config stays large, and whatever transformers or the
    engine raise."""
    # imported here: the engine module pulls in FSDP, which the support table does not need
    from tephra.engine_fsdp.engine import FSDPEngine

    count = parameter_count(tiny_config(model_type))
    if count > MAX_PARAMETERS:
        raise NotTiny(f"even its tiny config has {count:,} parameters")
    batch = test_batch()
    resp = batch[B.RESPONSE_MASK].bool()
    update = update_batch(batch)
    sampled = SAMPLED_ROUTING.get(model_type)
    out: dict[str, LayoutCheck] = {}
    reference: dict[str, torch.Tensor] | None = None
    want_grads: dict[str, torch.Tensor] | None = None
    for layout in layouts:
        config = engine_config(model_type, layout, changes)
        refusal = None
        try:
            FSDPEngine.check_config(config)
        except ConfigError as exc:
            refusal = str(exc)
        if reference is None:
            padded = FSDPEngine(engine_config(model_type, "padded", changes))
            plain = _reference_with(padded)
            reference = reference_outputs(plain, batch)
            want_grads = reference_gradients(plain, update, train=sampled is None)
        try:
            engine = FSDPEngine(config)  # past the refusal: what the layout would compute
            with engine.eval_mode():
                got = engine.forward(batch)
        except Exception:
            if refusal is None:
                raise
            out[layout] = LayoutCheck(refusal, math.inf, math.inf)  # refused: it fails too
            continue
        gaps = [float((got[k] - reference[k])[resp].abs().max()) for k in ("log_probs", "entropy")]
        gaps = [g if math.isfinite(g) else math.inf for g in gaps]
        assert want_grads is not None
        scale = max(float(g.abs().max()) for g in want_grads.values() if g.numel())
        grad_gap, worst = None, ""
        if refusal is None:  # the update of a layout the engine runs
            with engine.train_mode():
                engine.forward_backward(update, update_loss)
            grad_gap, worst = gradient_gap(engine_gradients(engine), want_grads)
        out[layout] = LayoutCheck(refusal, gaps[0], gaps[1], grad_gap, worst, scale)
    return out


def _reference_with(engine: FSDPEngine) -> PreTrainedModel:
    """The plain model holding the engine's exported weights (every one must fit)."""
    hf_config = engine.config.model.hf_config
    assert hf_config is not None  # the matrix builds every engine from a config dict
    model = build_reference(hf_config)
    state = {n: t for bucket in engine.export_weights() for n, t in bucket}
    missing, unexpected = model.load_state_dict(state, strict=False)
    # a tied head is the embedding under a second name (`lm_head`, GPT-NeoX-Japanese's
    # `embed_out`, TrOCR's `output_projection`): the export holds it once
    every = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    tied = every - {n for n, _ in model.named_parameters()}
    if set(missing) - tied or unexpected:
        raise AssertionError(f"exported weights: missing {missing}, unexpected {unexpected}")
    return model


# ----- the support table ---------------------------------------------------------------
@dataclass
class Row:
    """One family of the support table: a status per layout, and what it was checked as."""

    model_type: str
    statuses: dict[str, str]
    checked_as: str | None = None
    """A vision-language family's text family, whose tiny model the matrix runs."""


def status(model_type: str, layout: str) -> str:
    """`Y`, `Y (how its update is checked)` (`SAMPLED_ROUTING`), `refused (reason)`, `not
    buildable (reason)` or `error (reason)` of a text family in `layout`, from the tables the
    family matrix test keeps true."""
    if model_type in NOT_RUN:
        kind, why = NOT_RUN[model_type]
        return f"{kind} ({why})"
    refusal = REFUSED.get(model_type, {}).get(layout) or REFUSED.get(model_type, {}).get("padded")
    if refusal:
        return f"refused ({refusal})"
    return f"Y ({SAMPLED_ROUTING[model_type]})" if model_type in SAMPLED_ROUTING else "Y"


def support_table() -> list[Row]:
    """Every causal-LM family of the installed transformers, with its statuses."""
    rows = []
    for model_type in causal_lm_families():
        text = text_family(model_type)
        target = text or model_type
        statuses = {lay: status(target, lay) for lay in LAYOUTS}
        statuses[ULYSSES_COLUMN] = ulysses_status(target, statuses["packed"])
        rows.append(Row(model_type, statuses, text))
    return rows


def render_markdown(command: str) -> str:
    """docs/models.md: the support table (see `support_table`)."""
    import transformers  # the version the table was checked against

    rows = support_table()
    full = sum(all(r.statuses[lay].startswith("Y") for lay in LAYOUTS) for r in rows)
    head = [
        "# Model families on engine=fsdp",
        "",
        f"Generated by `{command}` from the tables in `tephra.engine_fsdp.families` and",
        "`tephra.engine_fsdp.family_matrix`, which the family matrix test keeps true; do not edit",
        f"by hand. transformers {transformers.__version__}: {len(rows)} model types with a causal LM, "
        f"{full} of them right in every layout.",
        "",
        "**Y**: the family's tiny model (2 layers, hidden 64, its special parts on: mixture of",
        "experts, sliding windows, linear-attention layers, multi-head latent attention, sinks)",
        "gives, through `FSDPEngine.forward`, the log-probs and entropy of a plain transformers",
        "forward of each sequence alone within 1e-5 (float32), and through",
        "`FSDPEngine.forward_backward` the gradient of every parameter of one GRPO-style update",
        "(policy gradient with fixed per-sequence advantages and an entropy bonus, token-mean",
        "over the step's global token count, in 2 micro-batches) that the plain model gives",
        "back-propagating each sequence alone, within 1e-5 (relative to the parameter's largest",
        "gradient where that exceeds 1); the weights it exports load into the plain model. A",
        "numbered **Y** says how the update is checked instead. **refused**: the engine raises a",
        "`ConfigError` naming the family, the layout and the fix (before Ray starts in the apps);",
        "left to the engine (`null`), `micro_batch.use_packing` and `share_prefix` avoid a refused",
        "layout. **not buildable**: no tiny model of it could be built here. **error**: the",
        "engine fails on it loudly.",
        "",
        "Layouts: **padded** (`micro_batch.use_packing=false`), **packed**",
        "(`micro_batch.use_packing=true`; also Ulysses, `parallel.context>1`), **shared prefix**",
        "(`micro_batch.share_prefix=true`: a prompt's samples run the prompt once).",
        "",
        "A vision-language family is checked through its text family (its own row) and refused",
        "where that one is; its config with a vision tower (`vision_config`) trains only where",
        "engine=fsdp has a vision adapter for the family (LLaVA, Qwen2-VL, Qwen2.5-VL) and is",
        "refused before anything is built otherwise. A sliding-window refusal applies only while the window is on: a",
        "config with `sliding_window: null` (or 0, or `use_sliding_window: false`) is plain",
        "causal attention and runs every layout; Qwen2, Qwen2-MoE, Qwen3, Qwen3-MoE and SmolLM3",
        "slide only with `use_sliding_window: true` (their tiny models here switch it on).",
        "The numbers point to the reasons under the table.",
        "",
        *ULYSSES_LEGEND,
        "",
        f"| model_type | padded | packed | shared prefix | {ULYSSES_COLUMN} |",
        "|---|---|---|---|---|",
    ]
    body: list[str] = []
    reasons: dict[str, int] = {}  # reason -> its number, in order of first use

    def cell(text: str) -> str:
        if text == "Y":
            return text
        kind, why = text.split(" (", 1)
        n = reasons.setdefault(why[:-1], len(reasons) + 1)
        return f"{kind} [{n}]"

    for r in rows:
        name = f"`{r.model_type}`" + (f" (text: `{r.checked_as}`)" if r.checked_as else "")
        body.append(f"| {name} | " + " | ".join(cell(v) for v in r.statuses.values()) + " |")
    body += ["", "## Reasons", ""]
    body += [f"{n}. {why}" for why, n in reasons.items()]
    return "\n".join(head + body) + "\n"
