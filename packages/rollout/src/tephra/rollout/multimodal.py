"""Images in prompts (vision-language models: the Qwen2-VL family and LLaVA).

A prompt with images is its token ids (each image already expanded to its run of placeholder
tokens) plus a `MultimodalInputs` (pixel values, and grids for Qwen2-VL; defined in
`tephra.engine_api.multimodal` and re-exported here). The two travel together from the data
loader through rollout to the trainer. `VisionProcessor` makes them from text and images,
as the model family's adapter (`vision_family`, chosen by the config's `model_type`) says.

`build_tiny_vlm` saves a tiny random Qwen2-VL, Qwen2.5-VL or LLaVA (`family`) with its
tokenizer and image processor config (generated), for tests and smoke runs (no pretrained VLM
is needed).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tephra.engine_api.errors import ConfigError
from tephra.engine_api.multimodal import (  # noqa: F401  (re-exported: the rollout-side API)
    MultimodalInputs,
    VisionFamily,
    check_image_tokens,
    hf_model_kwargs,
    image_token_id,
    is_vision_config,
    mm_token_type_ids,
    video_token_id,
    vision_family,
)
from tephra.rollout.testing import build_tiny_tokenizer

VISION_TOKENS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>")
"""Qwen2-VL's vision special tokens: an image is `<|vision_start|>` + n x `<|image_pad|>` +
`<|vision_end|>` (n = patches / merge_size**2)."""


def vision_token_ids(tokenizer: Any, family: VisionFamily | None = None) -> dict[str, int]:
    """Ids of `family`'s (default Qwen2-VL's) image tokens in `tokenizer`; an error says how to
    add them."""
    names = (
        [family.image_token, *(family.span_tokens or ())]
        if family is not None
        else list(VISION_TOKENS[:3])
    )
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in names}
    unk = getattr(tokenizer, "unk_token_id", None)
    missing = [t for t, i in ids.items() if i is None or i == unk]
    if missing:
        raise ConfigError(
            f"the tokenizer has no {missing} token(s); the model's tokenizer has them (add them "
            "with tokenizer.add_tokens([...], special_tokens=True) and resize the embeddings)"
        )
    return ids


def sample_frames(frames: list[Any], max_frames: int, temporal_patch: int = 2) -> list[Any]:
    """At most `max_frames` frames spread evenly over the video (first and last kept), their
    count a multiple of `temporal_patch` (the last frame repeated), as Qwen2-VL's video
    processing groups consecutive frames into one temporal patch."""
    if not frames:
        raise ConfigError("a video has no frames; give each video at least one frame")
    n = min(len(frames), max(max_frames // temporal_patch * temporal_patch, temporal_patch))
    if n == len(frames):
        picked = list(frames)
    else:
        picked = [frames[round(i * (len(frames) - 1) / max(n - 1, 1))] for i in range(n)]
    while len(picked) % temporal_patch:
        picked.append(picked[-1])
    return picked


class VisionProcessor:
    """A vision-language processor's job with no video dependency, for the model family of
    `config` (its `VisionFamily`): images -> the family's pixel inputs (the model's image
    processor), each image placeholder in the text expanded to that image's number of tokens,
    exactly as the family's transformers processor (`Qwen2VLProcessor`, `LlavaProcessor`)
    does; for Qwen2-VL also videos (lists of frames) -> temporal patches of two consecutive
    frames each."""

    def __init__(
        self, tokenizer: Any, image_processor: Any, config: Any, max_frames: int = 8
    ) -> None:
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.config = config
        """The model's transformers config (what the family adapter reads)."""
        self.family = vision_family(config)
        self.max_frames = max_frames
        ids = vision_token_ids(tokenizer, self.family)
        self.image_token = self.family.image_token
        self.image_token_id = ids[self.image_token]
        self.video_token = self.family.video_token
        self.video_token_id = (
            None if self.video_token is None else tokenizer.convert_tokens_to_ids(self.video_token)
        )
        spans = self.family.span_tokens
        self._span_ends = (ids[spans[0]], ids[spans[1]]) if spans else None

    @classmethod
    def from_pretrained(cls, path: str | Path, max_frames: int = 8) -> VisionProcessor:
        # transformers takes seconds to import; the config checks import this module
        import transformers
        from transformers import AutoConfig, AutoTokenizer

        config = AutoConfig.from_pretrained(path)
        image_processor = getattr(transformers, vision_family(config).image_processor)
        return cls(
            AutoTokenizer.from_pretrained(path),
            image_processor.from_pretrained(path),
            config,
            max_frames,
        )

    def span_text(self, token: str) -> str:
        """What one image (video) with placeholder `token` stands as in the text before the
        expansion: `<|vision_start|><|image_pad|><|vision_end|>` (Qwen2-VL), `<image>` (LLaVA)."""
        spans = self.family.span_tokens
        return f"{spans[0]}{token}{spans[1]}" if spans else token

    @property
    def merge_size(self) -> int:
        """Qwen2-VL's patch merge (patches per token = merge_size**2); 1 for LLaVA."""
        return int(getattr(self.image_processor, "merge_size", 1))

    def image_token_counts(self, images: MultimodalInputs) -> list[int]:
        """How many placeholder tokens each of `images` expands to."""
        return self.family.image_token_counts(images, self.config)

    def check(self, prompt_ids: list[int], images: MultimodalInputs | None, where: str) -> None:
        """The prompt holds exactly the image (video) tokens its images (videos) expand to."""
        check_image_tokens(prompt_ids, images, self.config, where)

    def images(self, images: list[Any]) -> MultimodalInputs:
        """PIL images -> `MultimodalInputs`."""
        return self.family.inputs(self.image_processor(images=images, return_tensors="pt"))

    def videos(self, videos: list[list[Any]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Videos (each a list of PIL frames) -> (pixel_values_videos, video_grid_thw). Each
        video's frames are sampled (`sample_frames`), resized to its first frame's size, and
        processed like images; consecutive frames then fill one temporal patch's two slots."""
        self._check_videos()
        t = int(self.image_processor.temporal_patch_size)
        pixels, grids = [], []
        for frames in videos:
            frames = sample_frames(frames, self.max_frames, t)
            size = frames[0].size
            out = self.image_processor(
                images=[f.convert("RGB").resize(size) for f in frames], return_tensors="pt"
            )
            _, gh, gw = (int(x) for x in out["image_grid_thw"][0])
            # each frame's patches hold the frame in every temporal slot: (frames, hw, C, t, p*p)
            per = out["pixel_values"].float().reshape(len(frames), gh * gw, -1, t, self.patch**2)
            pairs = per[:, :, :, 0].reshape(len(frames) // t, t, gh * gw, -1, self.patch**2)
            # (temporal patch, hw, C, t, p*p): frame k of a pair in temporal slot k
            pixels.append(pairs.permute(0, 2, 3, 1, 4).reshape(len(frames) // t * gh * gw, -1))
            grids.append([len(frames) // t, gh, gw])
        return torch.cat(pixels), torch.tensor(grids, dtype=torch.long)

    def _check_videos(self) -> None:
        if self.video_token is None:
            raise ConfigError(
                f"videos with a {self.config.model_type} model: its family takes images only; "
                "drop the videos column or use a Qwen2-VL-family model"
            )

    def image_span(self, tokens: int) -> list[int]:
        """Token ids of one expanded image of `tokens` image tokens: the family's span start
        (`<|vision_start|>`), `tokens` x the placeholder, its span end (`<|vision_end|>`)."""
        run = [self.image_token_id] * tokens
        if self._span_ends is None:
            return run
        start, end = self._span_ends
        return [start, *run, end]

    @property
    def patch(self) -> int:
        return int(self.image_processor.patch_size)

    def _expand(self, text: str, token: str, counts: list[int], what: str) -> str:
        parts = text.split(token)
        if len(parts) - 1 != len(counts):
            raise ConfigError(
                f"the text holds {len(parts) - 1} {token} placeholders for "
                f"{len(counts)} {what}; give one placeholder per {what[:-1]}"
            )
        out = parts[0]
        for n, part in zip(counts, parts[1:], strict=True):
            out += token * n + part
        return out

    def expand(self, text: str, images: MultimodalInputs) -> str:
        """`text` with its i-th `<|image_pad|>` (`<|video_pad|>`) repeated for image (video)
        i's token count."""
        text = self._expand(text, self.image_token, self.image_token_counts(images), "images")
        if self.video_token is None:
            return text
        return self._expand(
            text, self.video_token, self.family.video_token_counts(images, self.config), "videos"
        )

    def __call__(
        self, text: str, images: list[Any], videos: list[list[Any]] | None = None
    ) -> tuple[list[int], MultimodalInputs | None]:
        """Token ids of `text` (placeholders expanded) and the images' (videos') inputs."""
        if not images and not videos:
            return self.tokenizer(text, add_special_tokens=False)["input_ids"], None
        if videos:
            self._check_videos()
        if images:
            mm = self.images(images)
        else:
            dim = 3 * int(self.image_processor.temporal_patch_size) * self.patch**2
            mm = MultimodalInputs(torch.zeros(0, dim), torch.zeros(0, 3, dtype=torch.long))
        if videos:
            mm = MultimodalInputs(mm.pixel_values, mm.image_grid_thw, *self.videos(videos))
        ids = self.tokenizer(self.expand(text, mm), add_special_tokens=False)["input_ids"]
        return list(ids), mm


VLM_FAMILIES = ("qwen2_vl", "qwen2_5_vl", "llava")
"""Model types `build_tiny_vlm` builds (the two Qwen ones share the Qwen2-VL processor and
vision tokens; LLaVA has its own)."""


@dataclass(frozen=True)
class TinyVLM:
    """Where the tiny vision-language model was saved and its special ids."""

    path: str
    """Folder with config, weights, tokenizer and image processor (pass as `model_path`)."""
    vocab_size: int
    """Tokenizer length (= the model's vocabulary)."""
    eos_token_id: int
    """`<|im_end|>`."""
    pad_token_id: int
    """`<|endoftext|>`."""
    image_token_id: int
    """`<|image_pad|>` (Qwen2-VL family) or `<image>` (LLaVA)."""


def build_tiny_vlm(
    path: str | Path,
    *,
    seed: int = 0,
    hidden_size: int = 64,
    num_layers: int = 2,
    initializer_range: float = 0.1,
    family: str = "qwen2_vl",
) -> TinyVLM:
    """Build, initialise (seeded) and save a tiny random `Qwen2VLForConditionalGeneration`
    (`family="qwen2_vl"`) or `Qwen2_5_VLForConditionalGeneration` (`"qwen2_5_vl"`: RMSNorm +
    SwiGLU vision blocks, windowed attention in block 0 and full attention in the last) with
    a byte-level tokenizer (the vision tokens added) and the image processor both families use
    (14-pixel patches merged 2x2; images are resized to 112..448 pixels a side); or a
    `LlavaForConditionalGeneration` (`"llava"`, `build_tiny_llava`)."""
    # transformers takes seconds to import; the config checks import this module
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
    )
    from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil

    if family not in VLM_FAMILIES:
        raise ConfigError(f"build_tiny_vlm(family={family!r}): use one of {list(VLM_FAMILIES)}")
    if family == "llava":
        return build_tiny_llava(
            path,
            seed=seed,
            hidden_size=hidden_size,
            num_layers=num_layers,
            initializer_range=initializer_range,
        )

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = build_tiny_tokenizer()
    tok.add_tokens(list(VISION_TOKENS), special_tokens=True)
    ids = {t: tok.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    eos, pad = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")
    head = hidden_size // 2
    vision_common: dict[str, Any] = dict(
        depth=1 if family == "qwen2_vl" else 2,
        hidden_size=hidden_size,
        num_heads=2,
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
        in_channels=3,
        initializer_range=initializer_range,
    )
    config_cls: Any
    model_cls: Any
    if family == "qwen2_vl":
        vision_config = dict(vision_common, embed_dim=32, mlp_ratio=2)
        config_cls, model_cls = Qwen2VLConfig, Qwen2VLForConditionalGeneration
    else:
        # the tower's own width is hidden_size; out_hidden_size is the language model's
        vision_config = dict(
            vision_common,
            hidden_size=32,
            intermediate_size=64,
            out_hidden_size=hidden_size,
            window_size=56,  # 2x2 merged patches a window: small images still cross windows
            fullatt_block_indexes=[1],
        )
        config_cls, model_cls = Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    config = config_cls(
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
        vision_config=vision_config,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        eos_token_id=eos,
        pad_token_id=pad,
        bos_token_id=None,
        tie_word_embeddings=False,
    )
    _save_tiny(model_cls, config, tok, path, seed, eos, pad)
    Qwen2VLImageProcessorPil(
        min_pixels=112 * 112,
        max_pixels=448 * 448,
        patch_size=14,
        merge_size=2,
        temporal_patch_size=2,
    ).save_pretrained(path)
    return TinyVLM(str(path), len(tok), eos, pad, ids["<|image_pad|>"])


def _save_tiny(
    model_cls: Any, config: Any, tok: Any, path: Path, seed: int, eos: int, pad: int
) -> None:
    """Initialise `model_cls(config)` seeded, in float32, generating until `eos` (padding
    with `pad`), and save it with its tokenizer in `path`."""
    from transformers import GenerationConfig  # heavy: as the builders' own imports

    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32)
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=pad)
    model.save_pretrained(path)
    tok.save_pretrained(path)


LLAVA_IMAGE_SIZE = 56
"""The tiny LLaVA's image side in pixels (4 x 4 patches of 14: 16 `<image>` tokens)."""


def build_tiny_llava(
    path: str | Path,
    *,
    seed: int = 0,
    hidden_size: int = 64,
    num_layers: int = 2,
    initializer_range: float = 0.1,
) -> TinyVLM:
    """Build, initialise (seeded) and save a tiny random `LlavaForConditionalGeneration`: a
    CLIP vision tower (2 layers, width 32, 56-pixel images in 14-pixel patches), a two-layer
    projector and a Llama text model, with a byte-level tokenizer (`<image>` added) and the
    `LlavaProcessor` config (`CLIPImageProcessor`: shortest edge resized to 56, centre crop
    56 x 56, so every image takes 16 `<image>` tokens: the CLS feature is dropped)."""
    # transformers takes seconds to import; the config checks import this module
    from transformers import (
        CLIPImageProcessorPil,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = build_tiny_tokenizer()
    tok.add_tokens(["<image>"], special_tokens=True)
    image = tok.convert_tokens_to_ids("<image>")
    eos, pad = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")
    patch = 14
    # token ids go through PretrainedConfig's **kwargs, which LlavaConfig's stub leaves out
    config = LlavaConfig(  # type: ignore[call-arg]
        vision_config=dict(
            model_type="clip_vision_model",
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=LLAVA_IMAGE_SIZE,
            patch_size=patch,
            projection_dim=32,
            initializer_range=initializer_range,
        ),
        text_config=dict(
            model_type="llama",
            vocab_size=len(tok),
            hidden_size=hidden_size,
            intermediate_size=hidden_size * 2,
            num_hidden_layers=num_layers,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=2048,
            initializer_range=initializer_range,
            eos_token_id=eos,
            pad_token_id=pad,
            bos_token_id=None,
        ),
        image_token_index=image,
        image_seq_length=(LLAVA_IMAGE_SIZE // patch) ** 2,
        # the last layer: a two-layer tower's second-to-last would leave one layer unused
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
        projector_hidden_act="gelu",
        tie_word_embeddings=False,
        eos_token_id=eos,
        pad_token_id=pad,
    )
    _save_tiny(LlavaForConditionalGeneration, config, tok, path, seed, eos, pad)
    images = CLIPImageProcessorPil(
        size={"shortest_edge": LLAVA_IMAGE_SIZE},
        crop_size={"height": LLAVA_IMAGE_SIZE, "width": LLAVA_IMAGE_SIZE},
    )
    # the processor config vLLM and transformers' AutoProcessor read; the image processor
    # config beside it for CLIPImageProcessorPil.from_pretrained
    LlavaProcessor(
        image_processor=images,
        tokenizer=tok,
        patch_size=patch,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        chat_template=tok.chat_template,
    ).save_pretrained(path)
    images.save_pretrained(path)
    return TinyVLM(str(path), len(tok), eos, pad, image)
