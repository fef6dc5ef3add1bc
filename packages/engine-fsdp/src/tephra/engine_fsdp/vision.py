"""Images in the batch: pixel inputs and position ids of a vision-language micro-batch.

A batch with images carries the field `multimodal` (`MULTIMODAL`): a `NonTensorStack` with
one `tephra.engine_api.multimodal.MultimodalInputs` (or None) per row, so slicing a batch into
micro-batches keeps each row's pixels with its tokens. For a micro-batch this module builds
what the backbone needs, through the model family's adapter
(`tephra.engine_api.multimodal.vision_family`):

  - the pixel arguments (`pixel_values` / `image_grid_thw` for Qwen2-VL, `pixel_values` for
    LLaVA): the rows' images concatenated in row order (the backbone scatters image features
    into the placeholder tokens in that order);
  - position ids: for an mRoPE family (Qwen2-VL) from the model's own `get_rope_index` (3
    rows: time, height, width); for LLaVA the plain positions of a text model;
  - on several ranks, a micro-batch without images runs the vision tower on a blank
    image, its output times 0 (`idle_inputs`): FSDP gathers and reduces the tower's
    sharded blocks collectively, so every rank must run it when one does.
    Packed, each sequence gets its own mRoPE ids, and a 4th leading row of plain positions
    restarting at 0 per sequence, from which transformers builds the block-causal mask of a
    packed stream (as for text models).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch
from tensordict import TensorDict
from torch import nn
from transformers import PretrainedConfig

from tephra.engine_api import batch as B
from tephra.engine_api.errors import BatchError, ConfigError
from tephra.engine_api.multimodal import (  # noqa: F401 (MULTIMODAL, multimodal_column: re-exported)
    MULTIMODAL,
    MultimodalInputs,
    check_image_tokens,
    image_token_id,
    is_vision_config,
    mm_token_type_ids,
    multimodal_column,
    video_token_id,
    vision_family,
)


@runtime_checkable
class ImageTower(Protocol):
    """A backbone with a vision tower (Qwen2-VL's `Qwen2VLModel`, LLaVA's `LlavaModel`)."""

    def get_image_features(self, pixel_values: torch.Tensor, **grids: torch.Tensor) -> Any:
        """The tower's output (`pooler_output`: the features of each image)."""


@runtime_checkable
class MRopeBackbone(Protocol):
    """A backbone with multimodal rotary positions (the Qwen2-VL family)."""

    def get_rope_index(
        self,
        input_ids: torch.Tensor,
        mm_token_type_ids: torch.Tensor,
        image_grid_thw: torch.Tensor | None = None,
        video_grid_thw: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(position ids `[3, b, t]`, per-row deltas) of a padded batch."""


def image_tower(model: nn.Module) -> ImageTower:
    """`model` (a backbone) as an `ImageTower`; a `ConfigError` when it has no tower."""
    if not isinstance(model, ImageTower):
        raise ConfigError(
            f"{type(model).__name__} has no vision tower (get_image_features); use a "
            "vision-language model or drop the images"
        )
    return model


def _mrope_backbone(model: nn.Module) -> MRopeBackbone:
    if not isinstance(model, MRopeBackbone):
        raise ConfigError(
            f"{type(model).__name__} has no get_rope_index, which a model family with "
            "mRoPE position ids needs; the installed transformers may not match the model"
        )
    return model


def rows(batch: TensorDict) -> list[MultimodalInputs | None] | None:
    """The rows' images, or None when the batch has no `multimodal` field / no image."""
    if MULTIMODAL not in batch.keys():
        return None
    items = list(batch[MULTIMODAL].tolist())
    return items if any(m is not None for m in items) else None


def check_batch(batch: TensorDict, model_config: PretrainedConfig, sp: int) -> None:
    """Each row's image tokens match its images; the model and settings can take images."""
    items = rows(batch)
    if items is None:
        return
    if not is_vision_config(model_config):
        raise BatchError(
            f"batch[{MULTIMODAL!r}] holds images but the model "
            f"({type(model_config).__name__}) has no vision tower; use a "
            "vision-language model or drop the images"
        )
    if sp > 1:
        raise ConfigError(
            "images in the batch with parallel.context > 1 (Ulysses): not "
            "supported yet; set parallel.context=1 for vision-language models"
        )
    ids, attn = batch[B.INPUT_IDS], batch[B.ATTENTION_MASK].bool()
    for r, mm in enumerate(items):
        check_image_tokens(ids[r][attn[r]].tolist(), mm, model_config, f"batch row {r}")


def _grids(mm: MultimodalInputs) -> dict[str, torch.Tensor]:
    """get_rope_index's grid arguments of these images and videos (absent ones left out)."""
    out: dict[str, torch.Tensor] = {}
    if mm.num_images and mm.image_grid_thw is not None:
        out["image_grid_thw"] = mm.image_grid_thw
    if mm.video_grid_thw is not None:
        out["video_grid_thw"] = mm.video_grid_thw
    return out


def _rope_index(
    backbone: MRopeBackbone,
    ids: torch.Tensor,
    mm: MultimodalInputs | None,
    tid: int,
    vid: int | None,
) -> torch.Tensor:
    """mRoPE ids `[3, n]` of one unpadded sequence (the model's `get_rope_index`)."""
    if mm is None:  # text only: the three rows are the plain positions
        return torch.arange(ids.shape[0]).expand(3, -1)
    pos, _ = backbone.get_rope_index(
        ids[None], mm_token_type_ids(ids[None], tid, vid), **_grids(mm)
    )
    return pos[:, 0]


def model_inputs(
    backbone: nn.Module,
    model_config: PretrainedConfig,
    mb: TensorDict,
    packed: bool,
    device: torch.device,
) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
    """(position ids, pixel kwargs) of a micro-batch of a vision-language model: position ids
    `[4, 1, N]` packed (plain positions, then mRoPE) or `[3, b, t]` padded. Packed text-only
    micro-batches take this path too: the leading plain row is what keeps their sequences
    apart (transformers reads 2-d position ids of a VLM as mRoPE, not as packing). A family
    without mRoPE (LLaVA) returns None: the caller's plain positions, padded or packed."""
    family = vision_family(model_config)
    items = rows(mb) or [None] * mb.batch_size[0]
    if not family.mrope:
        kwargs = family.model_kwargs(mb[B.INPUT_IDS], items, model_config)
        return None, {k: v.to(device) for k, v in kwargs.items()}
    tid, vid = image_token_id(model_config), video_token_id(model_config)
    ids, attn = mb[B.INPUT_IDS], mb[B.ATTENTION_MASK].bool()
    present = [m for m in items if m is not None]
    if not present and not packed:  # padded text: the plain positions and the mask
        return mb[B.POSITION_IDS].to(device), {}
    if not present:
        parts = [
            torch.cat([torch.arange(int(a.sum()))[None], torch.arange(int(a.sum())).expand(3, -1)])
            for a in attn
        ]
        return torch.cat(parts, dim=1)[:, None].to(device), {}
    mrope = _mrope_backbone(backbone)
    images = MultimodalInputs.concat(present)
    pixel: dict[str, torch.Tensor] = {}
    if images.num_images and images.image_grid_thw is not None:
        pixel["pixel_values"] = images.pixel_values.to(device)
        pixel["image_grid_thw"] = images.image_grid_thw.to(device)
    # (MultimodalInputs holds both or neither)
    if images.video_grid_thw is not None and images.pixel_values_videos is not None:
        pixel["pixel_values_videos"] = images.pixel_values_videos.to(device)
        pixel["video_grid_thw"] = images.video_grid_thw.to(device)
    with torch.no_grad():
        if packed:
            parts = []
            for r, mm in enumerate(items):
                real = ids[r][attn[r]]
                text = torch.arange(real.shape[0])[None]
                parts.append(torch.cat([text, _rope_index(mrope, real, mm, tid, vid)]))
            return torch.cat(parts, dim=1)[:, None].to(device), pixel
        pos, _ = mrope.get_rope_index(
            ids, mm_token_type_ids(ids, tid, vid), attention_mask=attn.long(), **_grids(images)
        )
    return pos.to(device), pixel


def idle_inputs(model_config: PretrainedConfig, device: torch.device) -> dict[str, torch.Tensor]:
    """Pixel inputs of one blank image (the smallest the tower takes), for a micro-batch
    without images on a multi-rank engine (see the module docstring)."""
    return vision_family(model_config).idle_inputs(model_config, device)
