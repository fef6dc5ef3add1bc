"""Images in the batch: the typed per-sample inputs every package passes along, and the
per-family adapters (`VISION_FAMILIES`) that turn them into a transformers call.

A prompt with images is its token ids (each image already expanded to its run of placeholder
tokens, as the model's processor does) plus a `MultimodalInputs`. What differs between model
families lives in one `VisionFamily` each, chosen by the model config's `model_type`:

  - Qwen2-VL / Qwen2.5-VL (`qwen2_vl`): `pixel_values` one row per patch with `image_grid_thw`
    (one row per image), videos as `pixel_values_videos` / `video_grid_thw`; an image takes
    patches / merge_size**2 `<|image_pad|>` tokens; position ids are mRoPE (`get_rope_index`).
  - LLaVA (`llava`): `pixel_values` one `(channels, height, width)` image each, no grid; an
    image takes (height / patch) * (width / patch) `<image>` tokens (+1 with the CLS feature
    kept); position ids are the plain ones.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tensordict import NonTensorData, NonTensorStack

from tephra.core import Registry
from tephra.engine_api.errors import ConfigError


@dataclass
class MultimodalInputs:
    """The images of one prompt, as the model's image processor made them."""

    pixel_values: torch.Tensor
    """Every image's pixels, in image order: with `image_grid_thw` (Qwen2-VL family) one row
    per patch, (patches, channels * temporal_patch * patch * patch); without it (LLaVA) one
    image per row, (images, channels, height, width)."""
    image_grid_thw: torch.Tensor | None
    """(images, 3) long: each image's grid in patches (time, height, width); (0, 3) for a
    prompt with videos only; None for a family whose images are whole (LLaVA)."""
    pixel_values_videos: torch.Tensor | None = None
    """(patches, channels * temporal_patch * patch * patch) float: every video's patches (two
    consecutive frames a temporal patch), in video order; None without videos."""
    video_grid_thw: torch.Tensor | None = None
    """(videos, 3) long: each video's grid (temporal patches, height, width); None without."""

    def __post_init__(self) -> None:
        if self.image_grid_thw is None:
            if self.pixel_values.ndim != 4 or self.pixel_values_videos is not None:
                raise ConfigError(
                    f"MultimodalInputs.pixel_values has shape {list(self.pixel_values.shape)} "
                    "and no image_grid_thw; without a grid (LLaVA) pass whole images, "
                    "(images, channels, height, width), and no videos"
                )
            return
        _check_pixels("pixel_values", "image_grid_thw", self.pixel_values, self.image_grid_thw)
        if (self.pixel_values_videos is None) != (self.video_grid_thw is None):
            raise ConfigError(
                "MultimodalInputs: pixel_values_videos and video_grid_thw go together; pass "
                "both (the video processing's outputs) or neither"
            )
        if self.video_grid_thw is not None and self.pixel_values_videos is not None:
            _check_pixels(
                "pixel_values_videos",
                "video_grid_thw",
                self.pixel_values_videos,
                self.video_grid_thw,
            )

    @property
    def num_images(self) -> int:
        if self.image_grid_thw is None:
            return int(self.pixel_values.shape[0])
        return int(self.image_grid_thw.shape[0])

    @property
    def num_videos(self) -> int:
        return 0 if self.video_grid_thw is None else int(self.video_grid_thw.shape[0])

    def image_token_counts(self, merge_size: int) -> list[int]:
        """How many `<|image_pad|>` tokens each image takes in the token ids (Qwen2-VL family;
        any family: `VisionFamily.image_token_counts`)."""
        if self.image_grid_thw is None:
            raise ConfigError(
                "MultimodalInputs.image_token_counts(merge_size) counts Qwen2-VL grids; these "
                "images have none (LLaVA): use vision_family(config).image_token_counts"
            )
        return [int(n) // merge_size**2 for n in self.image_grid_thw.prod(-1)]

    def video_token_counts(self, merge_size: int) -> list[int]:
        """How many `<|video_pad|>` tokens each video takes in the token ids."""
        if self.video_grid_thw is None:
            return []
        return [int(n) // merge_size**2 for n in self.video_grid_thw.prod(-1)]

    @staticmethod
    def concat(items: list[MultimodalInputs]) -> MultimodalInputs:
        """One batch of several prompts' images, in prompt order (what the model expects)."""
        pixels = [m.pixel_values_videos for m in items if m.pixel_values_videos is not None]
        grids = [m.video_grid_thw for m in items if m.video_grid_thw is not None]
        image_grids = [m.image_grid_thw for m in items if m.image_grid_thw is not None]
        if image_grids and len(image_grids) != len(items):
            raise ConfigError(
                "MultimodalInputs.concat: some prompts' images have grids and some do not; "
                "process every prompt's images with the same model's processor"
            )
        return MultimodalInputs(
            torch.cat([m.pixel_values for m in items]),
            torch.cat(image_grids) if image_grids else None,
            torch.cat(pixels) if pixels else None,
            torch.cat(grids) if grids else None,
        )


def _check_pixels(
    pixels_name: str, grid_name: str, pixels: torch.Tensor, grid: torch.Tensor
) -> None:
    if grid.ndim != 2 or grid.shape[1] != 3:
        raise ConfigError(
            f"MultimodalInputs.{grid_name} has shape {list(grid.shape)}; it must be (n, 3), "
            "as the Qwen2-VL processor returns it"
        )
    patches = int(grid.prod(-1).sum())
    if pixels.ndim != 2 or pixels.shape[0] != patches:
        raise ConfigError(
            f"MultimodalInputs.{pixels_name} has shape {list(pixels.shape)}, but {grid_name} "
            f"holds {patches} patches; pass the processor's outputs of the same images together"
        )


MULTIMODAL = "multimodal"
"""Batch field of a batch with images: a `NonTensorStack` with each row's `MultimodalInputs`
(or None), so slicing the batch keeps each row's pixels with its tokens."""


def multimodal_column(items: list[MultimodalInputs | None]) -> NonTensorStack:
    """The `multimodal` field of a batch whose rows have these images."""
    return NonTensorStack(*[NonTensorData(m) for m in items])


def image_token_id(model_config: Any) -> int:
    """The image placeholder id of a vision-language config (`<|image_pad|>`, `<image>`)."""
    tid = getattr(model_config, "image_token_id", None)
    if tid is None:
        raise ConfigError(
            f"model config {type(model_config).__name__} has no image_token_id; images need a "
            f"vision-language model of a supported family ({supported_model_types()})"
        )
    return int(tid)


def video_token_id(model_config: Any) -> int | None:
    """The `<|video_pad|>` id of a Qwen2-VL-family config (None when it has none)."""
    tid = getattr(model_config, "video_token_id", None)
    return None if tid is None else int(tid)


def is_vision_config(model_config: Any) -> bool:
    """True for a config with a vision tower (Qwen2-VL family, LLaVA and similar)."""
    return getattr(model_config, "vision_config", None) is not None


def declared_hf_config(model_cfg: Any) -> dict[str, Any]:
    """The transformers config an engine's `ModelConfig` names, as a dict, read without
    loading the model: its `hf_config`, or the config.json in `model.path`; {} when that
    cannot be read (the engine's own checks report an unreadable folder when it loads)."""

    if getattr(model_cfg, "path", None):
        try:
            data = json.loads((Path(model_cfg.path) / "config.json").read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}
    return dict(getattr(model_cfg, "hf_config", None) or {})


def model_has_vision(model_cfg: Any) -> bool:
    """Whether an engine's `ModelConfig` names a vision-language model: its `hf_config` dict,
    or the config.json in `model.path`, has a `vision_config`."""
    return declared_hf_config(model_cfg).get("vision_config") is not None


def mm_token_type_ids(
    input_ids: torch.Tensor, image_token: int, video_token: int | None = None
) -> torch.Tensor:
    """1 where a token is an image token, 2 a video token, else 0 (what transformers'
    get_rope_index reads)."""
    types = (input_ids == image_token).to(torch.int)
    if video_token is not None:
        types = types + 2 * (input_ids == video_token).to(torch.int)
    return types


def hf_model_kwargs(
    input_ids: torch.Tensor,
    images: list[MultimodalInputs | None],
    image_token: int,
    video_token: int | None = None,
) -> dict[str, torch.Tensor]:
    """Keyword arguments for a Qwen2-VL forward/generate of the rows `input_ids` whose images
    are `images` (one entry per row, None for a row without images). Empty without images.
    Any family: `vision_family(config).model_kwargs`."""
    present = [m for m in images if m is not None]
    if not present:
        return {}
    batch = MultimodalInputs.concat(present)
    out = {
        "mm_token_type_ids": mm_token_type_ids(input_ids, image_token, video_token),
    }
    if batch.num_images and batch.image_grid_thw is not None:
        # transformers reads an empty image grid as images present: only when there are some
        out["pixel_values"] = batch.pixel_values
        out["image_grid_thw"] = batch.image_grid_thw
    if batch.video_grid_thw is not None and batch.pixel_values_videos is not None:
        out["pixel_values_videos"] = batch.pixel_values_videos
        out["video_grid_thw"] = batch.video_grid_thw
    return out


class VisionFamily(ABC):
    """What differs between vision-language model families: which processor outputs travel
    with a sample, how many placeholder tokens an image expands to, the forward's pixel
    arguments and how position ids are formed. One instance per family in `VISION_FAMILIES`,
    registered with the `model_types` (a config's `model_type`) it serves."""

    mrope: bool
    """Position ids come from the model's `get_rope_index` (3 rows: time, height, width);
    False: the plain positions of a text model."""
    image_token: str
    """The placeholder a prompt's text holds for each image (expanded by the processor)."""
    span_tokens: tuple[str, str] | None
    """(start, end) tokens around each image's run of placeholders, or None."""
    video_token: str | None
    """The video placeholder, or None for a family without videos."""
    image_processor: str
    """transformers' PIL image processor class of the family (no torchvision needed)."""
    tower_modules: tuple[str, ...]
    """Module names of the vision tower (and projector) that `lora.vision=frozen` leaves out."""

    def image_token_id(self, config: Any) -> int:
        """The image placeholder's id in `config` (a transformers model config)."""
        return image_token_id(config)

    def video_token_id(self, config: Any) -> int | None:
        """The video placeholder's id in `config`, None without videos."""
        return video_token_id(config)

    @abstractmethod
    def image_token_counts(self, images: MultimodalInputs, config: Any) -> list[int]:
        """How many image placeholder tokens each image takes in the token ids."""

    def video_token_counts(self, images: MultimodalInputs, config: Any) -> list[int]:
        """How many video placeholder tokens each video takes (none by default)."""
        return []

    @abstractmethod
    def inputs(self, processed: dict[str, Any]) -> MultimodalInputs:
        """The processor outputs of some images that travel with a sample."""

    @abstractmethod
    def model_kwargs(
        self, input_ids: torch.Tensor, images: list[MultimodalInputs | None], config: Any
    ) -> dict[str, torch.Tensor]:
        """Pixel keyword arguments of a forward/generate over the rows `input_ids` whose images
        are `images` (one entry per row, None for a row without images); {} without images."""

    @abstractmethod
    def idle_inputs(self, config: Any, device: torch.device) -> dict[str, torch.Tensor]:
        """`get_image_features` arguments of the smallest blank image the tower takes."""


class QwenVLFamily(VisionFamily):
    """Qwen2-VL and Qwen2.5-VL: patch rows with grids, merged 2x2 into one token, mRoPE."""

    mrope = True
    image_token = "<|image_pad|>"
    span_tokens = ("<|vision_start|>", "<|vision_end|>")
    video_token = "<|video_pad|>"
    image_processor = "Qwen2VLImageProcessorPil"
    tower_modules = ("visual",)

    def image_token_counts(self, images: MultimodalInputs, config: Any) -> list[int]:
        return images.image_token_counts(int(config.vision_config.spatial_merge_size))

    def video_token_counts(self, images: MultimodalInputs, config: Any) -> list[int]:
        return images.video_token_counts(int(config.vision_config.spatial_merge_size))

    def inputs(self, processed: dict[str, Any]) -> MultimodalInputs:
        return MultimodalInputs(
            processed["pixel_values"].float(), processed["image_grid_thw"].long()
        )

    def model_kwargs(
        self, input_ids: torch.Tensor, images: list[MultimodalInputs | None], config: Any
    ) -> dict[str, torch.Tensor]:
        return hf_model_kwargs(input_ids, images, image_token_id(config), video_token_id(config))

    def idle_inputs(self, config: Any, device: torch.device) -> dict[str, torch.Tensor]:
        v = config.vision_config
        merge = int(v.spatial_merge_size)
        dim = (
            int(getattr(v, "in_channels", 3)) * int(v.temporal_patch_size) * int(v.patch_size) ** 2
        )
        return {
            "pixel_values": torch.zeros(merge * merge, dim, device=device),
            "image_grid_thw": torch.tensor([[1, merge, merge]], device=device),
        }


class LlavaFamily(VisionFamily):
    """LLaVA: whole images through a CLIP-style tower, one token per patch (the CLS feature
    dropped by the `default` feature strategy), plain position ids."""

    mrope = False
    image_token = "<image>"
    span_tokens = None
    video_token = None
    image_processor = "CLIPImageProcessorPil"
    tower_modules = ("vision_tower", "multi_modal_projector")

    def image_token_counts(self, images: MultimodalInputs, config: Any) -> list[int]:
        patch = int(config.vision_config.patch_size)
        height, width = (int(x) for x in images.pixel_values.shape[-2:])
        cls = 0 if getattr(config, "vision_feature_select_strategy", "default") == "default" else 1
        return [(height // patch) * (width // patch) + cls] * images.num_images

    def inputs(self, processed: dict[str, Any]) -> MultimodalInputs:
        return MultimodalInputs(processed["pixel_values"].float(), None)

    def model_kwargs(
        self, input_ids: torch.Tensor, images: list[MultimodalInputs | None], config: Any
    ) -> dict[str, torch.Tensor]:
        present = [m for m in images if m is not None]
        if not present:
            return {}
        return {"pixel_values": MultimodalInputs.concat(present).pixel_values}

    def idle_inputs(self, config: Any, device: torch.device) -> dict[str, torch.Tensor]:
        v = config.vision_config
        size = int(v.image_size)
        return {"pixel_values": torch.zeros(1, int(v.num_channels), size, size, device=device)}


VISION_FAMILIES: Registry[VisionFamily] = Registry("vision-language model family")
"""Vision-language families by name; metadata `model_types`: the configs' `model_type`s each
serves."""
VISION_FAMILIES.register("qwen2_vl", QwenVLFamily(), model_types=("qwen2_vl", "qwen2_5_vl"))
VISION_FAMILIES.register("llava", LlavaFamily(), model_types=("llava",))


def supported_model_types() -> str:
    """The model types the registered families serve, for error messages."""
    return ", ".join(
        f"{t} ({name})"
        for name in VISION_FAMILIES.names()
        for t in VISION_FAMILIES.meta(name)["model_types"]
    )


def family_name(model_type: str | None) -> str | None:
    """The registered family serving `model_type`, or None."""
    for name in VISION_FAMILIES.names():
        if model_type in VISION_FAMILIES.meta(name)["model_types"]:
            return name
    return None


def vision_family(model_config: Any) -> VisionFamily:
    """The family adapter of a vision-language model config (a transformers config or its
    dict); an unsupported `model_type` is a `ConfigError` naming the supported ones."""
    model_type = (
        model_config.get("model_type")
        if isinstance(model_config, dict)
        else getattr(model_config, "model_type", None)
    )
    name = family_name(model_type)
    if name is None:
        raise ConfigError(
            f"vision-language model_type {model_type!r} is not supported; supported model "
            f"types (family): {supported_model_types()}"
        )
    return VISION_FAMILIES.get(name)


def check_image_tokens(
    prompt_ids: list[int],
    images: MultimodalInputs | None,
    model_config: Any,
    where: str,
) -> None:
    """The prompt holds exactly as many image (and video) tokens as its images (videos)
    expand to in the family of `model_config` (a transformers model config)."""
    family = vision_family(model_config)
    slots = [
        ("image", family.image_token_id(model_config), family.image_token_counts),
        ("video", family.video_token_id(model_config), family.video_token_counts),
    ]
    for what, token, counts in slots:
        if token is None:
            continue
        have = sum(1 for t in prompt_ids if t == token)
        need = sum(counts(images, model_config)) if images is not None else 0
        if have != need:
            raise ConfigError(
                f"{where}: the prompt holds {have} {what} tokens but its {what}s need {need}; "
                f"build prompt ids and {what}s with the same processor (tephra.rollout."
                f"multimodal.VisionProcessor) so each {what} expands to its own number of tokens"
            )
