"""Rollout correction (none / tis / bypass) against naive float64 loops."""

from __future__ import annotations

import math

import pytest
import torch

from tephra.algos import (
    ROLLOUT_CORRECTIONS,
    ActorObjective,
    ActorObjectiveConfig,
    ConfigError,
    InputError,
    RolloutCorrectionConfig,
    apply_rollout_correction,
    global_normalisers,
)
from tephra.algos.testing import random_mask, response_positions

B, T = 6, 9


def case(seed: int, spread: float = 0.8):
    gen = torch.Generator().manual_seed(seed)
    mask = random_mask(gen, B, T)
    train = -torch.rand(B, T, generator=gen, dtype=torch.float64) * 3
    rollout = train + spread * torch.randn(B, T, generator=gen, dtype=torch.float64)
    # garbage where the mask is 0: a result that reads padding shows up
    rollout = torch.where(mask > 0, rollout, torch.full_like(rollout, 50.0))
    return train, rollout, mask


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("cap", [1.0, 1.5, 4.0])
def test_tis_weights_match_a_naive_loop_and_clip_at_the_cap(level, cap):
    train, rollout, mask = case(1, spread=1.5)
    out = apply_rollout_correction(RolloutCorrectionConfig("tis", level, cap), rollout, mask,
                                   train)
    assert out.old_log_probs is train
    capped = units = 0
    weights = []
    for b in range(B):
        pos = response_positions(mask[b])
        seq = sum(float(train[b, t]) - float(rollout[b, t]) for t in pos)
        if level == "sequence" and pos:
            capped += math.exp(seq) > cap
            units += 1
        for t in range(T):
            if t not in pos:
                assert float(out.weights[b, t]) == 0.0
                continue
            raw = math.exp(seq if level == "sequence" else float(train[b, t] - rollout[b, t]))
            want = min(raw, cap)
            assert float(out.weights[b, t]) == pytest.approx(want, rel=1e-12)
            weights.append(want)
            if level == "token":
                capped += raw > cap
                units += 1
    assert capped > 0  # the case exercises the cap
    assert float(out.weights.max()) <= cap  # never above it, exactly
    assert (out.weights[mask > 0] == cap).sum() > 0
    assert out.metrics["rollout_corr/tis_capped_frac"] == pytest.approx(capped / units)
    assert out.metrics["rollout_corr/tis_weight_mean"] == pytest.approx(
        sum(weights) / len(weights), rel=1e-12)


def test_mismatch_metrics_match_a_naive_loop():
    train, rollout, mask = case(2, spread=0.3)
    for mode in ROLLOUT_CORRECTIONS.names():
        m = apply_rollout_correction(RolloutCorrectionConfig(mode), rollout, mask, train).metrics
        gaps = [float(train[b, t] - rollout[b, t]) for b in range(B)
                for t in response_positions(mask[b])]
        assert m["rollout_corr/log_prob_gap_mean"] == pytest.approx(sum(gaps) / len(gaps))
        assert m["rollout_corr/log_prob_abs_gap_mean"] == pytest.approx(
            sum(abs(g) for g in gaps) / len(gaps))
        assert m["rollout_corr/kl_k3"] == pytest.approx(
            sum(math.exp(g) - 1 - g for g in gaps) / len(gaps))
        assert m["rollout_corr/ratio_max"] == pytest.approx(max(math.exp(g) for g in gaps))
        assert m["rollout_corr/kl_k3"] >= 0
    # equal policies: no gap, ratio 1, KL 0, every weight 1
    m = apply_rollout_correction(RolloutCorrectionConfig("tis"), train, mask, train)
    assert m.metrics["rollout_corr/kl_k3"] == 0.0 and m.metrics["rollout_corr/ratio_max"] == 1.0
    assert torch.equal(m.weights, (mask > 0).to(train.dtype))


def test_bypass_uses_the_rollout_log_probs_and_none_the_trainers():
    train, rollout, mask = case(3)
    by = apply_rollout_correction(RolloutCorrectionConfig("bypass"), rollout, mask)
    assert by.old_log_probs is rollout and by.weights is None and by.metrics == {}
    none = apply_rollout_correction(RolloutCorrectionConfig("none"), rollout, mask, train)
    assert none.old_log_probs is train and none.weights is None
    assert ROLLOUT_CORRECTIONS.meta("tis") == {"needs_train_log_probs": True,
                                               "replaces_old_log_probs": False}
    assert ROLLOUT_CORRECTIONS.meta("bypass") == {"needs_train_log_probs": False,
                                                  "replaces_old_log_probs": True}
    with pytest.raises(InputError, match="'tis' needs train_log_probs"):
        apply_rollout_correction(RolloutCorrectionConfig("tis"), rollout, mask)


def test_config_errors_name_the_field():
    with pytest.raises(ConfigError, match=r"rollout_correction.mode='tiss'.*did you mean 'tis'"):
        RolloutCorrectionConfig("tiss")
    with pytest.raises(ConfigError, match=r"rollout_correction.level='seq'"):
        RolloutCorrectionConfig("tis", level="seq")
    with pytest.raises(ConfigError, match=r"rollout_correction.cap=0.5 must be"):
        RolloutCorrectionConfig("tis", cap=0.5)


def test_actor_objective_multiplies_the_policy_loss_by_the_weights():
    train, rollout, mask = case(4)
    gen = torch.Generator().manual_seed(5)
    adv = torch.randn(B, T, generator=gen, dtype=torch.float64)
    new = (train + 0.1 * torch.randn(B, T, generator=gen, dtype=torch.float64))
    corr = apply_rollout_correction(RolloutCorrectionConfig("tis", "token", 1.5), rollout,
                                    mask, train)
    tokens, seqs = global_normalisers([mask])
    batch = {"old_log_probs": corr.old_log_probs, "advantages": adv, "response_mask": mask,
             "rollout_is_weights": corr.weights,
             "global_token_count": torch.full((B,), tokens),
             "global_seq_count": torch.full((B,), seqs)}
    cfg = ActorObjectiveConfig(loss_agg_mode="token-mean", policy=dict(clip_ratio_c=None))
    loss, _ = ActorObjective(cfg)({"log_probs": new}, batch)
    want = 0.0
    for b in range(B):
        for t in response_positions(mask[b]):
            r = math.exp(float(new[b, t] - train[b, t]))
            a = float(adv[b, t])
            pg = max(-a * r, -a * min(max(r, 0.8), 1.2))
            want += float(corr.weights[b, t]) * pg / float(tokens)
    assert float(loss) == pytest.approx(want, rel=1e-10)
