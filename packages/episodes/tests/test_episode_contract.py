"""The episode contract: any async function `(rollout, item, sampling) -> list[Sample]` is an
episode; `run_episodes` runs them concurrently and keeps the items' order."""

from __future__ import annotations

import asyncio

import pytest
from transformers import AutoTokenizer

from tephra.core.errors import RegistryError
from tephra.episodes.agent import Prompt, SingleTurnAgentLoop, ToolAgentLoop
from tephra.episodes.episode import run_episodes
from tephra.episodes.registry import EPISODES
from tephra.rollout import Sample, SamplingParams
from tephra.rollout.backends.hf import HFRollout
from tephra.rollout.base import RolloutConfig


def two_answers(tokenizer, config, tools):
    """A hand-written episode factory: two samples per item, the second one longer."""

    async def episode(rollout, item, sampling):
        await asyncio.sleep(0.01 * (3 - len(item.prompt_ids)))  # later items finish first
        return [
            Sample(item.prompt_ids, [7] * k, sample_id=item.sample_id, finish_reason="length")
            for k in (1, sampling.max_tokens)
        ]

    return episode


def test_a_plain_async_function_is_an_episode_and_order_is_kept():
    episode = two_answers(None, None, {})
    items = [Prompt([], sample_id=f"i{k}", prompt_ids=[1] * (k + 1)) for k in range(3)]
    samples = asyncio.run(
        run_episodes(episode, None, items, SamplingParams(max_tokens=3), max_in_flight=2)
    )
    assert [s.sample_id for s in samples] == ["i0", "i0", "i1", "i1", "i2", "i2"]
    assert [len(s.response_ids) for s in samples] == [1, 3] * 3
    assert [s.prompt_ids for s in samples[::2]] == [[1], [1, 1], [1, 1, 1]]


def test_the_registry_lists_the_built_in_episodes():
    # other tests (the README's) may have registered their own beside the built-ins
    assert {"single_turn", "tool_agent"} <= set(EPISODES.names())
    assert EPISODES.get("single_turn") is SingleTurnAgentLoop
    assert EPISODES.get("tool_agent") is ToolAgentLoop
    with pytest.raises(
        RegistryError, match="unknown agent loop 'tool_agnet'.*did you mean 'tool_agent'"
    ):
        EPISODES.get("tool_agnet")


def test_a_seeded_run_gives_each_item_its_own_stream_as_generate_does(tiny_model):
    # eight copies of one prompt (a GRPO group): sample k of the run is sample k of one seeded
    # `generate` call (seed + k), so the group's samples differ
    tok = AutoTokenizer.from_pretrained(tiny_model.path)
    rollout = HFRollout(RolloutConfig(model_path=tiny_model.path, max_model_len=256))
    prompt = tok.encode("What is 12 plus 30?")
    sampling = SamplingParams(temperature=1.0, max_tokens=8, seed=5)
    items = [Prompt([], sample_id=f"s{k}", prompt_ids=prompt) for k in range(8)]
    try:
        episode = EPISODES.get("single_turn")(tok)
        samples = asyncio.run(run_episodes(episode, rollout, items, sampling))
        reference = rollout.generate([prompt], sampling.replace(n=8)).samples
    finally:
        rollout.close()
    assert [s.response_ids for s in samples] == [s.response_ids for s in reference]
    assert len({tuple(s.response_ids) for s in samples}) > 1
