"""Rollout correction (none / tis / bypass) against naive float64 loops."""

from __future__ import annotations

import math

import pytest
import torch

from tephra.algos import (
    REJECTION_OPTIONS,
    ROLLOUT_CORRECTIONS,
    ActorObjective,
    ActorObjectiveConfig,
    ConfigError,
    InputError,
    RegistryError,
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
    out = apply_rollout_correction(RolloutCorrectionConfig("tis", level, cap), rollout, mask, train)
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
        sum(weights) / len(weights), rel=1e-12
    )


def test_mismatch_metrics_match_a_naive_loop():
    train, rollout, mask = case(2, spread=0.3)
    for mode in ROLLOUT_CORRECTIONS.names():
        m = apply_rollout_correction(RolloutCorrectionConfig(mode), rollout, mask, train).metrics
        gaps = [
            float(train[b, t] - rollout[b, t])
            for b in range(B)
            for t in response_positions(mask[b])
        ]
        assert m["rollout_corr/log_prob_gap_mean"] == pytest.approx(sum(gaps) / len(gaps))
        assert m["rollout_corr/log_prob_abs_gap_mean"] == pytest.approx(
            sum(abs(g) for g in gaps) / len(gaps)
        )
        assert m["rollout_corr/kl_k3"] == pytest.approx(
            sum(math.exp(g) - 1 - g for g in gaps) / len(gaps)
        )
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
    assert ROLLOUT_CORRECTIONS.meta("tis") == {
        "needs_train_log_probs": True,
        "replaces_old_log_probs": False,
    }
    assert ROLLOUT_CORRECTIONS.meta("bypass") == {
        "needs_train_log_probs": False,
        "replaces_old_log_probs": True,
    }
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
    new = train + 0.1 * torch.randn(B, T, generator=gen, dtype=torch.float64)
    corr = apply_rollout_correction(
        RolloutCorrectionConfig("tis", "token", 1.5), rollout, mask, train
    )
    tokens, seqs = global_normalisers([mask])
    batch = {
        "old_log_probs": corr.old_log_probs,
        "advantages": adv,
        "response_mask": mask,
        "rollout_is_weights": corr.weights,
        "global_token_count": torch.full((B,), tokens),
        "global_seq_count": torch.full((B,), seqs),
    }
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


# ----- rejection sampling (verl's rollout_rs) ------------------------------------------------


def naive_keep(train, rollout, mask, name, lower, upper):
    """verl's compute_rollout_rejection_mask (verl/trainer/ppo/rollout_corr_helper.py), one
    option, one row and token at a time in Python floats: g = old - rollout clamped to +-20,
    k1 = -g within [log lower, log upper], k2 = g^2/2 and k3 = e^g - 1 - g under upper; seq_*
    reduce over the row's response tokens (sum, mean, max) and keep or drop the whole row."""
    b, s = mask.shape
    keep = [[0] * s for _ in range(b)]
    for i in range(b):
        toks = [t for t in range(s) if mask[i, t] > 0]
        stats = {}
        for t in toks:
            g = max(-20.0, min(20.0, float(train[i, t] - rollout[i, t])))
            stats[t] = {"k1": -g, "k2": 0.5 * g * g, "k3": math.exp(g) - 1 - g}[name[-2:]]
        if name.startswith("token"):
            decided = {t: stats[t] for t in toks}
        else:
            vals = list(stats.values())
            how = name.split("_")[1]
            agg = (
                (
                    sum(vals)
                    if how == "sum"
                    else sum(vals) / len(vals)
                    if how == "mean"
                    else max(vals)
                )
                if vals
                else 0.0
            )
            decided = {t: agg for t in toks}
        for t, v in decided.items():
            ok = v <= (math.log(upper) if name.endswith("k1") else upper)
            if name.endswith("k1"):
                ok = ok and v >= math.log(lower)
            keep[i][t] = int(ok)
    return torch.tensor(keep)


@pytest.mark.parametrize("name", REJECTION_OPTIONS.names())
def test_rejection_drops_exactly_the_rows_and_tokens_over_the_bound(name):
    """A batch with planted large gaps (a few tokens off by +-3 nats): exactly the tokens, or
    rows, that verl's definition rejects are dropped, and the metrics count them."""
    gen = torch.Generator().manual_seed(11)
    mask = random_mask(gen, 8, 10)
    rollout = -torch.rand(8, 10, generator=gen, dtype=torch.float64) * 2
    train = rollout + 0.01 * torch.randn(8, 10, generator=gen, dtype=torch.float64)
    train[1, response_positions(mask[1])[-1]] += 3.0  # planted: far above
    train[4, response_positions(mask[4])[0]] -= 3.0  # and far below
    threshold = "0.5_2.0" if name.endswith("k1") else 0.05
    lower, upper = (0.5, 2.0) if name.endswith("k1") else (None, 0.05)
    cfg = RolloutCorrectionConfig(mode="tis", rejection=(name,), rejection_threshold=threshold)
    out = apply_rollout_correction(cfg, rollout, mask, train)
    expected = naive_keep(train, rollout, mask, name, lower, upper)
    assert torch.equal(out.keep, expected)
    dropped = (mask > 0) & (expected == 0)
    assert 0 < int(dropped.sum()) < int((mask > 0).sum())  # the plants, not everything
    assert out.metrics["rollout_corr/rs_masked_frac"] == pytest.approx(
        float(dropped.sum()) / float((mask > 0).sum())
    )
    assert (
        out.metrics[f"rollout_corr/rs_{name}_masked_frac"]
        == out.metrics["rollout_corr/rs_masked_frac"]
    )
    rows = (mask > 0).any(-1)
    assert out.metrics["rollout_corr/rs_seq_masked_frac"] == pytest.approx(
        float((dropped.any(-1) & rows).sum()) / float(rows.sum())
    )
    assert (out.weights[expected == 0] == 0).all()  # TIS weights of dropped tokens are 0


def test_rejection_options_combine_and_bad_thresholds_name_the_field():
    gen = torch.Generator().manual_seed(2)
    mask = random_mask(gen, 6, 8)
    rollout = -torch.rand(6, 8, generator=gen, dtype=torch.float64)
    train = rollout + 0.5 * torch.randn(6, 8, generator=gen, dtype=torch.float64)
    both = RolloutCorrectionConfig(
        rejection=("token_k1", "seq_max_k3"), rejection_threshold="0.7_1.5,0.3"
    )
    keep = apply_rollout_correction(both, rollout, mask, train).keep
    assert torch.equal(
        keep,
        naive_keep(train, rollout, mask, "token_k1", 0.7, 1.5)
        * naive_keep(train, rollout, mask, "seq_max_k3", None, 0.3),
    )
    # a single k1 number u is the pair 1/u_u
    one = RolloutCorrectionConfig(rejection=("token_k1",), rejection_threshold=2.0)
    assert one.bounds["token_k1"] == pytest.approx((math.log(0.5), math.log(2.0)))
    for kwargs, message in [
        ({"rejection": ("token_k4",)}, r"algorithm.rollout_rejection='token_k4'.*did you mean"),
        ({"rejection": ("token_k1",)}, r"rollout_rejection_threshold is missing"),
        ({"rejection": ("token_k2",), "rejection_threshold": "0.1_0.2"}, r"upper bound only"),
        (
            {"rejection": ("token_k1", "seq_sum_k2"), "rejection_threshold": "1,2,3"},
            r"one bound for all options or one per option \(2\)",
        ),
        ({"rejection": ("token_k3",), "rejection_threshold": "-1"}, r"positive"),
        (
            {"mode": "bypass", "rejection": ("token_k3",), "rejection_threshold": 1.0},
            r"needs the trainer's log-probs, which rollout_correction='bypass' skips",
        ),
    ]:
        with pytest.raises((ConfigError, RegistryError), match=message):
            RolloutCorrectionConfig(**kwargs)
