"""PRIME's step (`tephra.algos.prime`, the maths of the controller's PRIME recipe): implicit
rewards, labels and the whitened RLOO advantage of a hand-made batch; the refused options."""

from __future__ import annotations

import math

import pytest
import torch

from tephra.algos import prime_step
from tephra.algos.errors import ConfigError
from tephra.algos.recipe_config import PrimeConfig


def test_prime_step_by_hand():
    prm = torch.tensor([[-1.0, -1.0], [-2.0, -1.0]])
    ref = torch.tensor([[-2.0, -1.0], [-1.0, -1.0]])
    mask = torch.tensor([[1, 1], [1, 1]])
    section = PrimeConfig(enabled=True, beta=0.5, process_coef=1.0, outcome_coef=1.0)
    adv, labels, metrics = prime_step(
        prm, ref, mask, torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), section
    )
    # implicit rewards [[0.5, 0], [-0.5, 0]]; before whitening A = [[2, 1.25], [-2, -1.25]]
    # (see tephra.algos' test); whitened: mean 0, unbiased std over the 4 tokens
    raw = [2.0, 1.25, -2.0, -1.25]
    std = math.sqrt(sum(x * x for x in raw) / 3 + 1e-8)
    torch.testing.assert_close(adv, torch.tensor([[2.0, 1.25], [-2.0, -1.25]]) / std)
    assert labels.tolist() == [1.0, 0.0]
    assert metrics["prime/implicit_reward_seq_mean"] == 0.0
    assert metrics["prime/rm_acc_before"] == 1.0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"beta": 0.0}, r"algorithm\.prime\.beta=0\.0 must be > 0"),
        ({"process_coef": -1.0}, r"algorithm\.prime\.process_coef=-1\.0 must be"),
        (
            {"enabled": True, "process_coef": 0.0, "outcome_coef": 0.0},
            r"process_coef and outcome_coef are both 0",
        ),
    ],
)
def test_bad_prime_sections(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        PrimeConfig(**kwargs)
