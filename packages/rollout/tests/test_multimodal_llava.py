"""LLaVA through the vision adapter: `VisionProcessor` gives what transformers' own
`LlavaProcessor` gives (token ids and pixels), the `hf` rollout's log-probs equal a
teacher-forced forward with the same images, and a placeholder count off by one is refused."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from tephra.engine_api.errors import ConfigError
from tephra.rollout.base import RolloutConfig, SamplingParams
from tephra.rollout.multimodal import VisionProcessor, build_tiny_vlm, vision_family


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    return build_tiny_vlm(tmp_path_factory.mktemp("llava"), family="llava")


def _text(body: str) -> str:
    return f"<|im_start|>user\n{body}<|im_end|>\n<|im_start|>assistant\n"


def test_processor_equals_transformers_llava_processor(llava):
    from transformers import LlavaProcessor

    proc = VisionProcessor.from_pretrained(llava.path)
    images = [Image.new("RGB", (80, 60), "red"), Image.new("RGB", (40, 90), "blue")]
    text = _text("<image>what colours? <image>")
    ids, mm = proc(text, images)
    want = LlavaProcessor.from_pretrained(llava.path)(text=text, images=images, return_tensors="pt")
    assert ids == want["input_ids"][0].tolist()
    assert torch.equal(mm.pixel_values, want["pixel_values"])
    # 56 x 56 after the centre crop: 4 x 4 patches of 14, the CLS feature dropped
    assert mm.image_grid_thw is None and proc.image_token_counts(mm) == [16, 16]
    assert ids.count(llava.image_token_id) == 32
    proc.check(ids, mm, "turn 1")
    with pytest.raises(
        ConfigError, match="turn 2: the prompt holds 31 image tokens but its images need 32"
    ):
        proc.check(
            ids[: ids.index(llava.image_token_id)] + ids[ids.index(llava.image_token_id) + 1 :],
            mm,
            "turn 2",
        )
    with pytest.raises(ConfigError, match="takes images only"):
        proc(_text("<video>"), [], [[Image.new("RGB", (56, 56))]])


def test_hf_rollout_logprobs_match_teacher_forced_forward(llava):
    from transformers import AutoModelForImageTextToText

    from tephra.rollout.backends.hf import HFRollout

    proc = VisionProcessor.from_pretrained(llava.path)
    prompts = [
        proc(_text("<image>what colour is the square?"), [Image.new("RGB", (56, 56), "red")]),
        proc(
            _text("<image><image>and these?"),
            [Image.new("RGB", (70, 56), "green"), Image.new("RGB", (56, 56), "blue")],
        ),
        proc(_text("no image here, a longer text prompt"), []),
    ]
    ids, mm = [p[0] for p in prompts], [p[1] for p in prompts]
    rollout = HFRollout(RolloutConfig(model_path=llava.path))
    out = rollout.generate(
        ids,
        SamplingParams(n=2, temperature=1.0, max_tokens=8, seed=3, ignore_eos=True),
        multimodal=mm,
    )
    rollout.close()
    model = AutoModelForImageTextToText.from_pretrained(llava.path, dtype=torch.float32).eval()
    family = vision_family(model.config)
    checked = [i for i in range(len(out)) if llava.image_token_id not in out.response_ids[i]]
    assert len(checked) >= 4
    gaps = []
    for i in checked:
        p = out.prompt_index[i]
        full = torch.tensor([ids[p] + out.response_ids[i]])
        with torch.no_grad():
            logits = model(
                input_ids=full, **family.model_kwargs(full, [mm[p]], model.config)
            ).logits[0]
        start = len(ids[p])
        ref = torch.log_softmax(logits[start - 1 : -1].float(), -1)
        ref = ref.gather(-1, full[0, start:, None])[:, 0]
        gaps.append((torch.tensor(out.log_probs[i]) - ref).abs())
    assert torch.cat(gaps).mean() < 1e-4 and torch.cat(gaps).max() < 1e-5
    # the images matter: other pixels, other log-probs
    full = torch.tensor([ids[0] + out.response_ids[0]])
    white = proc.images([Image.new("RGB", (56, 56), "white")])
    with torch.no_grad():
        other = model(input_ids=full, **family.model_kwargs(full, [white], model.config)).logits
        same = model(input_ids=full, **family.model_kwargs(full, [mm[0]], model.config)).logits
    assert (other - same).abs().max() > 1e-3
