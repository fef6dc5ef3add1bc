"""Build the Hugging Face module an engine trains: a causal LM (policy) or a backbone with a
scalar head (value), from a local folder or a config dict, with LoRA when asked.

The value model is transformers' `AutoModelForTokenClassification` with `num_labels=1`: the
backbone under its usual prefix (`model.`) and a linear head named `score` (`score.weight`
[1, hidden], `score.bias` [1]). An exported critic is therefore a plain transformers folder
that `AutoModelForTokenClassification.from_pretrained` loads.

transformers has no token-classification class for vision-language models, so a VLM's value
model is its image-text-to-text model with `lm_head` replaced by the same `score` head
(`vision_value_head`): the backbone still takes the pixels, and an export is the VLM folder
with `score.*` in place of `lm_head.*`, which `build_model` reads back.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoModelForTokenClassification,
    PretrainedConfig,
    PreTrainedModel,
)

from tephra.engine_api.config import ModelConfig
from tephra.engine_api.errors import ConfigError

VALUE_HEAD = "score"
"""Name of the value head module (`score.weight`, `score.bias` in exports)."""


def load_hf_config(cfg: ModelConfig) -> PretrainedConfig:
    """The transformers config of `cfg`, or a `ConfigError` naming `model.path`/`hf_config`."""
    if cfg.path is not None:
        folder = Path(cfg.path)
        if not (folder / "config.json").is_file():
            what = "does not exist" if not folder.exists() else "has no config.json"
            raise ConfigError(
                f"model.path={cfg.path!r} {what}; point model.path at a local Hugging Face "
                "folder (config.json + *.safetensors), or set model.hf_config instead"
            )
        try:
            return AutoConfig.from_pretrained(folder, trust_remote_code=cfg.trust_remote_code)
        except (ValueError, KeyError, OSError) as exc:
            raise ConfigError(
                f"model.path={cfg.path!r}: transformers cannot read its config.json ({exc}); "
                "the model type may be unsupported by the installed transformers "
                "(or needs model.trust_remote_code=True)"
            ) from exc
    assert cfg.hf_config is not None  # ModelConfig holds exactly one of path and hf_config
    data = dict(cfg.hf_config)
    model_type = data.pop("model_type")
    try:
        return AutoConfig.for_model(model_type, **data)
    except (ValueError, KeyError) as exc:
        raise ConfigError(
            f"model.hf_config: model_type={model_type!r} is not usable: {exc}"
        ) from exc


AutoClass = type[
    AutoModelForCausalLM | AutoModelForTokenClassification | AutoModelForImageTextToText
]


def auto_class(hf_config: PretrainedConfig, role: str) -> AutoClass:
    """The transformers auto class the engine builds `hf_config`'s model with: the causal
    LM (policy) or token classification (value); for a vision-language model (a
    `vision_config`), image-text-to-text in both roles (its critic is that model with a
    value head, `vision_value_head`)."""
    if getattr(hf_config, "vision_config", None) is not None:
        return AutoModelForImageTextToText
    return AutoModelForCausalLM if role == "policy" else AutoModelForTokenClassification


def build_model(cfg: ModelConfig) -> PreTrainedModel:
    """Instantiate the float32 model of `cfg` on CPU (sharding moves it afterwards).

    Random initialisation (a config dict, or the value head of a folder that has none) is
    drawn from `cfg.init_seed` without touching the global RNG stream.
    """
    hf_config = load_hf_config(cfg)
    auto = auto_class(hf_config, cfg.role)
    if cfg.role == "value":
        hf_config.num_labels = 1
        # the critic is deterministic: no dropout between the backbone and the head
        hf_config.classifier_dropout = 0.0
    kwargs = dict(
        attn_implementation=cfg.attn_implementation, trust_remote_code=cfg.trust_remote_code
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.init_seed)
        try:
            if cfg.path is not None:
                model = auto.from_pretrained(
                    cfg.path, config=hf_config, dtype=torch.float32, **kwargs
                )
            else:
                model = auto.from_config(hf_config, dtype=torch.float32, **kwargs)
        except (ValueError, KeyError, OSError, ImportError) as exc:
            where = f"model.path={cfg.path!r}" if cfg.path else "model.hf_config"
            raise ConfigError(
                f"{where}: cannot build a {cfg.role} model ({auto.__name__}) from it: {exc}"
            ) from exc
        if cfg.role == "value" and auto is AutoModelForImageTextToText:
            vision_value_head(model, cfg.path)
    if cfg.gradient_checkpointing:
        # non-reentrant checkpointing composes with FSDP2 hooks and frozen (LoRA) weights
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(
                activation_checkpointing_kwargs={"use_reentrant": False}
            )
        else:  # transformers before the rename
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
    model.config.use_cache = False
    return model


def vision_value_head(model: PreTrainedModel, path: str | None) -> None:
    """Turn a vision-language model (built under the caller's seeded RNG) into a critic, in
    place: `lm_head` becomes `score` (Linear(hidden, 1) with a bias, drawn as
    transformers draws a token-classification head: N(0, initializer_range), bias 0), read
    back from `path`'s safetensors where an exported critic holds `score.*`."""
    text = model.config.get_text_config()
    head = nn.Linear(int(text.hidden_size), 1)
    with torch.no_grad():
        head.weight.normal_(0.0, float(text.initializer_range))
        head.bias.zero_()
    saved = _saved_tensors(Path(path), VALUE_HEAD) if path is not None else {}
    if saved:
        head.load_state_dict(saved)
    # the value head replaces the vocabulary head: nothing ties to it any more
    model.lm_head = None
    model._tied_weights_keys = {}
    model.config.tie_word_embeddings = False
    model.add_module(VALUE_HEAD, head)


def _saved_tensors(folder: Path, module: str) -> dict[str, torch.Tensor]:
    """The tensors `<module>.*` in a folder's safetensors files, keyed without the prefix."""
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for key in st.keys():
                if key.startswith(module + "."):
                    out[key[len(module) + 1 :]] = st.get_tensor(key)
    return out


def backbone(model: PreTrainedModel) -> nn.Module:
    """The decoder stack that returns the last hidden state (`model.model` for Llama/Qwen).
    Llama 4's text causal LM names the vision model's prefix (`language_model`) but keeps
    its decoder under `model`."""
    inner = getattr(model, model.base_model_prefix, None)
    if not isinstance(inner, nn.Module):
        inner = model.model
    assert isinstance(inner, nn.Module)
    return inner


def decoder_layers(model: nn.Module, where: str) -> list[nn.Module]:
    """Modules FSDP shards one by one: those whose class the model declares unsplittable
    (`_no_split_modules`, e.g. `Qwen2DecoderLayer`); where it declares none (CTRL, BioGPT,
    the BERT-style decoders), its `repeated_blocks`."""
    hf = model
    while not isinstance(hf, PreTrainedModel) and isinstance(
        inner := getattr(hf, "model", None), nn.Module
    ):
        hf = inner
    names = set(getattr(hf, "_no_split_modules", None) or [])
    if not names:
        return repeated_blocks(model, where)
    found = [m for m in model.modules() if type(m).__name__ in names]
    # a declared class inside another (Mamba's MambaMixer in its MambaBlock) stays in its
    # layer's unit: sharding the outer layer first would leave the inner one's parameters
    # sharded when its forward runs
    inner = {id(c) for m in found for c in m.modules() if c is not m}
    layers = [m for m in found if id(m) not in inner]
    if not layers:
        raise ConfigError(
            f"{where}: found no decoder layers to shard (the model class declares "
            f"_no_split_modules={sorted(names)}); this architecture is not supported by engine=fsdp"
        )
    return layers


def repeated_blocks(model: nn.Module, where: str) -> list[nn.Module]:
    """The layers of a model that declares no `_no_split_modules`: the members of its
    outermost `nn.ModuleList`s of one repeated class with parameters (`transformer.h`,
    `model.decoder.layers`, a vision tower's `encoder.layers` beside them; an MoE layer's
    expert list sits inside a layer, so it is not outermost). Lists of different classes
    side by side in one module (XLM's `attentions`, `ffns`, `layer_norm1`, ... one entry
    per layer each) leave no module that is a layer: a `ConfigError`."""
    lists = [
        m
        for m in model.modules()
        if isinstance(m, nn.ModuleList)
        and len(m)
        and len({type(block) for block in m}) == 1
        and any(True for _ in m.parameters())
    ]
    nested = {id(c) for blocks in lists for block in blocks for c in block.modules()}
    outer = [blocks for blocks in lists if id(blocks) not in nested]
    named = {id(m): n for n, m in model.named_modules()}
    siblings: dict[str, set[str]] = {}
    for blocks in outer:
        parent = named[id(blocks)].rpartition(".")[0]
        siblings.setdefault(parent, set()).add(type(blocks[0]).__name__)
    if not outer or any(len(classes) > 1 for classes in siblings.values()):
        found = ", ".join(f"{named[id(b)]} ({type(b[0]).__name__})" for b in outer) or "none"
        raise ConfigError(
            f"{where}: found no decoder layers to shard: the model class declares no "
            f"_no_split_modules and its repeated blocks are not layers (module lists of "
            f"different classes side by side: {found}); this architecture is not supported "
            "by engine=fsdp"
        )
    return [block for blocks in outer for block in blocks]
