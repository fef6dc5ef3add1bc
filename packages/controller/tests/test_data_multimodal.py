"""verl multimodal rows -> prompt ids + pixel inputs: placeholder/image-token alignment per row
and clear errors for bad images."""

from __future__ import annotations

import io

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

from tephra.controller.data.multimodal import load_multimodal_parquet, multimodal_prompt_from_row
from tephra.controller.data.prompts import DatasetError
from tephra.rollout.multimodal import VisionProcessor, build_tiny_vlm


def _png(size, colour) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def proc(tmp_path_factory):
    vlm = build_tiny_vlm(tmp_path_factory.mktemp("vlm"))
    return VisionProcessor.from_pretrained(vlm.path)


def _row(content, images):
    return {
        "prompt": [{"role": "user", "content": content}],
        "data_source": "colours",
        "reward_model": {"ground_truth": "red"},
        "images": images,
    }


def test_parquet_rows_align_image_tokens_with_grids(proc, tmp_path):
    Image.new("RGB", (224, 112), "blue").save(tmp_path / "blue.png")
    rows = [
        # a parquet column holds one type: datasets' Image struct {bytes, path}
        _row(
            "<image>What colour is the square?", [{"bytes": _png((112, 112), "red"), "path": None}]
        ),
        _row(
            "Compare <image> and <image>.",
            [
                {"bytes": _png((168, 112), "green"), "path": None},
                {"bytes": None, "path": "blue.png"},
            ],
        ),
        _row("No image here.", []),
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "mm.parquet")
    prompts = load_multimodal_parquet(tmp_path / "mm.parquet", proc)
    # (h, w) / 14 patches; tokens = h * w / 4 (2x2 merge)
    expected = [[[1, 8, 8]], [[1, 8, 12], [1, 8, 16]], None]
    token_counts = [16, 24 + 32, 0]
    for p, grid, n in zip(prompts, expected, token_counts, strict=True):
        assert sum(t == proc.image_token_id for t in p.prompt_ids) == n
        if grid is None:
            assert p.multimodal is None
            continue
        assert p.multimodal.image_grid_thw.tolist() == grid
        assert p.multimodal.pixel_values.shape[0] == sum(t * h * w for t, h, w in grid)
        # each image's tokens are one run between vision_start and vision_end
        starts = [
            i
            for i, t in enumerate(p.prompt_ids)
            if t == proc.tokenizer.convert_tokens_to_ids("<|vision_start|>")
        ]
        runs = [
            p.prompt_ids[s + 1 : s + 1 + c]
            for s, c in zip(starts, p.multimodal.image_token_counts(2), strict=True)
        ]
        assert all(set(r) == {proc.image_token_id} for r in runs)
    # the second row's first image is the green one (order kept)
    green = proc.images([Image.new("RGB", (168, 112), "green")])
    torch.testing.assert_close(
        prompts[1].multimodal.pixel_values[: green.pixel_values.shape[0]], green.pixel_values
    )
    assert prompts[0].ground_truth == "red"


@pytest.mark.parametrize(
    ("content", "images", "match"),
    [
        (
            "<image>?",
            [b"not an image"],
            r"row 3 of t: field 'images' holds 12 bytes that are not a readable image",
        ),
        ("<image>?", ["missing.png"], r"'missing.png', which does not exist .* fix the path"),
        (
            "<image><image>?",
            [_png((112, 112), "red")],
            r"1 image\(s\) but the prompt has 2 <image>.*add the missing images",
        ),
        ("?", [_png((112, 112), "red")], r"1 image\(s\) but the prompt has 0 .*add a <image>"),
        ("<image>?", [_png((112, 112), "red")], None),  # raw bytes are fine
        ("<image>?", [3], r"holds a int, not image bytes"),
        (
            # a prompt expanded already (16 pads for a 112x112 image): expanded twice otherwise
            "<|vision_start|>" + "<|image_pad|>" * 16 + "<|vision_end|>?",
            [_png((112, 112), "red")],
            r"row 3 of t: message 0 \(user\) already holds the processor's vision tokens "
            r"\{'<\|vision_start\|>': 1, '<\|image_pad\|>': 16, '<\|vision_end\|>': 1\}; mark each "
            r"image with one <image>",
        ),
    ],
)
def test_bad_images_name_the_row_and_the_fix(proc, tmp_path, content, images, match):
    if match is None:
        assert (
            multimodal_prompt_from_row(_row(content, images), 3, "t", proc).multimodal.num_images
            == 1
        )
        return
    with pytest.raises(DatasetError, match=match):
        multimodal_prompt_from_row(_row(content, images), 3, "t", proc, tmp_path)


def test_parquet_videos_column_becomes_video_tokens_and_patches(proc, tmp_path):
    frames = [_png((140, 112), c) for c in ("red", "green", "blue", "white", "black")]
    rows = [
        {**_row("<video>What changes?", []), "videos": [{"video": frames}]},
        {
            **_row("<image> then <video>", [_png((112, 112), "red")]),
            "videos": [{"video": frames[:2]}],
        },
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "v.parquet")
    first, second = load_multimodal_parquet(tmp_path / "v.parquet", proc)
    # 5 frames, at most 8 sampled, padded to 6 (3 temporal patches of 2); 112x140 -> 8x10
    assert first.multimodal.video_grid_thw.tolist() == [[3, 8, 10]]
    assert first.multimodal.num_images == 0
    assert first.prompt_ids.count(proc.video_token_id) == 3 * 8 * 10 // 4
    # the processor's own video patches of the same frames (sampled the same way)
    want, _ = proc.videos([[Image.open(io.BytesIO(f)) for f in frames]])
    torch.testing.assert_close(first.multimodal.pixel_values_videos, want)
    assert second.multimodal.video_grid_thw.tolist() == [[1, 8, 10]]
    assert second.prompt_ids.count(proc.image_token_id) == 16
    assert second.prompt_ids.count(proc.video_token_id) == 20


@pytest.mark.parametrize(
    ("content", "videos", "match"),
    [
        ("<video>?", [], r"field 'videos' holds 0 video\(s\) but the prompt has 1 <video>"),
        ("?", [{"video": [_png((112, 112), "red")] * 2}], r"add a <video> to the prompt"),
        ("<video>?", [{"video": "clip.mp4"}], r"entry 0 is a str, not a non-empty list of frames"),
    ],
)
def test_bad_videos_name_the_row_and_the_fix(proc, content, videos, match):
    with pytest.raises(DatasetError, match=match):
        multimodal_prompt_from_row({**_row(content, []), "videos": videos}, 3, "t", proc)
