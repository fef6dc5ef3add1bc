"""Policy losses vs naive per-token loops (values, gradients, metrics) and hand cases."""

from __future__ import annotations

import math

import pytest
import torch

from tephra.algos import (
    POLICY_LOSSES,
    PolicyLossConfig,
    RegistryError,
    compute_policy_loss,
    global_normalisers,
)
from tephra.algos.testing import random_mask, response_positions

TOL = dict(atol=1e-6, rtol=1e-6)
CONFIG = PolicyLossConfig(
    clip_ratio_low=0.2,
    clip_ratio_high=0.28,
    clip_ratio_c=3.0,
    clip_cov_ratio=1.0,
    clip_cov_lb=-0.05,
    clip_cov_ub=0.05,
    kl_cov_ratio=0.1,
    kl_cov_coef=0.7,
)


def sigmoid(x):
    return 1.0 / (1.0 + math.exp(-x))


def naive_token(name, lp, old, a, cfg, seq_ratio=None, cov=None, selected=False):
    """(loss value, d loss / d log_prob) of one token, from the papers' formulas."""
    lo, hi = 1 - cfg.clip_ratio_low, 1 + cfg.clip_ratio_high
    r = math.exp(lp - old)
    if name == "gspo":
        r = seq_ratio
    if name in ("vanilla", "gspo", "clip_cov"):
        unclipped, clipped = -a * r, -a * min(max(r, lo), hi)
        loss = max(unclipped, clipped)
        grad = -a * r if clipped <= unclipped else 0.0
        if name == "vanilla" and a < 0 and loss > -a * cfg.clip_ratio_c:
            loss, grad = -a * cfg.clip_ratio_c, 0.0
        if name == "clip_cov" and selected:
            loss, grad = 0.0, 0.0
        return loss, grad
    if name == "cispo":
        w = min(max(r, lo), hi)
        return -w * a * lp, -w * a
    if name == "sapo":
        tau = cfg.sapo_tau_pos if a > 0 else cfg.sapo_tau_neg
        s = sigmoid(tau * (r - 1))
        return -a * 4 / tau * s, -a * 4 * s * (1 - s) * r
    if name == "kl_cov":
        loss, grad = -a * r, -a * r
        if selected:
            loss += cfg.kl_cov_coef * abs(lp - old)
            grad += cfg.kl_cov_coef * math.copysign(1.0, lp - old)
        return loss, grad
    if name == "gpg":
        return -a * lp, -a
    if name == "dro":
        return -(a * lp - 0.5 * cfg.dro_beta * (lp - old) ** 2), -a + cfg.dro_beta * (lp - old)
    if name in ("dppo_tv", "dppo_kl"):
        p, q = math.exp(lp), math.exp(old)
        if name == "dppo_tv":
            valid = (p - q <= hi - 1) if a > 0 else (p - q >= -(1 - lo))
        else:
            inner = (1 - q + 1e-8) / (1 - p + 1e-8)
            # log of a negative number (p > 1 from an off-policy lp > 0) is NaN in torch
            div = q * (old - lp) + (1 - q) * (math.log(inner) if inner > 0 else math.nan)
            valid = (
                (div <= cfg.clip_ratio_high or p <= q)
                if a > 0
                else (div <= cfg.clip_ratio_low or p >= q)
            )
        # verl's dppo losses truncate at clip_ratio_c (dppo_ratio_cap None, the default)
        cap = cfg.dppo_ratio_cap if cfg.dppo_ratio_cap is not None else cfg.clip_ratio_c
        w = min(r, cap)
        return (-a * w * lp, -a * w) if valid else (0.0, 0.0)
    raise AssertionError(name)


def naive_selection(name, lp, old, adv, mask, cfg):
    """Tokens removed by clip_cov (all candidates: ratio 1.0) / penalised by kl_cov."""
    pos = [(b, t) for b in range(mask.shape[0]) for t in response_positions(mask[b])]
    ma = sum(float(adv[p]) for p in pos) / len(pos)
    ml = sum(float(lp[p]) for p in pos) / len(pos)
    cov = {p: (float(adv[p]) - ma) * (float(lp[p]) - ml) for p in pos}
    if name == "clip_cov":
        out = set()
        for p in pos:
            r = math.exp(float(lp[p] - old[p]))
            a = float(adv[p])
            clipped = -a * min(max(r, 1 - cfg.clip_ratio_low), 1 + cfg.clip_ratio_high) > -a * r
            if not clipped and cfg.clip_cov_lb < cov[p] < cfg.clip_cov_ub:
                out.add(p)
        return out
    if name == "kl_cov":
        k = max(1, int(len(pos) * cfg.kl_cov_ratio))
        return set(sorted(pos, key=lambda p: -cov[p])[:k])
    return set()


def make_case(seed, batch=6, seq=9):
    gen = torch.Generator().manual_seed(seed)
    mask = random_mask(gen, batch, seq)
    old = -torch.rand(batch, seq, generator=gen, dtype=torch.float64) * 3
    lp = old + torch.randn(batch, seq, generator=gen, dtype=torch.float64) * 0.4
    adv = torch.randn(batch, seq, generator=gen, dtype=torch.float64)
    lp[:, 1::4] += 1.3  # far off-policy tokens (ratio > c) ...
    adv[:, 1::3] = -adv[:, 1::3].abs()  # ... some with negative advantages: the dual clip
    return lp, old, adv, mask


# the sequence-level losses (geo_mean, sppo) have their own hand-computed tests
@pytest.mark.parametrize(
    "name", [n for n in POLICY_LOSSES.names() if n not in ("geo_mean", "sppo")]
)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_naive_loop(name, seed):
    lp, old, adv, mask = make_case(seed)
    lp = lp.requires_grad_(True)
    tokens, seqs = global_normalisers([mask])
    loss, metrics = compute_policy_loss(
        name,
        lp,
        old,
        adv,
        mask,
        config=CONFIG,
        loss_agg_mode="token-mean",
        global_token_count=tokens,
        global_seq_count=seqs,
    )
    loss.backward()
    got_grad, lp, loss = lp.grad, lp.detach(), loss.detach()
    name = "vanilla" if name == "bypass_mode" else name  # verl's name for it on rollout log-probs
    selected = naive_selection(name, lp, old, adv, mask, CONFIG)
    want_loss, want_grad = 0.0, torch.zeros_like(lp)
    clipped = 0
    for b in range(mask.shape[0]):
        pos = response_positions(mask[b])
        seq_ratio = math.exp(sum(float(lp[b, t] - old[b, t]) for t in pos) / len(pos))
        for t in pos:
            value, grad = naive_token(
                name,
                float(lp[b, t]),
                float(old[b, t]),
                float(adv[b, t]),
                CONFIG,
                seq_ratio=seq_ratio,
                selected=(b, t) in selected,
            )
            want_loss += value / tokens
            want_grad[b, t] = grad / tokens
            r = seq_ratio if name == "gspo" else math.exp(float(lp[b, t] - old[b, t]))
            clipped += not (1 - CONFIG.clip_ratio_low <= r <= 1 + CONFIG.clip_ratio_high) and (
                -float(adv[b, t]) * min(max(r, 0.8), 1.28) > -float(adv[b, t]) * r
            )
    assert float(loss) == pytest.approx(want_loss, abs=1e-6, rel=1e-6)
    torch.testing.assert_close(got_grad, want_grad, **TOL)
    if name in ("vanilla", "gspo", "clip_cov"):
        assert metrics["pg_clipfrac"] == pytest.approx(clipped / tokens)
    ratio = [
        math.exp(float(lp[b, t] - old[b, t]))
        for b in range(mask.shape[0])
        for t in response_positions(mask[b])
    ]
    if name != "gspo":
        assert metrics["ratio_max"] == pytest.approx(max(ratio))
        assert metrics["ratio_mean"] == pytest.approx(sum(ratio) / len(ratio))
    kl = [
        float(old[b, t] - lp[b, t])
        for b in range(mask.shape[0])
        for t in response_positions(mask[b])
    ]
    assert metrics["ppo_kl"] == pytest.approx(sum(kl) / len(kl))


def test_naive_exercises_every_branch():
    """The random cases above reach the clip, the dual clip and the covariance selections."""
    lp, old, adv, mask = make_case(0)
    tokens, seqs = global_normalisers([mask])
    kw = dict(config=CONFIG, global_token_count=tokens, global_seq_count=seqs)
    _, m = compute_policy_loss("vanilla", lp, old, adv, mask, **kw)
    assert m["pg_clipfrac"] > 0 and m["pg_clipfrac_lower"] > 0
    _, m = compute_policy_loss("clip_cov", lp, old, adv, mask, **kw)
    assert m["cov_clipfrac"] > 0
    _, m = compute_policy_loss("kl_cov", lp, old, adv, mask, **kw)
    assert m["kl_cov_frac"] > 0


def test_clip_cov_random_choice_is_among_candidates_and_sized():
    lp, old, adv, mask = make_case(3, batch=16, seq=12)
    cfg = PolicyLossConfig(
        clip_cov_ratio=0.02, clip_cov_lb=-0.05, clip_cov_ub=0.05, clip_cov_seed=5
    )
    n_valid = int((mask > 0).sum())
    per_tok, _ = POLICY_LOSSES.get("clip_cov")(lp, old, adv, mask, cfg)
    full, _ = POLICY_LOSSES.get("clip_cov")(
        lp, old, adv, mask, PolicyLossConfig(**{**cfg.__dict__, "clip_cov_ratio": 1.0})
    )
    removed = (per_tok == 0) & (mask > 0) & (adv != 0)
    candidates = (full == 0) & (mask > 0) & (adv != 0)
    assert int(removed.sum()) == max(int(0.02 * n_valid), 1)
    assert bool((removed <= candidates).all())
    again, _ = POLICY_LOSSES.get("clip_cov")(lp, old, adv, mask, cfg)
    torch.testing.assert_close(again, per_tok)  # seeded: reproducible


def _one(name, lp, old, a, cfg=None):
    t = lambda x: torch.tensor([[x]], dtype=torch.float64)  # noqa: E731
    loss, _ = compute_policy_loss(
        name,
        t(lp),
        t(old),
        t(a),
        torch.ones(1, 1),
        config=cfg or PolicyLossConfig(),
        global_token_count=1.0,
        global_seq_count=1.0,
    )
    return float(loss)


def test_hand_cases():
    ln = math.log
    assert _one("vanilla", ln(1.5), 0.0, 1.0) == pytest.approx(-1.2)  # clipped at 1 + .2
    assert _one("vanilla", ln(1.1), 0.0, 1.0) == pytest.approx(-1.1)  # inside the range
    assert _one("vanilla", ln(5.0), 0.0, -1.0) == pytest.approx(3.0)  # dual clip c = 3
    assert _one(
        "vanilla", ln(5.0), 0.0, -1.0, PolicyLossConfig(clip_ratio_c=None)
    ) == pytest.approx(5.0)
    assert _one(
        "vanilla", ln(1.25), 0.0, 1.0, PolicyLossConfig(clip_ratio_high=0.28)
    ) == pytest.approx(-1.25)  # clip-higher
    assert _one("cispo", -1.0, -1.0 - ln(2.0), 1.0) == pytest.approx(1.2)  # -1.2 * 1 * -1
    assert _one("sapo", -0.5, -0.5, 2.0) == pytest.approx(-4.0)  # -A * 4/1 * 1/2
    assert _one("gpg", -2.0, -9.0, 0.5) == pytest.approx(1.0)
    # GSPO: token log-ratios ln 2 and 0 -> s = sqrt 2, clipped to 1.2 for A = 1
    lp = torch.tensor([[math.log(2.0), 0.0]], dtype=torch.float64)
    loss, m = compute_policy_loss(
        "gspo",
        lp,
        torch.zeros_like(lp),
        torch.ones_like(lp),
        torch.ones(1, 2),
        global_token_count=2.0,
        global_seq_count=1.0,
    )
    assert float(loss) == pytest.approx(-1.2) and m["pg_clipfrac"] == 1.0


def test_masked_positions_never_matter():
    lp, old, adv, mask = make_case(4)
    tokens, seqs = global_normalisers([mask])
    off = mask == 0
    lp2, old2, adv2 = lp.clone(), old.clone(), adv.clone()
    lp2[off], old2[off], adv2[off] = -1e4, 50.0, float("nan")
    for name in POLICY_LOSSES.names():
        kw = dict(config=CONFIG, global_token_count=tokens, global_seq_count=seqs)
        a, _ = compute_policy_loss(name, lp, old, adv, mask, **kw)
        b, _ = compute_policy_loss(name, lp2, old2, adv2, mask, **kw)
        torch.testing.assert_close(a, b, **TOL)


def test_unknown_loss_lists_registered():
    with pytest.raises(RegistryError, match="did you mean 'vanilla'.*cispo, clip_cov"):
        compute_policy_loss("vanila", *make_case(0), global_token_count=1.0, global_seq_count=1.0)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum"])
def test_geo_mean_matches_naive_loop(seed, mode):
    """GMPO per sequence, by hand: l_t = sign(A) min(sign(A) d_t, sign(A) clip(d_t, -lo, hi)),
    L = -mean(A) exp(mean l), averaged over sequences whatever loss_agg_mode says; the
    gradient reaches d_t only where it was not clipped: -mean(A) exp(mean l) / n."""
    lp, old, adv, mask = make_case(seed)
    lp = lp.double().requires_grad_(True)
    tokens, seqs = global_normalisers([mask])
    loss, metrics = compute_policy_loss(
        "geo_mean",
        lp,
        old,
        adv,
        mask,
        config=CONFIG,
        loss_agg_mode=mode,
        global_token_count=tokens,
        global_seq_count=seqs,
    )
    loss.backward()
    lo, hi = CONFIG.clip_ratio_low, CONFIG.clip_ratio_high
    want_loss, want_grad = 0.0, torch.zeros_like(lp)
    rows = [b for b in range(mask.shape[0]) if response_positions(mask[b])]
    for b in rows:
        pos = response_positions(mask[b])
        d = [float(lp[b, t] - old[b, t]) for t in pos]
        a = [float(adv[b, t]) for t in pos]
        chosen, free = [], []
        for di, ai in zip(d, a):
            sg = math.copysign(1.0, ai) if ai != 0 else 0.0
            c = min(max(di, -lo), hi)
            pick = sg * min(sg * di, sg * c)
            chosen.append(pick)
            free.append(pick == di)
        ratio = math.exp(sum(chosen) / len(pos))
        mean_a = sum(a) / len(pos)
        want_loss += -mean_a * ratio / len(rows)
        for t, f in zip(pos, free):
            want_grad[b, t] = (-mean_a * ratio / len(pos) / len(rows)) if f else 0.0
    assert float(loss) == pytest.approx(want_loss, abs=1e-9)
    torch.testing.assert_close(lp.grad, want_grad, **TOL)
    assert 0.0 <= metrics["pg_clipfrac"] <= 1.0


def test_sapo_temperatures_follow_the_ratio_dtype():
    lp = torch.tensor([[-1.0, -2.0]], dtype=torch.float64)
    old = torch.tensor([[-1.1, -1.9]], dtype=torch.float64)
    adv = torch.tensor([[1.0, -1.0]], dtype=torch.float64)
    mask = torch.ones(1, 2)
    cfg = PolicyLossConfig(sapo_tau_pos=1.0, sapo_tau_neg=1.05)
    loss, _ = compute_policy_loss(
        "sapo", lp, old, adv, mask, config=cfg, global_token_count=2.0, global_seq_count=1.0
    )
    want = 0.0
    for d, a in ((0.1, 1.0), (-0.1, -1.0)):
        tau = 1.0 if a > 0 else 1.05
        want += -a * 4 / tau * sigmoid(tau * (math.exp(d) - 1)) / 2
    assert float(loss) == pytest.approx(want, abs=1e-15, rel=1e-14)  # float64 throughout
