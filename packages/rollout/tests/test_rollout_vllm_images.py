"""Images on the `vllm` backend against a real vLLM CPU server (a tiny random Qwen2-VL),
compared with the `hf` backend on the same weights and pixels: greedy output token for token,
log-probs, and a weight update of the vision tower alone reaching the server."""

from __future__ import annotations

import asyncio

import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText

from tephra.engine_api.errors import ConfigError
from tephra.rollout import RolloutConfig, RolloutError, SamplingParams, ServerSettings, get_rollout
from tephra.rollout.multimodal import MultimodalInputs, VisionProcessor, build_tiny_vlm

pytestmark = [pytest.mark.vllm, pytest.mark.multiproc]

LOGPROB_TOL = 1e-4
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    return build_tiny_vlm(tmp_path_factory.mktemp("vlm"))


@pytest.fixture(scope="module")
def rollouts(vlm, vllm_python):
    """One vLLM server for the module, started with a run key (so image requests also pass
    tephra's route guard), and an `hf` rollout on the same folder."""
    config = RolloutConfig(
        model_path=vlm.path,
        max_model_len=512,
        vllm=ServerSettings(
            python=vllm_python,
            startup_timeout_s=300,
            request_timeout_s=120,
            api_key="auto",
            weight_bucket_mb=0.05,
        ),
    )
    vllm = get_rollout("vllm", config)
    hf = get_rollout("hf", config)
    yield vllm, hf
    vllm.close()
    hf.close()


@pytest.fixture(scope="module")
def prompts(vlm):
    proc = VisionProcessor.from_pretrained(vlm.path)

    def prompt(text: str, images: list) -> tuple[list[int], MultimodalInputs | None]:
        pads = "".join("<|vision_start|><|image_pad|><|vision_end|>" for _ in images)
        ids, mm = proc(f"<|im_start|>user\n{pads}{text}<|im_end|>\n<|im_start|>assistant\n", images)
        return ids, (mm if images else None)

    made = [
        prompt("what colour?", [Image.new("RGB", (112, 112), "red")]),
        # two images of different grids (8x10 and 8x8 patches) in one prompt
        prompt(
            "and these?",
            [Image.new("RGB", (140, 112), "green"), Image.new("RGB", (112, 112), "blue")],
        ),
        prompt("no image here", []),
    ]
    return [p[0] for p in made], [p[1] for p in made]


def assert_same(a, b):
    assert a.response_ids == b.response_ids
    for x, y in zip(a.log_probs, b.log_probs):
        torch.testing.assert_close(torch.tensor(x), torch.tensor(y), atol=LOGPROB_TOL, rtol=0)


def test_vllm_greedy_with_images_equals_hf(rollouts, prompts, vlm):
    vllm, hf = rollouts
    ids, images = prompts
    ours = vllm.generate(ids, GREEDY, multimodal=images)
    assert_same(ours, hf.generate(ids, GREEDY, multimodal=images))
    # the images reach the model: the same token ids without them give other tokens
    blind = vllm.generate(ids[:2], GREEDY)
    assert blind.response_ids != ours.response_ids[:2]
    # one request at a time (agent loops) gives the same sample
    sample = asyncio.run(vllm.agenerate(ids[1], GREEDY, multimodal=images[1]))
    assert sample.response_ids == ours.response_ids[1]


def test_vllm_update_of_the_vision_tower_reaches_the_server(rollouts, prompts, vlm, tmp_path):
    """Only the vision tower's weights change (those of tiny VLMs of other seeds, in the
    Hugging Face names the trainer exports), in memory and then through the disk: image
    prompts follow them on the server as on hf, the text-only prompt does not change."""
    vllm, hf = rollouts
    ids, images = prompts
    before = vllm.generate(ids, GREEDY, multimodal=images)

    def tower(seed: int) -> dict[str, torch.Tensor]:
        other = build_tiny_vlm(tmp_path / f"seed{seed}", seed=seed)
        model = AutoModelForImageTextToText.from_pretrained(other.path, dtype=torch.float32)
        return {k: v for k, v in model.state_dict().items() if k.startswith("model.visual.")}

    def update(weights: dict[str, torch.Tensor]):
        assert len(weights) > 10
        for rollout in (hf, vllm):
            rollout.update_weights(iter(weights.items()))
        after = vllm.generate(ids, GREEDY, multimodal=images)
        assert_same(after, hf.generate(ids, GREEDY, multimodal=images))
        for i in (0, 1):
            assert after.log_probs[i] != pytest.approx(before.log_probs[i], abs=1e-3)
        assert after.response_ids[2] == before.response_ids[2]
        torch.testing.assert_close(
            torch.tensor(after.log_probs[2]), torch.tensor(before.log_probs[2])
        )
        return after

    in_memory = update(tower(1))
    vllm.settings.weight_sync = "disk"  # the fallback: safetensors reloaded by the server
    try:
        on_disk = update(tower(2))
        assert any(p.name.startswith("update-") for p in vllm.weights_dir.iterdir())
    finally:
        vllm.settings.weight_sync = "memory"
    assert on_disk.log_probs[0] != pytest.approx(in_memory.log_probs[0], abs=1e-3)


def test_vllm_refuses_videos_and_miscounted_images(rollouts, prompts):
    vllm, _ = rollouts
    ids, images = prompts
    video = MultimodalInputs(
        images[0].pixel_values[:0],
        images[0].image_grid_thw[:0],
        images[0].pixel_values,
        torch.tensor([[1, 8, 8]]),
    )
    with pytest.raises(RolloutError, match="takes images, not videos; set rollout.backend=hf"):
        vllm.generate([ids[0]], GREEDY, multimodal=[video])
    # prompt 0's ids hold one image's placeholders; prompt 1's two images need more
    with pytest.raises(ConfigError, match="prompt 0: the prompt holds 16 image tokens"):
        vllm.generate([ids[0]], GREEDY, multimodal=[images[1]])


@pytest.mark.slow  # a second server start (~35 s); the renaming itself is tested by default
def test_llava_on_vllm_equals_hf_and_follows_a_tower_update(tmp_path, vllm_python):
    """A tiny LLaVA (CLIP tower saved by transformers 5 as `vision_tower.*`, served and
    updated as vLLM names it, `vision_tower.vision_model.*`): greedy output and log-probs equal
    hf's with two images, one image and none, before and after an update of the CLIP tower."""
    llava = build_tiny_vlm(tmp_path / "llava", family="llava")
    proc = VisionProcessor.from_pretrained(llava.path)
    made = [
        proc(f"<|im_start|>user\n{'<image>' * len(images)}{text}<|im_end|>\n", images)
        for text, images in (
            (
                "what colours?",
                [Image.new("RGB", (56, 56), "green"), Image.new("RGB", (80, 60), "red")],
            ),
            ("and this?", [Image.new("RGB", (56, 56), "blue")]),
            ("no image", []),
        )
    ]
    ids, images = [m[0] for m in made], [m[1] for m in made]
    config = RolloutConfig(
        model_path=llava.path,
        max_model_len=256,
        vllm=ServerSettings(python=vllm_python, startup_timeout_s=300, request_timeout_s=120),
    )
    other = build_tiny_vlm(tmp_path / "other", family="llava", seed=1)
    model = AutoModelForImageTextToText.from_pretrained(other.path, dtype=torch.float32)
    tower = {k: v for k, v in model.state_dict().items() if k.startswith("model.vision_tower.")}
    assert len(tower) > 10
    with get_rollout("vllm", config) as vllm, get_rollout("hf", config) as hf:
        before = vllm.generate(ids, GREEDY, multimodal=images)
        assert_same(before, hf.generate(ids, GREEDY, multimodal=images))
        for rollout in (hf, vllm):
            rollout.update_weights(iter(tower.items()))
        after = vllm.generate(ids, GREEDY, multimodal=images)
        assert_same(after, hf.generate(ids, GREEDY, multimodal=images))
    assert after.log_probs[0] != pytest.approx(before.log_probs[0], abs=1e-3)
    assert after.response_ids[2] == before.response_ids[2]
