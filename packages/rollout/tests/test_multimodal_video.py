"""Videos through the processor and the `hf` rollout: patches laid out as Qwen2-VL's video
processing does (checked against a numpy reference of that layout), frames sampled to a
multiple of the temporal patch, and the rollout's log-probs equal a teacher-forced HF forward
with the same video (Qwen2-VL and Qwen2.5-VL)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from tephra.rollout.base import RolloutConfig, SamplingParams
from tephra.rollout.multimodal import (
    VisionProcessor,
    build_tiny_vlm,
    hf_model_kwargs,
    sample_frames,
)

SPAN = "<|vision_start|><|video_pad|><|vision_end|>"


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def vlm(tmp_path_factory, request):
    return build_tiny_vlm(tmp_path_factory.mktemp("vlm"), family=request.param)


def _frames(n: int, size=(140, 112), seed: int = 0) -> list:
    rng = np.random.RandomState(seed)
    return [
        Image.fromarray((rng.rand(size[1], size[0], 3) * 255).astype("uint8")) for _ in range(n)
    ]


def test_sample_frames_spreads_and_pads_to_the_temporal_patch():
    assert sample_frames(list(range(10)), 4) == [0, 3, 6, 9]
    assert sample_frames(list(range(3)), 8) == [0, 1, 2, 2]  # odd: the last frame repeated
    assert sample_frames(list(range(5)), 5) == [0, 1, 3, 4]  # at most 4 (a multiple of 2)


def test_video_patches_match_the_qwen2_vl_video_layout(vlm):
    proc = VisionProcessor.from_pretrained(vlm.path)
    frames = _frames(4)
    pixels, grid = proc.videos([frames])
    assert grid.tolist() == [[2, 8, 10]]  # 4 frames -> 2 temporal patches of 112x140 pixels
    # reference: normalise, stack (T, C, H, W), group 2 frames a temporal patch, merge 2x2
    ip = proc.image_processor
    mean, std = np.array(ip.image_mean)[:, None, None], np.array(ip.image_std)[:, None, None]
    x = np.stack(
        [(np.asarray(f, np.float32).transpose(2, 0, 1) / 255 - mean) / std for f in frames]
    )
    p, m, t = 14, 2, 2
    gt, gh, gw = 2, 8, 10
    x = x.reshape(gt, t, 3, gh // m, m, p, gw // m, m, p).transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    np.testing.assert_allclose(pixels.numpy(), x.reshape(gt * gh * gw, -1), atol=1e-5)
    ids, mm = proc(f"{SPAN}what moves?", [], [frames])
    assert ids.count(proc.video_token_id) == mm.video_token_counts(2)[0] == 2 * 8 * 10 // 4
    assert mm.num_images == 0 and mm.num_videos == 1


def test_hf_rollout_video_logprobs_match_teacher_forced_forward(vlm):
    from transformers import AutoModelForImageTextToText

    from tephra.rollout.backends.hf import HFRollout

    proc = VisionProcessor.from_pretrained(vlm.path)
    prompts = [
        proc(
            f"<|im_start|>user\n{SPAN}what moves?<|im_end|>\n<|im_start|>assistant\n",
            [],
            [_frames(5)],
        ),
        proc(
            "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>"
            f"{SPAN}both<|im_end|>\n<|im_start|>assistant\n",
            [Image.new("RGB", (112, 112), "red")],
            [_frames(2, (112, 112), 1)],
        ),
    ]
    ids = [p[0] for p in prompts]
    mm = [p[1] for p in prompts]
    rollout = HFRollout(RolloutConfig(model_path=vlm.path))
    out = rollout.generate(
        ids,
        SamplingParams(n=2, temperature=1.0, max_tokens=6, seed=3, ignore_eos=True),
        multimodal=mm,
    )
    rollout.close()
    model = AutoModelForImageTextToText.from_pretrained(vlm.path, dtype=torch.float32).eval()
    vid = model.config.video_token_id
    checked = [
        i for i in range(len(out)) if not {vlm.image_token_id, vid} & set(out.response_ids[i])
    ]
    assert len(checked) >= 2
    for i in checked:
        p = out.prompt_index[i]
        full = torch.tensor([ids[p] + out.response_ids[i]])
        with torch.no_grad():
            logits = model(
                input_ids=full, **hf_model_kwargs(full, [mm[p]], vlm.image_token_id, vid)
            ).logits[0]
        start = len(ids[p])
        ref = torch.log_softmax(logits[start - 1 : -1].float(), -1)
        ref = ref.gather(-1, full[0, start:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(out.log_probs[i]), ref, atol=1e-5, rtol=0)
    # the video matters: other frames, other log-probs
    full = torch.tensor([ids[0] + out.response_ids[0]])
    flipped = type(mm[0])(
        mm[0].pixel_values,
        mm[0].image_grid_thw,
        mm[0].pixel_values_videos.flip(0),
        mm[0].video_grid_thw,
    )
    with torch.no_grad():
        a = model(input_ids=full, **hf_model_kwargs(full, [mm[0]], vlm.image_token_id, vid)).logits
        b = model(
            input_ids=full, **hf_model_kwargs(full, [flipped], vlm.image_token_id, vid)
        ).logits
    assert (a - b).abs().max() > 1e-4
