"""Prompts with images: verl's multimodal rows, loaded with the model's processor.

A verl multimodal row is a normal row (see `tephra.controller.data`) plus an `images` column:
a list whose entries are image bytes (PNG/JPEG...), a file path, a `{"bytes": ..., "path":
...}` struct (how `datasets` stores an Image feature in parquet) or a PIL image. The prompt's
messages mark where each image goes with `<image>`, in order. Each row becomes a
`MultimodalPrompt`: its record, its token ids (chat template, each `<image>` expanded to the
image's run of vision tokens) and its `MultimodalInputs` (pixel values and grids), which
travel with the sample to rollout and the trainer.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tephra.controller.data import DatasetError, PromptRecord, chat_prompt_ids, record_from_row
from tephra.engine_api.errors import ConfigError
from tephra.rollout.multimodal import (
    VISION_TOKENS,
    MultimodalInputs,
    VisionProcessor,
    check_image_tokens,
)

IMAGE_PLACEHOLDER = "<image>"
"""verl's marker of an image in a message's text."""

VISION_SPAN = "<|vision_start|><|image_pad|><|vision_end|>"
"""What a placeholder becomes before the processor expands `<|image_pad|>` (Qwen2-VL)."""


@dataclass
class MultimodalPrompt:
    """One prompt with its images, ready for rollout."""

    record: PromptRecord
    """The row's messages (placeholders kept), data_source, ground truth and extra_info."""
    prompt_ids: list[int]
    """Chat-template token ids, each image expanded to its number of `<|image_pad|>` tokens."""
    multimodal: MultimodalInputs | None
    """The images' pixel values and grids; None for a row without images."""


def _fail(index: int, where: str, why: str) -> DatasetError:
    return DatasetError(f"row {index} of {where}: field 'images' {why}")


def decode_image(value: Any, index: int, where: str, base_dir: Path | None = None):
    """One `images` entry -> an RGB PIL image; errors name the row, the entry and the fix."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(value, Image.Image):
        return value.convert("RGB")
    if isinstance(value, dict):  # datasets' Image feature: {"bytes": ..., "path": ...}
        value = value.get("bytes") or value.get("path") or value.get("image")
    if isinstance(value, bytes | bytearray):
        try:
            return Image.open(io.BytesIO(value)).convert("RGB")
        except (UnidentifiedImageError, OSError) as exc:
            raise _fail(
                index,
                where,
                f"holds {len(value)} bytes that are not a readable image "
                f"({exc}); store PNG/JPEG bytes or a file path",
            ) from None
    if isinstance(value, str | Path):
        path = Path(value)
        if not path.is_absolute() and base_dir is not None:
            path = base_dir / path
        if not path.exists():
            raise _fail(
                index,
                where,
                f"names {str(value)!r}, which does not exist (looked at "
                f"{path}); fix the path (relative paths are relative to "
                "the data file) or store the image bytes",
            )
        try:
            return Image.open(path).convert("RGB")
        except (UnidentifiedImageError, OSError) as exc:
            raise _fail(
                index,
                where,
                f"names {str(path)!r}, which is not a readable image ({exc}); replace the file",
            ) from None
    raise _fail(
        index,
        where,
        f"holds a {type(value).__name__}, not image bytes, a path, a "
        "{bytes, path} struct or a PIL image",
    )


def refuse_raw_vision_tokens(messages: list[dict], index: int, where: str) -> None:
    """No message already holds the processor's own vision tokens: the processor would expand
    them a second time (the classic placeholder off-by-n between rollout and training)."""
    for turn, m in enumerate(messages):
        if not isinstance(m["content"], str):
            continue
        found = {t: m["content"].count(t) for t in VISION_TOKENS if t in m["content"]}
        if found:
            raise DatasetError(
                f"row {index} of {where}: message {turn} ({m.get('role')}) already holds the "
                f"processor's vision tokens {found}; mark each image with one "
                f"{IMAGE_PLACEHOLDER} and let the processor expand it (expanded text would be "
                "expanded twice)"
            )


def with_vision_spans(messages: list[dict], index: int, where: str, n_images: int) -> list[dict]:
    """Messages with each `<image>` replaced by the vision span; counts must match."""
    refuse_raw_vision_tokens(messages, index, where)
    count = sum(
        m["content"].count(IMAGE_PLACEHOLDER) for m in messages if isinstance(m["content"], str)
    )
    if count != n_images:
        fix = (
            "add the missing images to 'images'"
            if count > n_images
            else f"add a {IMAGE_PLACEHOLDER} to the prompt for each image"
        )
        raise _fail(
            index,
            where,
            f"holds {n_images} image(s) but the prompt has {count} "
            f"{IMAGE_PLACEHOLDER} placeholder(s); {fix}",
        )
    return [
        {**m, "content": m["content"].replace(IMAGE_PLACEHOLDER, VISION_SPAN)}
        if isinstance(m["content"], str)
        else m
        for m in messages
    ]


def row_images(row: dict[str, Any], index: int, where: str, base_dir: Path | None = None) -> list:
    """The decoded PIL images of a row's `images` column (empty when it has none)."""
    raw = row.get("images") or []
    if not isinstance(raw, list | tuple):
        raise _fail(index, where, f"is a {type(raw).__name__}, not a list of images")
    return [decode_image(v, index, where, base_dir) for v in raw]


def multimodal_prompt_from_row(
    row: dict[str, Any],
    index: int,
    where: str,
    processor: VisionProcessor,
    base_dir: Path | None = None,
) -> MultimodalPrompt:
    """Validate a verl multimodal row and process its images and prompt."""
    record = record_from_row(row, index, where)
    images = row_images(row, index, where, base_dir)
    messages = with_vision_spans(record.prompt, index, where, len(images))
    if not images:
        return MultimodalPrompt(record, chat_prompt_ids(processor.tokenizer, messages), None)
    # render as text, then expand: each image gets exactly its grid's number of tokens
    text = processor.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    ids, mm = processor(text, images)
    try:  # the token ids hold exactly the processor's expansion of every image
        check_image_tokens(ids, mm, processor.image_token_id, processor.merge_size, "")
    except ConfigError as exc:
        raise DatasetError(f"row {index} of {where}{exc}") from None
    return MultimodalPrompt(record, ids, mm)


def load_multimodal_parquet(path: str | Path, processor: VisionProcessor) -> list[MultimodalPrompt]:
    """Rows of a verl multimodal parquet file (relative image paths: next to the file)."""
    import pyarrow.parquet as pq

    path = Path(path)
    if not path.exists():
        raise DatasetError(
            f"data file {path} does not exist; set data.train_files to a parquet file"
        )
    try:
        rows = pq.read_table(path).to_pylist()
    except (OSError, ValueError) as exc:
        raise DatasetError(f"data file {path} cannot be read as parquet ({exc})") from None
    if not rows:
        raise DatasetError(f"data file {path} has no rows")
    return [
        multimodal_prompt_from_row(r, i, path.name, processor, path.parent)
        for i, r in enumerate(rows)
    ]
