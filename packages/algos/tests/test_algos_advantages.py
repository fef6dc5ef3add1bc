"""Advantage estimators vs naive per-sample loops, hand-computed cases, and invariances."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tephra.algos import (
    ADVANTAGE_ESTIMATORS,
    AdvantageConfig,
    ConfigError,
    InputError,
    RegistryError,
    compute_advantages,
)
from tephra.algos.testing import (
    outcome_rewards,
    random_group_ids,
    random_mask,
    response_positions,
)

TOL = dict(atol=1e-6, rtol=1e-6)


# ----- naive references: python floats, one sample at a time ---------------------------


def naive_scores(rewards, mask):
    return [
        sum(float(rewards[b, t]) for t in response_positions(mask[b])) for b in range(mask.shape[0])
    ]


def naive_groups(group_ids):
    groups: dict[int, list[int]] = {}
    for i, g in enumerate(group_ids.tolist()):
        groups.setdefault(g, []).append(i)
    return groups


def mean(xs):
    return sum(xs) / len(xs)


def std_unbiased(xs):
    if len(xs) < 2:
        return 0.0
    m = mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def whiten(per_token: dict[tuple[int, int], float]) -> dict[tuple[int, int], float]:
    vals = list(per_token.values())
    m = mean(vals)
    var = sum((v - m) ** 2 for v in vals) / max(len(vals) - 1, 1)
    return {k: (v - m) / math.sqrt(var + 1e-8) for k, v in per_token.items()}


def to_dense(per_sample_or_token, mask, per_token=False):
    out = torch.zeros(mask.shape, dtype=torch.float64)
    for b in range(mask.shape[0]):
        for t in response_positions(mask[b]):
            out[b, t] = per_sample_or_token[(b, t)] if per_token else per_sample_or_token[b]
    return out


def naive_group_baseline(scores, group_ids, by_std, eps, cfg_scale=True):
    adv = [0.0] * len(scores)
    for members in naive_groups(group_ids).values():
        s = [scores[i] for i in members]
        if len(members) == 1:
            m, sd = 0.0, 1.0
        else:
            m, sd = mean(s), (std_unbiased(s) + eps if by_std else 1.0)
        for i in members:
            adv[i] = (scores[i] - m) / sd
    return adv


def naive_gae(rewards, values, mask, gamma, lam, whiten_adv):
    adv, ret = {}, {}
    for b in range(mask.shape[0]):
        pos = response_positions(mask[b])
        nxt_v, nxt_a = 0.0, 0.0
        for t in reversed(pos):
            delta = float(rewards[b, t]) + gamma * nxt_v - float(values[b, t])
            a = delta + gamma * lam * nxt_a
            adv[(b, t)], ret[(b, t)] = a, a + float(values[b, t])
            nxt_v, nxt_a = float(values[b, t]), a
    return (whiten(adv) if whiten_adv else adv), ret


def naive_discounted(rewards, mask, gamma):
    ret = {}
    for b in range(mask.shape[0]):
        g = 0.0
        for t in reversed(response_positions(mask[b])):
            g = float(rewards[b, t]) + gamma * g
            ret[(b, t)] = g
    return ret


def naive_passk(scores, group_ids, k, by_std, eps):
    adv = [0.0] * len(scores)
    for members in naive_groups(group_ids).values():
        subsets = list(itertools.combinations(members, k))
        maxes = [max(scores[j] for j in s) for s in subsets]
        r = mean(maxes)
        sigma = math.sqrt(mean([(x - r) ** 2 for x in maxes]))
        for i in members:
            cond = mean([mx for s, mx in zip(subsets, maxes) if i in s])
            adv[i] = (cond - r) / ((sigma + eps) if by_std else 1.0)
    return adv


def naive(name, rewards, mask, group_ids, values, baselines, cfg):
    """(advantages, returns) as dense tensors, computed by the loops above."""
    scores = naive_scores(rewards, mask)
    b = len(scores)
    if name == "gae":
        adv, ret = naive_gae(rewards, values, mask, cfg.gamma, cfg.lam, cfg.whiten_gae)
        return to_dense(adv, mask, True), to_dense(ret, mask, True)
    if name in ("grpo", "dr_grpo"):
        a = naive_group_baseline(
            scores, group_ids, name != "dr_grpo" and cfg.norm_by_std, cfg.epsilon
        )
        return to_dense(a, mask), to_dense(a, mask)
    if name == "grpo_vectorized":  # verl's groupwise.group_mean_std: variance floored at eps
        a = [0.0] * b
        for members in naive_groups(group_ids).values():
            s = [scores[i] for i in members]
            if len(s) == 1:
                m, sd = 0.0, 1.0
            else:
                m = mean(s)
                sd = (
                    math.sqrt(max(std_unbiased(s) ** 2, cfg.epsilon)) + cfg.epsilon
                    if cfg.norm_by_std
                    else 1.0
                )
            for i in members:
                a[i] = (scores[i] - m) / sd
        return to_dense(a, mask), to_dense(a, mask)
    if name == "grpo_passk":  # verl's: only the first best sample, by its lead
        a = [0.0] * b
        for members in naive_groups(group_ids).values():
            s = [scores[i] for i in members]
            best = s.index(max(s))
            lead = max(s) - max(s[:best] + s[best + 1 :])
            if cfg.norm_by_std:
                centre = sum(s) / len(s)
                lead /= math.sqrt(sum((x - centre) ** 2 for x in s) / (len(s) - 1)) + cfg.epsilon
            a[members[best]] = lead
        return to_dense(a, mask), to_dense(a, mask)
    if name in ("rloo", "rloo_vectorized"):
        a = [0.0] * b
        for members in naive_groups(group_ids).values():
            for i in members:
                others = [scores[j] for j in members if j != i]
                # verl's rloo keeps a lone sample's score, its vectorised form gives it 0
                lone = scores[i] if name == "rloo" else 0.0
                a[i] = scores[i] - mean(others) if others else lone
        return to_dense(a, mask), to_dense(a, mask)
    if name == "reinforce_plus_plus":
        ret = naive_discounted(rewards, mask, cfg.gamma)
        return to_dense(whiten(ret), mask, True), to_dense(ret, mask, True)
    if name == "reinforce_plus_plus_baseline":
        a = naive_group_baseline(scores, group_ids, False, 0.0)
        tok = whiten({(i, t): a[i] for i in range(b) for t in response_positions(mask[i])})
        return to_dense(tok, mask, True), to_dense(tok, mask, True)
    if name == "remax":
        ret = naive_discounted(rewards, mask, 1.0)
        adv = {k: v - float(baselines[k[0]]) for k, v in ret.items()}
        return to_dense(adv, mask, True), to_dense(ret, mask, True)
    if name == "opo":
        a = [0.0] * b
        for members in naive_groups(group_ids).values():
            lens = [len(response_positions(mask[i])) for i in members]
            base = (
                0.0
                if len(members) == 1
                else sum(n * scores[i] for n, i in zip(lens, members)) / sum(lens)
            )
            for i in members:
                a[i] = scores[i] - base
        return to_dense(a, mask), to_dense(a, mask)
    if name == "gpg":  # verl's compute_gpg_outcome_advantage: f_norm = 1
        alpha = b / max(sum(1 for x in scores if x != 0), 1)
        a = [alpha * x for x in naive_group_baseline(scores, group_ids, False, 0.0)]
        return to_dense(a, mask), to_dense(a, mask)
    if name == "gpg_paper":
        groups = naive_groups(group_ids)
        flat = sum(
            len(m) for m in groups.values() if len(m) > 1 and len({scores[i] for i in m}) == 1
        )
        alpha = b / max(b - flat, 1)
        a = [
            alpha * x for x in naive_group_baseline(scores, group_ids, cfg.norm_by_std, cfg.epsilon)
        ]
        return to_dense(a, mask), to_dense(a, mask)
    if name == "passk_expectation":
        a = naive_passk(scores, group_ids, cfg.passk_k, cfg.norm_by_std, cfg.epsilon)
        return to_dense(a, mask), to_dense(a, mask)
    if name == "sppo":  # Bradley-Terry win rate against the others of the group
        a = [0.0] * b
        for members in naive_groups(group_ids).values():
            for i in members:
                others = [j for j in members if j != i]
                p = (
                    mean([1 / (1 + math.exp(scores[j] - scores[i])) for j in others])
                    if others
                    else 0.5
                )
                a[i] = cfg.sppo_eta * (p - 0.5)
        return to_dense(a, mask), to_dense(a, mask)
    if name == "gdpo":  # one reward component: GRPO, then whitened over response tokens
        a = naive_group_baseline(scores, group_ids, cfg.norm_by_std, cfg.epsilon)
        tok = whiten({(i, t): a[i] for i in range(b) for t in response_positions(mask[i])})
        return to_dense(tok, mask, True), to_dense(tok, mask, True)
    raise AssertionError(name)


# estimators that need the sampling policy's token statistics (old_log_probs,
# sum_pi_squared) are tested on their own in test_algos_verl_names.py
PLAIN = [
    n
    for n in ADVANTAGE_ESTIMATORS.names()
    if not ADVANTAGE_ESTIMATORS.meta(n).get("needs_token_stats")
]


def make_case(seed, batch=12, seq=10, n_groups=4, binary=False, min_group=1):
    gen = torch.Generator().manual_seed(seed)
    mask = random_mask(gen, batch, seq)
    if min_group > 1:
        ids = torch.arange(n_groups).repeat_interleave(batch // n_groups)
        group_ids = (ids[torch.randperm(batch, generator=gen)] * 5 + 1).long()
    else:
        group_ids = random_group_ids(gen, batch, n_groups)
    rewards = outcome_rewards(gen, mask, binary=binary)
    # dense per-token rewards too (as a KL penalty would add), for the token-level estimators
    rewards = rewards + torch.where(
        mask > 0, 0.1 * torch.randn(batch, seq, generator=gen, dtype=torch.float64), 0.0
    )
    values = torch.randn(batch, seq, generator=gen, dtype=torch.float64)
    baselines = torch.randn(batch, generator=gen, dtype=torch.float64)
    return rewards, mask, group_ids, values, baselines


CONFIGS = [
    AdvantageConfig(),
    AdvantageConfig(gamma=0.9, lam=0.8, norm_by_std=False, whiten_gae=False, passk_k=2),
]


@pytest.mark.parametrize("name", PLAIN)
@pytest.mark.parametrize("cfg_index", [0, 1])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_naive_loop(name, cfg_index, seed):
    cfg = CONFIGS[cfg_index]
    passk = name in ("passk_expectation", "grpo_passk")
    rewards, mask, gids, values, baselines = make_case(
        seed, n_groups=3 if passk else 4, min_group=4 if passk else 1, binary=seed == 2
    )
    adv, ret = compute_advantages(
        name,
        token_rewards=rewards,
        response_mask=mask,
        group_ids=gids,
        values=values,
        config=cfg,
        baselines=baselines,
    )
    want_adv, want_ret = naive(name, rewards, mask, gids, values, baselines, cfg)
    torch.testing.assert_close(adv, want_adv, **TOL)
    torch.testing.assert_close(ret, want_ret, **TOL)


# ----- hand-computed cases ---------------------------------------------------------------


def one_token(scores):
    """Each sample: one prompt token then one response token holding its score."""
    rewards = torch.zeros(len(scores), 2, dtype=torch.float64)
    rewards[:, 1] = torch.tensor(scores, dtype=torch.float64)
    mask = torch.tensor([[0, 1]] * len(scores))
    return rewards, mask


def adv_of(name, scores, ids, **kw):
    rewards, mask = one_token(scores)
    cfg = kw.pop("config", AdvantageConfig())
    adv, _ = compute_advantages(
        name,
        token_rewards=rewards,
        response_mask=mask,
        group_ids=torch.tensor(ids),
        config=cfg,
        **kw,
    )
    return adv[:, 1].tolist()


def test_hand_grpo_and_dr_grpo():
    # group 7: scores 1, 0 -> mean .5, unbiased std sqrt(.5); group 9: one sample, baseline 0
    s = math.sqrt(0.5)
    got = adv_of("grpo", [1.0, 0.0, 3.0], [7, 7, 9])
    assert got == pytest.approx([0.5 / (s + 1e-6), -0.5 / (s + 1e-6), 3.0], abs=1e-9)
    assert adv_of("dr_grpo", [1.0, 0.0, 3.0], [7, 7, 9]) == pytest.approx([0.5, -0.5, 3.0])


def test_hand_rloo_opo_gpg():
    assert adv_of("rloo", [1.0, 2.0, 6.0], [0, 0, 0]) == pytest.approx([-3.0, -1.5, 4.5])
    # OPO: lengths 1 and 3, scores 1 and 0: baseline (1*1 + 3*0) / 4 = .25
    rewards = torch.tensor([[0, 0, 0, 1.0], [0, 0, 0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[0, 0, 0, 1], [0, 1, 1, 1]])
    adv, _ = compute_advantages(
        "opo", token_rewards=rewards, response_mask=mask, group_ids=torch.tensor([1, 1])
    )
    assert adv[0, 3] == pytest.approx(0.75) and adv[1, 1:].tolist() == pytest.approx([-0.25] * 3)
    # GPG (paper): 4 samples, group 1 all equal (M = 2): alpha = 4 / 2; group 0: +-0.5
    cfg = AdvantageConfig(norm_by_std=False)
    assert adv_of("gpg_paper", [1.0, 0.0, 2.0, 2.0], [0, 0, 1, 1], config=cfg) == pytest.approx(
        [1.0, -1.0, 0.0, 0.0]
    )
    # GPG (verl): 3 non-zero scores of 4: alpha = 4 / 3, never divided by the std
    assert adv_of("gpg", [1.0, 0.0, 2.0, 2.0], [0, 0, 1, 1]) == pytest.approx(
        [4 / 3 * 0.5, -4 / 3 * 0.5, 0.0, 0.0]
    )
    # a lone sample: rloo keeps its score, rloo_vectorized gives 0 (verl's two functions)
    assert adv_of("rloo", [1.0, 2.0, 5.0], [0, 0, 1]) == pytest.approx([-1.0, 1.0, 5.0])
    assert adv_of("rloo_vectorized", [1.0, 2.0, 5.0], [0, 0, 1]) == pytest.approx([-1.0, 1.0, 0.0])


def test_hand_gae():
    # one sample, responses at t=1,2 (t=0 prompt, t=3 padding): r = [0, 1], V = [.5, .25]
    rewards = torch.tensor([[9.0, 0.0, 1.0, 9.0]], dtype=torch.float64)
    values = torch.tensor([[9.0, 0.5, 0.25, 9.0]], dtype=torch.float64)
    mask = torch.tensor([[0, 1, 1, 0]])
    cfg = AdvantageConfig(gamma=0.5, lam=0.5, whiten_gae=False)
    adv, ret = compute_advantages(
        "gae",
        token_rewards=rewards,
        response_mask=mask,
        group_ids=torch.tensor([0]),
        values=values,
        config=cfg,
    )
    # A2 = 1 - .25 = .75; delta1 = 0 + .5*.25 - .5 = -.375; A1 = -.375 + .25*.75 = -.1875
    assert adv[0].tolist() == pytest.approx([0, -0.1875, 0.75, 0])
    assert ret[0].tolist() == pytest.approx([0, 0.3125, 1.0, 0])


def test_hand_reinforce_pp_and_remax():
    rewards = torch.tensor([[0.0, 1.0, 2.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1]])
    _, ret = compute_advantages(
        "reinforce_plus_plus",
        token_rewards=rewards,
        response_mask=mask,
        group_ids=torch.tensor([0]),
        config=AdvantageConfig(gamma=0.5),
    )
    assert ret[0].tolist() == pytest.approx([1.0, 2.0, 2.0])
    adv, ret = compute_advantages(
        "remax",
        token_rewards=rewards,
        response_mask=mask,
        group_ids=torch.tensor([0]),
        baselines=torch.tensor([1.0], dtype=torch.float64),
    )
    assert ret[0].tolist() == pytest.approx([3.0, 3.0, 2.0])
    assert adv[0].tolist() == pytest.approx([2.0, 2.0, 1.0])


def test_hand_passk_binary_matches_analytic_form():
    # n = 4, c = 1 correct, k = 2: R = 1 - C(3,2)/C(4,2) = .5, sigma = .5
    # correct: (1 - .5)/.5 = 1; wrong: (1 - C(2,1)/C(3,1) - .5)/.5 = -1/3
    got = adv_of(
        "passk_expectation",
        [1.0, 0.0, 0.0, 0.0],
        [0] * 4,
        config=AdvantageConfig(passk_k=2, epsilon=1e-12),
    )
    assert got == pytest.approx([1.0, -1 / 3, -1 / 3, -1 / 3], abs=1e-9)
    # k = 1 is GRPO with the population std
    got = adv_of(
        "passk_expectation", [1.0, 0.0], [0, 0], config=AdvantageConfig(passk_k=1, epsilon=1e-12)
    )
    assert got == pytest.approx([1.0, -1.0], abs=1e-9)


# ----- invariances -----------------------------------------------------------------------


def _insert_padding(t: torch.Tensor, cols: list[int], fill: torch.Tensor) -> torch.Tensor:
    pieces, prev = [], 0
    for j, c in enumerate(sorted(cols)):
        pieces += [t[:, prev:c], fill[:, j : j + 1]]
        prev = c
    pieces.append(t[:, prev:])
    return torch.cat(pieces, dim=1)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10_000), name=st.sampled_from(PLAIN), n_new=st.integers(1, 4))
def test_mask_invariance(seed, name, n_new):
    """Inserting masked-out columns (garbage values) anywhere changes nothing at the
    response tokens and gives 0 in the new columns."""
    rewards, mask, gids, values, baselines = make_case(
        seed, batch=8, seq=8, n_groups=2, min_group=4
    )
    gen = torch.Generator().manual_seed(seed + 1)
    cols = torch.randint(0, 9, (n_new,), generator=gen).tolist()
    garbage = torch.randn(8, n_new, generator=gen, dtype=torch.float64) * 100
    zeros = torch.zeros(8, n_new, dtype=torch.int64)
    cfg = AdvantageConfig(passk_k=2)
    kw = dict(group_ids=gids, baselines=baselines, config=cfg)
    adv, ret = compute_advantages(
        name, token_rewards=rewards, response_mask=mask, values=values, **kw
    )
    adv2, ret2 = compute_advantages(
        name,
        token_rewards=_insert_padding(rewards, cols, garbage),
        response_mask=_insert_padding(mask, cols, zeros),
        values=_insert_padding(values, cols, garbage),
        **kw,
    )
    keep = _insert_padding(torch.ones_like(mask), cols, zeros) > 0
    torch.testing.assert_close(adv2[:, keep.all(0)], adv, **TOL)
    torch.testing.assert_close(ret2[:, keep.all(0)], ret, **TOL)
    assert (adv2[:, ~keep.all(0)] == 0).all()


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10_000), name=st.sampled_from(PLAIN))
def test_group_permutation_invariance(seed, name):
    """Shuffling the samples and renaming the group ids permutes the result, nothing else."""
    rewards, mask, gids, values, baselines = make_case(
        seed, batch=9, seq=7, n_groups=3, min_group=3
    )
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(9, generator=gen)
    rename = {int(g): int(v) for g, v in zip(gids.unique(), torch.randperm(100, generator=gen)[:3])}
    new_ids = torch.tensor([rename[int(g)] for g in gids[perm]])
    cfg = AdvantageConfig(passk_k=2)
    adv, ret = compute_advantages(
        name,
        token_rewards=rewards,
        response_mask=mask,
        group_ids=gids,
        values=values,
        baselines=baselines,
        config=cfg,
    )
    adv_p, ret_p = compute_advantages(
        name,
        token_rewards=rewards[perm],
        response_mask=mask[perm],
        group_ids=new_ids,
        values=values[perm],
        baselines=baselines[perm],
        config=cfg,
    )
    torch.testing.assert_close(adv_p, adv[perm], **TOL)
    torch.testing.assert_close(ret_p, ret[perm], **TOL)


# ----- errors ------------------------------------------------------------------------------


def test_errors_name_the_problem():
    rewards, mask = one_token([1.0, 0.0])
    ids = torch.tensor([0, 0])
    with pytest.raises(RegistryError, match="did you mean 'grpo'.*registered: .*rloo"):
        compute_advantages("grp", token_rewards=rewards, response_mask=mask, group_ids=ids)
    with pytest.raises(InputError, match="needs values="):
        compute_advantages("gae", token_rewards=rewards, response_mask=mask, group_ids=ids)
    with pytest.raises(InputError, match="needs baselines="):
        compute_advantages("remax", token_rewards=rewards, response_mask=mask, group_ids=ids)
    with pytest.raises(InputError, match="group_ids must hold integer"):
        compute_advantages(
            "grpo", token_rewards=rewards, response_mask=mask, group_ids=ids.double()
        )
    with pytest.raises(InputError, match="response_mask has shape"):
        compute_advantages("grpo", token_rewards=rewards, response_mask=mask[:, :1], group_ids=ids)
    with pytest.raises(InputError, match="fewer than AdvantageConfig.passk_k=4"):
        compute_advantages(
            "passk_expectation", token_rewards=rewards, response_mask=mask, group_ids=ids
        )
    with pytest.raises(ConfigError, match="advantage.gamma=1.5"):
        AdvantageConfig(gamma=1.5)
    with pytest.raises(ConfigError, match="advantage.passk_k=0"):
        AdvantageConfig(passk_k=0)


def test_verl_grpo_passk_by_hand():
    # group of 4: scores 1, 0.5, 1, 0: the first 1 is the best; its lead over the runner-up
    # (the other 1) is 0, so nothing learns; with 1, 0.5, 0, 0 only sample 0 gets
    # (1 - 0.5) / (std + eps), std unbiased = sqrt(((1-.375)^2 + (.5-.375)^2 + 2 * .375^2) / 3)
    tie = adv_of("grpo_passk", [1.0, 0.5, 1.0, 0.0], [0] * 4)
    assert tie == [0.0, 0.0, 0.0, 0.0]
    got = adv_of("grpo_passk", [1.0, 0.5, 0.0, 0.0], [0] * 4)
    std = math.sqrt(((1 - 0.375) ** 2 + (0.5 - 0.375) ** 2 + 2 * 0.375**2) / 3)
    assert got == pytest.approx([0.5 / (std + 1e-6), 0.0, 0.0, 0.0])
    with pytest.raises(InputError, match="needs at least 2 per group"):
        adv_of("grpo_passk", [1.0, 0.0], [0, 1])


def test_registry_metadata():
    assert ADVANTAGE_ESTIMATORS.meta("gae") == {"needs_values": True}
    assert ADVANTAGE_ESTIMATORS.meta("remax") == {"needs_baselines": True}
    assert set(ADVANTAGE_ESTIMATORS.names(needs_groups=True)) >= {"grpo", "grpo_passk", "rloo"}
