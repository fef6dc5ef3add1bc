"""The one prompt type: its validation, its equality, and the one score type it shares with
the rollout package."""

from __future__ import annotations

import pytest
import torch

from tephra.core.errors import ConfigError
from tephra.episodes import rewards
from tephra.episodes.prompt import Prompt
from tephra.rollout import RewardResult, Sample
from tephra.rollout.multimodal import MultimodalInputs


def test_a_prompt_without_messages_or_ids_is_refused_naming_it():
    with pytest.raises(ConfigError, match=r"Prompt 'row 3 of t.parquet': give `messages`"):
        Prompt([], "gsm8k", "1", origin="row 3 of t.parquet")
    assert Prompt([], prompt_ids=[1, 2]).prompt_ids == [1, 2]  # ids alone are a prompt


def test_images_without_prompt_ids_are_refused():
    images = MultimodalInputs(torch.zeros(4, 8), torch.tensor([[1, 2, 2]]))
    with pytest.raises(ConfigError, match=r"Prompt 'p0': `multimodal` .* needs `prompt_ids`"):
        Prompt([{"role": "user", "content": "?"}], sample_id="p0", multimodal=images)


def test_prompts_equal_by_content_and_named_apart():
    a = Prompt([{"role": "user", "content": "1+1?"}], "gsm8k", "2")
    b = Prompt([{"role": "user", "content": "1+1?"}], "gsm8k", "2")
    assert a.sample_id != b.sample_id and len(a.sample_id) == 32  # a fresh id each
    assert a == b  # the same row loaded twice
    assert a != Prompt([{"role": "user", "content": "1+1?"}], "gsm8k", "3")


def test_one_score_type_from_the_scorer_to_the_sample():
    assert rewards.RewardResult is RewardResult
    assert Sample().reward == RewardResult(0.0)  # unscored: 0, no error, no extras
    assert Sample().reward is not Sample().reward
