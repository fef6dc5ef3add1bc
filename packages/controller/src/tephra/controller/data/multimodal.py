"""Prompts with images: verl's multimodal rows, loaded with the model's processor.

A verl multimodal row is a normal row (see `tephra.controller.data.prompts`) plus an `images` column:
a list whose entries are image bytes (PNG/JPEG...), a file path, a `{"bytes": ..., "path":
...}` struct (how `datasets` stores an Image feature in parquet) or a PIL image. The prompt's
messages mark where each image goes with `<image>`, in order. An optional `videos` column
holds videos the same way, each a list of frames (entries as for images) or a `{"video":
[frames...]}` struct, marked by `<video>`; frames are sampled as the processor expects
(`tephra.rollout.multimodal.sample_frames`). Each row becomes a `Prompt`
(`tephra.episodes.prompt`) with its token ids (chat template, each `<image>` expanded to the
image's run of vision tokens) and its `MultimodalInputs` (pixel values and grids), which
travel with the sample to rollout and the trainer.
"""

from __future__ import annotations

import io
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tephra.controller.data.prompts import (
    DatasetError,
    chat_prompt_ids,
    record_from_row,
)
from tephra.engine_api.errors import ConfigError
from tephra.episodes.prompt import Prompt
from tephra.rollout.multimodal import (
    VISION_TOKENS,
    VisionProcessor,
)

if TYPE_CHECKING:  # PIL is imported where images are decoded: text-only runs never load it
    from PIL import Image as PILImage

IMAGE_PLACEHOLDER = "<image>"
"""verl's marker of an image in a message's text."""

VIDEO_PLACEHOLDER = "<video>"
"""verl's marker of a video in a message's text."""


def _fail(index: int, where: str, why: str, field: str = "images") -> DatasetError:
    return DatasetError(f"row {index} of {where}: field {field!r} {why}")


def decode_image(
    value: Any, index: int, where: str, base_dir: Path | None = None
) -> PILImage.Image:
    """One `images` entry -> an RGB PIL image; errors name the row, the entry and the fix."""
    # PIL only here: text-only runs never decode images
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


def with_vision_spans(
    messages: list[dict],
    index: int,
    where: str,
    processor: VisionProcessor,
    n_images: int,
    n_videos: int = 0,
) -> list[dict]:
    """Messages with each `<image>` (`<video>`) replaced by the vision span of `processor`'s
    model family; counts must match."""
    refuse_raw_vision_tokens(messages, index, where)
    for marker, n, field, what in (
        (IMAGE_PLACEHOLDER, n_images, "images", "image"),
        (VIDEO_PLACEHOLDER, n_videos, "videos", "video"),
    ):
        count = sum(m["content"].count(marker) for m in messages if isinstance(m["content"], str))
        if count != n:
            fix = (
                f"add the missing {what}s to {field!r}"
                if count > n
                else f"add a {marker} to the prompt for each {what}"
            )
            raise _fail(
                index,
                where,
                f"holds {n} {what}(s) but the prompt has {count} {marker} placeholder(s); {fix}",
                field,
            )
    spans = {IMAGE_PLACEHOLDER: processor.span_text(processor.image_token)}
    # a family without videos: the count check above already refused any <video>
    if processor.video_token is not None:
        spans[VIDEO_PLACEHOLDER] = processor.span_text(processor.video_token)

    def expand(text: str) -> str:
        for marker, span in spans.items():
            text = text.replace(marker, span)
        return text

    return [
        {**m, "content": expand(m["content"])} if isinstance(m["content"], str) else m
        for m in messages
    ]


def row_images(row: dict[str, Any], index: int, where: str, base_dir: Path | None = None) -> list:
    """The decoded PIL images of a row's `images` column (empty when it has none)."""
    raw = row.get("images") or []
    if not isinstance(raw, list | tuple):
        raise _fail(index, where, f"is a {type(raw).__name__}, not a list of images")
    return [decode_image(v, index, where, base_dir) for v in raw]


def row_videos(row: dict[str, Any], index: int, where: str, base_dir: Path | None = None) -> list:
    """The decoded frames (lists of PIL images) of a row's `videos` column (empty without)."""
    raw = row.get("videos") or []
    if not isinstance(raw, list | tuple):
        raise _fail(index, where, f"is a {type(raw).__name__}, not a list of videos", "videos")
    videos = []
    for k, video in enumerate(raw):
        frames = video.get("video") or video.get("frames") if isinstance(video, dict) else video
        if not isinstance(frames, list | tuple) or not frames:
            raise _fail(
                index,
                where,
                f"entry {k} is a {type(frames).__name__}, not a non-empty list of frames; store "
                "each video as its frames (image bytes or paths), e.g. {'video': [frame, ...]} "
                "(video files need a decoder tephra does not ship: extract the frames first)",
                "videos",
            )
        videos.append([decode_image(f, index, where, base_dir) for f in frames])
    return videos


def multimodal_prompt_from_row(
    row: dict[str, Any],
    index: int,
    where: str,
    processor: VisionProcessor,
    base_dir: Path | None = None,
) -> Prompt:
    """Validate a verl multimodal row and process its images and prompt."""
    record = record_from_row(row, index, where)
    images = row_images(row, index, where, base_dir)
    videos = row_videos(row, index, where, base_dir)
    messages = with_vision_spans(record.messages, index, where, processor, len(images), len(videos))
    if not images and not videos:
        return replace(record, prompt_ids=chat_prompt_ids(processor.tokenizer, messages))
    # render as text, then expand: each image gets exactly its grid's number of tokens
    text = processor.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    ids, mm = processor(text, images, videos)
    try:  # the token ids hold exactly the processor's expansion of every image and video
        processor.check(ids, mm, "")
    except ConfigError as exc:
        raise DatasetError(f"row {index} of {where}{exc}") from None
    return replace(record, prompt_ids=ids, multimodal=mm)


def load_multimodal_parquet(path: str | Path, processor: VisionProcessor) -> list[Prompt]:
    """Rows of a verl multimodal parquet file (relative image paths: next to the file)."""
    import pyarrow.parquet as pq  # heavy: only parquet data needs it

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
