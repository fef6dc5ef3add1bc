"""VAPO's value pieces in `gae`: decoupled actor / critic lambda and the length-adaptive
lambda, against GAE worked out by hand."""

from __future__ import annotations

import pytest
import torch

from tephra.algos import AdvantageConfig, ConfigError, compute_advantages

TOL = dict(atol=1e-6, rtol=1e-6)


def _run(cfg: AdvantageConfig, rewards, values, mask):
    return compute_advantages(
        "gae",
        token_rewards=torch.tensor(rewards, dtype=torch.float64),
        response_mask=torch.tensor(mask),
        group_ids=torch.arange(len(mask)),
        values=torch.tensor(values, dtype=torch.float64),
        config=cfg,
    )


# One sample: a prompt token (mask 0), then 3 response tokens, reward 1 at the last,
# values 0.5 everywhere, gamma 1. deltas over response tokens: 0, 0, 0.5.
#   lambda 0.5: A = 0.125, 0.25, 0.5     lambda 1: A = 0.5, 0.5, 0.5 (returns 1, 1, 1)
#   lambda 2/3 (alpha 1, length 3): A = 2/9, 1/3, 0.5
REWARDS = [[9.0, 0.0, 0.0, 1.0]]  # the 9 sits on the prompt token: it must be ignored
VALUES = [[7.0, 0.5, 0.5, 0.5]]
MASK = [[0, 1, 1, 1]]


def test_decoupled_lambda_actor_and_critic_by_hand():
    cfg = AdvantageConfig(lam_actor=0.5, lam_critic=1.0, whiten_gae=False)
    adv, ret = _run(cfg, REWARDS, VALUES, MASK)
    torch.testing.assert_close(adv, torch.tensor([[0.0, 0.125, 0.25, 0.5]], dtype=torch.float64))
    torch.testing.assert_close(ret, torch.tensor([[0.0, 1.0, 1.0, 1.0]], dtype=torch.float64))


def test_lam_alone_still_drives_both():
    adv, ret = _run(AdvantageConfig(lam=0.5, whiten_gae=False), REWARDS, VALUES, MASK)
    torch.testing.assert_close(adv, torch.tensor([[0.0, 0.125, 0.25, 0.5]], dtype=torch.float64))
    # returns = A(0.5) + V
    torch.testing.assert_close(ret, torch.tensor([[0.0, 0.625, 0.75, 1.0]], dtype=torch.float64))


def test_length_adaptive_lambda_by_hand():
    # sample 0: length 3 -> lambda = 1 - 1 / (1 * 3) = 2/3
    # sample 1: length 2 (reward 1 at its last, values 0.5) -> lambda = 1 - 1/2 = 1/2;
    #   deltas 0, 0.5 -> A = 0.25, 0.5
    cfg = AdvantageConfig(lam_length_alpha=1.0, lam_critic=1.0, whiten_gae=False)
    adv, ret = _run(
        cfg,
        [REWARDS[0], [0.0, 0.0, 1.0, 0.0]],
        [VALUES[0], [0.0, 0.5, 0.5, 0.0]],
        [MASK[0], [0, 1, 1, 0]],
    )
    want = torch.tensor([[0.0, 2 / 9, 1 / 3, 0.5], [0.0, 0.25, 0.5, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(adv, want, **TOL)
    torch.testing.assert_close(
        ret, torch.tensor([[0.0, 1.0, 1.0, 1.0], [0.0, 1.0, 1.0, 0.0]], dtype=torch.float64)
    )


def test_length_adaptive_lambda_clamped_at_zero():
    # alpha 0.05, length 3: 1 - 1 / 0.15 < 0 -> lambda 0: A_t = delta_t
    cfg = AdvantageConfig(lam_length_alpha=0.05, whiten_gae=False)
    adv, _ = _run(cfg, REWARDS, VALUES, MASK)
    torch.testing.assert_close(adv, torch.tensor([[0.0, 0.0, 0.0, 0.5]], dtype=torch.float64))


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("lam_actor", 1.5, r"advantage\.lam_actor=1\.5 must be in \[0\.0, 1\.0\]"),
        ("lam_critic", -0.1, r"advantage\.lam_critic=-0\.1 must be in"),
        ("lam_length_alpha", 0.0, r"advantage\.lam_length_alpha=0\.0 must be > 0"),
    ],
)
def test_bad_lambda_options_are_refused(field, value, match):
    with pytest.raises(ConfigError, match=match):
        AdvantageConfig(**{field: value})
