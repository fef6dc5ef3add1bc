"""Images in prompts (vision-language models of the Qwen2-VL family).

A prompt with images is its token ids (each image already expanded to its run of
`<|image_pad|>` tokens) plus a `MultimodalInputs` (pixel values and grids; defined in
`tephra.engine_api.multimodal` and re-exported here). The two travel together from the data
loader through rollout to the trainer. `VisionProcessor` makes them from text and images.

`build_tiny_vlm` saves a tiny random Qwen2-VL with its tokenizer and image processor, for
tests and smoke runs (no pretrained VLM is needed).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tephra.engine_api.errors import ConfigError
from tephra.engine_api.multimodal import (  # noqa: F401  (re-exported: the rollout-side API)
    MultimodalInputs,
    check_image_tokens,
    hf_model_kwargs,
    image_token_id,
    is_vision_config,
    mm_token_type_ids,
)

VISION_TOKENS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>")
"""Qwen2-VL's vision special tokens: an image is `<|vision_start|>` + n x `<|image_pad|>` +
`<|vision_end|>` (n = patches / merge_size**2)."""


def vision_token_ids(tokenizer: Any) -> dict[str, int]:
    """Ids of the vision tokens in `tokenizer`; an error says how to add them."""
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS[:3]}
    unk = getattr(tokenizer, "unk_token_id", None)
    missing = [t for t, i in ids.items() if i is None or i == unk]
    if missing:
        raise ConfigError(
            f"the tokenizer has no {missing} token(s); a Qwen2-VL tokenizer has them (add them "
            "with tokenizer.add_tokens([...], special_tokens=True) and resize the embeddings)"
        )
    return ids


class VisionProcessor:
    """The Qwen2-VL processor's job with no video dependency: images -> pixel values and
    grids (the model's image processor), and each `<|image_pad|>` in the text expanded to
    that image's number of tokens, exactly as `Qwen2VLProcessor` does."""

    def __init__(self, tokenizer: Any, image_processor: Any) -> None:
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.merge_size = int(image_processor.merge_size)
        ids = vision_token_ids(tokenizer)
        self.image_token = VISION_TOKENS[1]
        self.image_token_id = ids[self.image_token]

    @classmethod
    def from_pretrained(cls, path: str | Path) -> VisionProcessor:
        # transformers takes seconds to import; the config checks import this module
        from transformers import AutoTokenizer
        from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil

        return cls(
            AutoTokenizer.from_pretrained(path), Qwen2VLImageProcessorPil.from_pretrained(path)
        )

    def images(self, images: list[Any]) -> MultimodalInputs:
        """PIL images -> `MultimodalInputs`."""
        out = self.image_processor(images=images, return_tensors="pt")
        return MultimodalInputs(out["pixel_values"].float(), out["image_grid_thw"].long())

    def expand(self, text: str, images: MultimodalInputs) -> str:
        """`text` with its i-th `<|image_pad|>` repeated for image i's token count."""
        parts = text.split(self.image_token)
        counts = images.image_token_counts(self.merge_size)
        if len(parts) - 1 != len(counts):
            raise ConfigError(
                f"the text holds {len(parts) - 1} {self.image_token} placeholders for "
                f"{len(counts)} images; give one placeholder per image"
            )
        out = parts[0]
        for n, part in zip(counts, parts[1:], strict=True):
            out += self.image_token * n + part
        return out

    def __call__(self, text: str, images: list[Any]) -> tuple[list[int], MultimodalInputs | None]:
        """Token ids of `text` (placeholders expanded) and the images' inputs."""
        if not images:
            return self.tokenizer(text, add_special_tokens=False)["input_ids"], None
        mm = self.images(images)
        ids = self.tokenizer(self.expand(text, mm), add_special_tokens=False)["input_ids"]
        return list(ids), mm


@dataclass(frozen=True)
class TinyVLM:
    """Where the tiny Qwen2-VL was saved and its special ids."""

    path: str
    """Folder with config, weights, tokenizer and image processor (pass as `model_path`)."""
    vocab_size: int
    """Tokenizer length (= the model's vocabulary)."""
    eos_token_id: int
    """`<|im_end|>`."""
    pad_token_id: int
    """`<|endoftext|>`."""
    image_token_id: int
    """`<|image_pad|>`."""


def build_tiny_vlm(
    path: str | Path,
    *,
    seed: int = 0,
    hidden_size: int = 64,
    num_layers: int = 2,
    initializer_range: float = 0.1,
) -> TinyVLM:
    """Build, initialise (seeded) and save a tiny random `Qwen2VLForConditionalGeneration`
    with a byte-level tokenizer (the vision tokens added) and a Qwen2-VL image processor
    (14-pixel patches merged 2x2; images are resized to 112..448 pixels a side)."""
    # transformers takes seconds to import; the config checks import this module
    from transformers import GenerationConfig, Qwen2VLConfig, Qwen2VLForConditionalGeneration
    from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil

    from tephra.rollout.testing import build_tiny_tokenizer

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = build_tiny_tokenizer()
    tok.add_tokens(list(VISION_TOKENS), special_tokens=True)
    ids = {t: tok.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    eos, pad = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")
    head = hidden_size // 2
    config = Qwen2VLConfig(
        text_config=dict(
            vocab_size=len(tok),
            hidden_size=hidden_size,
            intermediate_size=hidden_size * 2,
            num_hidden_layers=num_layers,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=2048,
            initializer_range=initializer_range,
            # mRoPE: (time, height, width) sections of the head's rotary half
            rope_scaling={
                "type": "mrope",
                "mrope_section": [head // 8, head * 3 // 16, head * 3 // 16],
            },
            eos_token_id=eos,
            pad_token_id=pad,
            bos_token_id=None,
        ),
        vision_config=dict(
            depth=1,
            embed_dim=32,
            hidden_size=hidden_size,
            num_heads=2,
            mlp_ratio=2,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            in_channels=3,
            initializer_range=initializer_range,
        ),
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        eos_token_id=eos,
        pad_token_id=pad,
        bos_token_id=None,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = Qwen2VLForConditionalGeneration(config).to(torch.float32)
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=pad)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    Qwen2VLImageProcessorPil(
        min_pixels=112 * 112,
        max_pixels=448 * 448,
        patch_size=14,
        merge_size=2,
        temporal_patch_size=2,
    ).save_pretrained(path)
    return TinyVLM(str(path), len(tok), eos, pad, ids["<|image_pad|>"])
