"""Multi-turn episodes with images (tiny random Qwen2-VL and LLaVA): the `colour_squares` environment
shows a new square after each answer; each turn's image tokens are the processor's expansion,
the trainer's recomputed log-probs equal the hf rollout's, and a turn whose placeholders
drift from its images is refused with a message naming the turn."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest

from tephra.core.errors import ConfigError
from tephra.engine_api import batch as B
from tephra.engine_api.config import EngineConfig, ModelConfig
from tephra.engine_fsdp.engine import FSDPEngine
from tephra.episodes.agent.base import AgentLoopConfig
from tephra.episodes.agent.chat_tokens import ChatTemplateDelta
from tephra.episodes.agent.loops import EnvironmentLoop
from tephra.episodes.environments.base import Environment, StepResult
from tephra.episodes.environments.colour_squares import colour_square
from tephra.episodes.prompt import Prompt
from tephra.rollout.backends.hf import HFRollout
from tephra.rollout.base import RolloutConfig, SamplingParams
from tephra.rollout.multimodal import VisionProcessor, build_tiny_vlm
from tephra.rollout.samples import to_batch

QUESTION = "<image>What colour is the square? Answer with one word."
SPAN = "<|vision_start|><|image_pad|><|vision_end|>"


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    return build_tiny_vlm(tmp_path_factory.mktemp("vlm"), family="qwen2_vl")


def _item(proc: VisionProcessor, seed: int) -> Prompt:
    name, image = colour_square(random.Random(seed))
    messages = [{"role": "user", "content": QUESTION}]
    text = ChatTemplateDelta(proc.tokenizer).render(
        [
            {
                "role": "user",
                "content": QUESTION.replace("<image>", proc.span_text(proc.image_token)),
            }
        ],
        True,
    )
    ids, mm = proc(text, [image])
    return Prompt(
        messages=messages,
        sample_id=f"colours-{seed}",
        prompt_ids=ids,
        multimodal=mm,
        interaction_kwargs={"ground_truth": name},
    )


def _loop(proc: VisionProcessor, environment: str, turns: int = 3) -> EnvironmentLoop:
    cfg = AgentLoopConfig(
        max_turns=turns,
        max_response_tokens=400,
        environment=environment,
        environment_kwargs={"turns": turns},
    )
    return EnvironmentLoop(proc.tokenizer, cfg, processor=proc)


class _LoopOf(EnvironmentLoop):
    """The environment loop over a test's own environment class."""

    def __init__(self, env_cls, proc: VisionProcessor) -> None:
        super().__init__(proc.tokenizer, AgentLoopConfig(max_turns=2), processor=proc)
        self.env_cls = env_cls

    def make_environment(self) -> Environment:
        return self.env_cls(self.tools, self.config)


async def _episodes(loop, rollout, items) -> list[Any]:
    return list(
        await asyncio.gather(
            *(
                loop.run(rollout, item, SamplingParams(temperature=1.0, max_tokens=5, seed=k))
                for k, item in enumerate(items)
            )
        )
    )


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    return build_tiny_vlm(tmp_path_factory.mktemp("llava"), family="llava")


@pytest.mark.parametrize("family", ["vlm", "llava"])
def test_multi_turn_images_recompute_to_the_rollouts_log_probs(family, request):
    # Qwen2-VL (112-pixel squares: 8 x 8 patches merged 2 x 2) and LLaVA (cropped to 56
    # pixels: 4 x 4 patches): 16 image tokens a square either way, counted by each family
    vlm = request.getfixturevalue(family)
    proc = VisionProcessor.from_pretrained(vlm.path)
    items = [_item(proc, seed) for seed in range(4)]
    rollout = HFRollout(RolloutConfig(model_path=vlm.path))
    try:
        samples = asyncio.run(_episodes(_loop(proc, "colour_squares"), rollout, items))
    finally:
        rollout.close()
    assert all(s.finish_reason == "done" for s in samples), [s.finish_reason for s in samples]
    assert [s.multimodal.num_images for s in samples] == [3] * 4
    for s in samples:
        # one image per turn the model answered but the last, each expanded to 16 tokens
        ids = s.prompt_ids + s.response_ids
        assert sum(t == proc.image_token_id for t in ids) == 16 * s.multimodal.num_images
        assert s.env_reward is not None and 0 <= s.env_reward <= 1
        # observation tokens (the new squares) are context, never trained
        resp = [t for t, m in zip(s.response_ids, s.response_mask, strict=True) if m]
        assert proc.image_token_id not in resp
    batch = to_batch(samples, vlm.pad_token_id)
    engine = FSDPEngine.build(EngineConfig(model=ModelConfig(path=vlm.path), device="cpu"))
    with engine.eval_mode():
        got = engine.forward(batch)["log_probs"]
    mask = batch[B.RESPONSE_MASK].bool()
    gap = (got[mask] - batch["rollout_log_probs"][mask]).abs()
    # measured (Qwen2-VL): mean 4.1e-7, max 1.4e-6 in float32 (4 episodes of 3 turns, 3 images
    # each)
    assert gap.mean() < 1e-4 and gap.max() < 1e-3, (gap.mean(), gap.max())


class _TwoMarkersOneImage(Environment):
    """Shows one image but marks two: the turn must be refused."""

    async def step(self, action: str) -> StepResult:
        _, image = colour_square(random.Random(0))
        return StepResult(
            observation=[{"role": "user", "content": "<image><image>and these?"}], images=[image]
        )


class _TemplateImageTokens(Environment):
    """Writes the processor's own (unexpanded) image span in the observation via the chat
    template's content parts: its image tokens drift from the processor's expansion."""

    async def step(self, action: str) -> StepResult:
        return StepResult(observation=[{"role": "user", "content": "look"}])


def test_placeholder_drift_is_refused_naming_the_turn(vlm, monkeypatch):
    proc = VisionProcessor.from_pretrained(vlm.path)
    rollout = HFRollout(RolloutConfig(model_path=vlm.path))
    try:
        with pytest.raises(
            ConfigError,
            match=r"observation after model turn 1 marks 2 image\(s\) with <image> but step "
            r"returned 1",
        ):
            asyncio.run(_episodes(_LoopOf(_TwoMarkersOneImage, proc), rollout, [_item(proc, 0)]))
        # a chat template that writes an image span of its own around a user turn: one
        # unexpanded <|image_pad|> where the processor's expansion says none
        template = proc.tokenizer.chat_template
        monkeypatch.setattr(
            proc.tokenizer,
            "chat_template",
            template.replace(
                "{{ message['content'] }}",
                "{% if message['content'] == 'look' %}" + SPAN + "{% endif %}"
                "{{ message['content'] }}",
            ),
        )
        with pytest.raises(
            ConfigError,
            match=r"the observation after model turn 1: the prompt holds 1 image tokens but "
            r"its images need 0",
        ):
            asyncio.run(_episodes(_LoopOf(_TemplateImageTokens, proc), rollout, [_item(proc, 0)]))
    finally:
        rollout.close()


def test_a_sampled_image_placeholder_ends_the_turn_before_it(vlm):
    from tephra.rollout.samples import Sample

    proc = VisionProcessor.from_pretrained(vlm.path)
    loop = _loop(proc, "colour_squares")
    gen = Sample(response_ids=[5, proc.image_token_id, 6], log_probs=[-1.0, -2.0, -3.0])
    cut, sampled = loop.before_image_slot(gen)
    assert sampled and cut.finish_reason == "image_token"
    assert (cut.response_ids, cut.response_mask, cut.log_probs) == ([5], [1], [-1.0])
    first, sampled = loop.before_image_slot(Sample(response_ids=[proc.image_token_id]))
    assert sampled and first.response_ids == [] and first.response_mask == []
    assert loop.before_image_slot(Sample(response_ids=[5, 6]))[1] is False
