"""The one per-sample type and its padder: a plain and a multi-turn sample padded by hand."""

from __future__ import annotations

import pytest
import torch

from tephra.engine_api.errors import ConfigError
from tephra.rollout import Sample, to_batch


def test_plain_and_tool_samples_padded_by_hand():
    plain = Sample([11, 12], [13, 14], log_probs=[-0.1, -0.2], finish_reason="length")
    tool = Sample(
        [21],
        [22, 23, 24],
        response_mask=[1, 0, 1],
        log_probs=[-0.3, 0.0, -0.4],
        num_turns=2,
        tool_calls=1,
        tool_rewards={"python": 0.5, "search": 0.25},
        prompt_index=1,
    )
    assert plain.response_mask == [1, 1]  # None means every token is the model's
    batch = to_batch([plain, tool], pad_token_id=0, agent_stats=True, uids=[7, 8])
    assert batch["input_ids"].tolist() == [[11, 12, 13, 14, 0], [0, 21, 22, 23, 24]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1, 0], [0, 1, 1, 1, 1]]
    assert batch["response_mask"].tolist() == [[0, 0, 1, 1, 0], [0, 0, 1, 0, 1]]
    torch.testing.assert_close(
        batch["rollout_log_probs"],
        torch.tensor([[0, 0, -0.1, -0.2, 0], [0, 0, -0.3, 0.0, -0.4]]),
    )
    assert batch["prompt_index"].tolist() == [0, 1]
    assert batch["num_turns"].tolist() == [1, 2] and batch["tool_calls"].tolist() == [0, 1]
    assert batch["tool_rewards"].tolist() == [0.0, 0.75]
    assert batch["uid"].tolist() == [7, 8]
    # the caller's group ids replace the samples' own; no log-probs on one sample: no column
    again = to_batch([plain, Sample([1], [2])], 0, prompt_index=[3, 3])
    assert again["prompt_index"].tolist() == [3, 3]
    assert "rollout_log_probs" not in again.keys() and "num_turns" not in again.keys()


def test_bad_samples_are_refused_naming_the_field():
    with pytest.raises(ConfigError, match=r"response_ids \(2\), response_mask \(1\)"):
        Sample([1], [2, 3], response_mask=[1])
    with pytest.raises(ConfigError, match="log_probs"):
        Sample([1], [2, 3], log_probs=[0.0])
    with pytest.raises(ConfigError, match="no samples"):
        to_batch([], 0)
    with pytest.raises(ConfigError, match="1 prompt_index for 2 samples"):
        to_batch([Sample([1], [2]), Sample([1], [2])], 0, prompt_index=[0])
