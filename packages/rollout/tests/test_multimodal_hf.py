"""Images through the `hf` rollout: log-probs equal a teacher-forced HF forward with the same
images (an unpadded, one-sample-at-a-time reference), for Qwen2-VL and Qwen2.5-VL."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from tephra.engine_api.errors import ConfigError
from tephra.rollout.base import RolloutConfig, SamplingParams
from tephra.rollout.multimodal import VisionProcessor, build_tiny_vlm, hf_model_kwargs


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def vlm(tmp_path_factory, request):
    return build_tiny_vlm(tmp_path_factory.mktemp("vlm"), family=request.param)


def _prompt(proc: VisionProcessor, text: str, images: list) -> tuple[list[int], object]:
    pads = "".join("<|vision_start|><|image_pad|><|vision_end|>" for _ in images)
    return proc(f"<|im_start|>user\n{pads}{text}<|im_end|>\n<|im_start|>assistant\n", images)


def test_image_token_counts_match_grids(vlm):
    proc = VisionProcessor.from_pretrained(vlm.path)
    images = [Image.new("RGB", (112, 112), "red"), Image.new("RGB", (168, 224), "blue")]
    ids, mm = _prompt(proc, "what colours?", images)
    # 112x112 -> 8x8 patches -> 16 tokens; 168 wide x 224 high -> 16x12 patches -> 48 tokens
    assert mm.image_grid_thw.tolist() == [[1, 8, 8], [1, 16, 12]]
    assert mm.image_token_counts(2) == [16, 48]
    assert sum(t == vlm.image_token_id for t in ids) == 64
    with pytest.raises(ConfigError, match="placeholders for 2 images"):
        proc.expand("<|image_pad|>", mm)


def test_hf_rollout_logprobs_match_teacher_forced_forward(vlm):
    from transformers import AutoModelForImageTextToText

    from tephra.rollout.backends.hf import HFRollout

    proc = VisionProcessor.from_pretrained(vlm.path)
    prompts = [
        _prompt(proc, "what colour is the square?", [Image.new("RGB", (112, 112), "red")]),
        _prompt(
            proc,
            "and these?",
            [Image.new("RGB", (140, 112), "green"), Image.new("RGB", (112, 112), "blue")],
        ),
        _prompt(proc, "no image here, a longer text prompt", []),
    ]
    ids = [p[0] for p in prompts]
    mm = [p[1] for p in prompts]
    rollout = HFRollout(RolloutConfig(model_path=vlm.path))
    out = rollout.generate(
        ids,
        SamplingParams(n=2, temperature=1.0, max_tokens=8, seed=3, ignore_eos=True),
        multimodal=mm,
    )
    rollout.close()
    model = AutoModelForImageTextToText.from_pretrained(vlm.path, dtype=torch.float32).eval()
    # a response that sampled the image placeholder has no image behind it, so no forward
    # can take it (the trainer ends such responses before it: rl_worker.end_before_token)
    checked = [i for i in range(len(out)) if vlm.image_token_id not in out.response_ids[i]]
    assert len(checked) >= 4
    for i in checked:
        p = out.prompt_index[i]
        full = torch.tensor([ids[p] + out.response_ids[i]])
        with torch.no_grad():
            logits = model(
                input_ids=full, **hf_model_kwargs(full, [mm[p]], vlm.image_token_id)
            ).logits[0]
        start = len(ids[p])
        ref = torch.log_softmax(logits[start - 1 : -1].float(), -1)
        ref = ref.gather(-1, full[0, start:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(out.log_probs[i]), ref, atol=1e-5, rtol=0)
    # the images matter: the same prompt ids without them give other log-probs
    full = torch.tensor([ids[0] + out.response_ids[0]])
    with torch.no_grad():
        other = model(
            input_ids=full,
            **hf_model_kwargs(
                full, [proc.images([Image.new("RGB", (112, 112), "white")])], vlm.image_token_id
            ),
        ).logits
        same = model(input_ids=full, **hf_model_kwargs(full, [mm[0]], vlm.image_token_id)).logits
    assert (other - same).abs().max() > 1e-3
