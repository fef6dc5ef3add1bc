"""Images in the batch (vision-language models of the Qwen2-VL family): the typed per-sample
inputs every package passes along, and the helpers that turn them into a transformers call.

A prompt with images is its token ids (each image already expanded to its run of
`<|image_pad|>` tokens, as the model's processor does) plus a `MultimodalInputs`: the image
processor's `pixel_values` (one row per patch) and `image_grid_thw` (one row per image), and
for videos `pixel_values_videos` / `video_grid_thw` (each video a run of `<|video_pad|>`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tensordict import NonTensorData, NonTensorStack

from tephra.engine_api.errors import ConfigError


@dataclass
class MultimodalInputs:
    """The images of one prompt, as the model's image processor made them."""

    pixel_values: torch.Tensor
    """(patches, channels * temporal_patch * patch * patch) float: every image's patches, in
    image order."""
    image_grid_thw: torch.Tensor
    """(images, 3) long: each image's grid in patches (time, height, width); (0, 3) for a
    prompt with videos only."""
    pixel_values_videos: torch.Tensor | None = None
    """(patches, channels * temporal_patch * patch * patch) float: every video's patches (two
    consecutive frames a temporal patch), in video order; None without videos."""
    video_grid_thw: torch.Tensor | None = None
    """(videos, 3) long: each video's grid (temporal patches, height, width); None without."""

    def __post_init__(self) -> None:
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
        return int(self.image_grid_thw.shape[0])

    @property
    def num_videos(self) -> int:
        return 0 if self.video_grid_thw is None else int(self.video_grid_thw.shape[0])

    def image_token_counts(self, merge_size: int) -> list[int]:
        """How many `<|image_pad|>` tokens each image takes in the token ids."""
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
        return MultimodalInputs(
            torch.cat([m.pixel_values for m in items]),
            torch.cat([m.image_grid_thw for m in items]),
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
    """The `<|image_pad|>` id of a Qwen2-VL-family config."""
    tid = getattr(model_config, "image_token_id", None)
    if tid is None:
        raise ConfigError(
            f"model config {type(model_config).__name__} has no image_token_id; images need a "
            "Qwen2-VL-family model (model_type qwen2_vl / qwen2_5_vl)"
        )
    return int(tid)


def video_token_id(model_config: Any) -> int | None:
    """The `<|video_pad|>` id of a Qwen2-VL-family config (None when it has none)."""
    tid = getattr(model_config, "video_token_id", None)
    return None if tid is None else int(tid)


def is_vision_config(model_config: Any) -> bool:
    """True for a config with a vision tower (Qwen2-VL family and similar)."""
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
    are `images` (one entry per row, None for a row without images). Empty without images."""
    present = [m for m in images if m is not None]
    if not present:
        return {}
    batch = MultimodalInputs.concat(present)
    out = {
        "pixel_values": batch.pixel_values,
        "image_grid_thw": batch.image_grid_thw,
        "mm_token_type_ids": mm_token_type_ids(input_ids, image_token, video_token),
    }
    if batch.video_grid_thw is not None and batch.pixel_values_videos is not None:
        out["pixel_values_videos"] = batch.pixel_values_videos
        out["video_grid_thw"] = batch.video_grid_thw
    if not batch.num_images:  # transformers reads an empty image grid as images present
        del out["pixel_values"], out["image_grid_thw"]
    return out


def check_image_tokens(
    prompt_ids: list[int],
    images: MultimodalInputs | None,
    image_token: int,
    merge_size: int,
    where: str,
    video_token: int | None = None,
) -> None:
    """The prompt holds exactly as many image (and video) tokens as its images (videos) need."""
    have = sum(1 for t in prompt_ids if t == image_token)
    need = sum(images.image_token_counts(merge_size)) if images is not None else 0
    if have != need:
        raise ConfigError(
            f"{where}: the prompt holds {have} image tokens but its images need {need}; build "
            "prompt ids and images with the same processor (tephra.rollout.multimodal."
            "VisionProcessor) so each image expands to its own number of tokens"
        )
    if video_token is None:
        return
    have = sum(1 for t in prompt_ids if t == video_token)
    need = sum(images.video_token_counts(merge_size)) if images is not None else 0
    if have != need:
        raise ConfigError(
            f"{where}: the prompt holds {have} video tokens but its videos need {need}; build "
            "prompt ids and videos with the same processor (tephra.rollout.multimodal."
            "VisionProcessor) so each video expands to its own number of tokens"
        )
