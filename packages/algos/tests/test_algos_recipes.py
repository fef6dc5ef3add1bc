"""On-policy distillation, PRIME and SPIN / SPPO math against values worked out by hand
and naive per-sample loops."""

from __future__ import annotations

import math

import pytest
import torch

from tephra.algos import (
    SPIN_CHOSEN,
    ActorObjective,
    ActorObjectiveConfig,
    AdvantageConfig,
    ConfigError,
    InputError,
    PrimeRMObjective,
    SpinObjective,
    compute_advantages,
    compute_policy_loss,
    distillation_advantages,
    implicit_process_rewards,
    prime_advantages,
    prime_rm_loss,
    sequence_log_probs,
    spin_loss,
    sppo_loss,
    win_rates,
)

TOL = dict(atol=1e-6, rtol=1e-6)
F64 = torch.float64


def t(x, dtype=F64):
    return torch.tensor(x, dtype=dtype)


# ----- on-policy distillation ---------------------------------------------------------


def test_distillation_advantage_is_teacher_minus_student_on_sampled_tokens():
    student = t([[-9.0, -1.0, -2.0], [-9.0, -0.1, -9.0]])
    teacher = t([[-1.0, -0.5, -3.0], [-1.0, -0.2, -1.0]])
    mask = torch.tensor([[0, 1, 1], [0, 1, 0]])
    adv = distillation_advantages(student, teacher, mask, coef=2.0)
    torch.testing.assert_close(adv, t([[0.0, 1.0, -2.0], [0.0, -0.2, 0.0]]), **TOL)


def _actor_batch(log_probs, teacher, mask):
    n_tok = float(mask.sum())
    return {
        "old_log_probs": log_probs.detach().clone(),
        "advantages": torch.zeros_like(log_probs),
        "response_mask": mask,
        "teacher_log_probs": teacher,
        "global_token_count": torch.tensor([n_tok]),
        "global_seq_count": torch.tensor([float(mask.shape[0])]),
    }


def test_distillation_loss_term_value_and_gradient_by_hand():
    # advantages 0, ratio 1: the policy loss is 0, so loss = coef * token-mean(k1).
    log_probs = t([[-1.0, -2.0], [-0.5, -4.0]]).requires_grad_()
    teacher = t([[-1.5, -1.0], [-0.5, -9.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    cfg = ActorObjectiveConfig(distill_loss_coef=0.5, distill_loss_type="k1")
    loss, metrics = ActorObjective(cfg)(
        {"log_probs": log_probs}, _actor_batch(log_probs, teacher, mask)
    )
    k1 = (0.5 + -1.0 + 0.0) / 3
    assert math.isclose(float(loss.detach()), 0.5 * k1, abs_tol=1e-9)
    assert math.isclose(metrics["actor/distill_loss"], k1, abs_tol=1e-9)
    # k3+: k2's gradient, d/dlogp = coef * (logp - logq) / n_tokens
    lp = log_probs.detach().clone().requires_grad_()
    cfg = ActorObjectiveConfig(distill_loss_coef=0.5)
    loss, _ = ActorObjective(cfg)({"log_probs": lp}, _actor_batch(lp, teacher, mask))
    loss.backward()
    want = 0.5 * torch.where(mask > 0, lp.detach() - teacher, torch.zeros(())) / 3
    # the policy loss' own gradient is -A * ratio = 0
    torch.testing.assert_close(lp.grad, want, **TOL)


def test_distillation_loss_needs_teacher_log_probs():
    log_probs = t([[-1.0]]).requires_grad_()
    batch = _actor_batch(log_probs, t([[-1.0]]), torch.tensor([[1]]))
    del batch["teacher_log_probs"]
    with pytest.raises(InputError, match="teacher_log_probs.*distill_loss_coef=0.1"):
        ActorObjective(ActorObjectiveConfig(distill_loss_coef=0.1))({"log_probs": log_probs}, batch)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"distill_loss_coef": -1.0}, r"actor\.distill_loss_coef=-1\.0 must be >= 0"),
        ({"distill_loss_type": "k9"}, r"actor\.distill_loss_type='k9' is not registered"),
        ({"distill_loss_type": "full"}, r"distill_loss_type='full' needs full-vocabulary"),
    ],
)
def test_bad_distillation_options_are_refused(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        ActorObjectiveConfig(**kwargs)


# ----- PRIME --------------------------------------------------------------------------

RM = t([[-1.0, -1.0], [-2.0, -1.0]])
REF = t([[-2.0, -1.0], [-1.0, -1.0]])
MASK2 = torch.tensor([[1, 1], [1, 1]])


def test_implicit_rewards_are_beta_times_log_ratio():
    r = implicit_process_rewards(RM, REF, MASK2, beta=0.5)
    torch.testing.assert_close(r, t([[0.5, 0.0], [-0.5, 0.0]]))


def test_prime_rm_loss_by_hand():
    # R = (0.5, -0.5), labels (1, 0): both terms are log(1 + e^-0.5)
    rm = RM.clone().requires_grad_()
    loss, metrics = prime_rm_loss(rm, REF, MASK2, t([1.0, 0.0]), beta=0.5)
    assert math.isclose(float(loss.detach()), math.log1p(math.exp(-0.5)), rel_tol=1e-9)
    assert metrics["prime/rm_acc"] == 1.0
    loss.backward()
    # dL/dR_i = (sigmoid(R_i) - l_i) / 2; dR_i/d logp_rm = beta on response tokens
    s = 1 / (1 + math.exp(-0.5))
    g0, g1 = (s - 1) / 2 * 0.5, (1 - s) / 2 * 0.5
    torch.testing.assert_close(rm.grad, t([[g0, g0], [g1, g1]]), **TOL)


def test_prime_advantages_two_samples_by_hand():
    # r = [[0.5, 0], [-0.5, 0]]: token means 0.25, -0.25, so b = (-0.25, 0.25);
    # centred: [[0.75, 0.25], [-0.75, -0.25]], to-go [[1, 0.25], [-1, -0.25]];
    # outcomes (1, 0): leave-one-out (1, -1).
    r = t([[0.5, 0.0], [-0.5, 0.0]])
    adv = prime_advantages(
        r,
        t([1.0, 0.0]),
        MASK2,
        torch.tensor([7, 7]),
        process_coef=1.0,
        outcome_coef=1.0,
        whiten=False,
    )
    torch.testing.assert_close(adv, t([[2.0, 1.25], [-2.0, -1.25]]), **TOL)


def naive_prime(r, o, mask, gids, pc, oc):
    out = torch.zeros_like(r)
    for i in range(r.shape[0]):
        peers = [j for j in range(r.shape[0]) if gids[j] == gids[i] and j != i]
        pos = [k for k in range(r.shape[1]) if mask[i, k]]

        def tok_mean(j):
            p = [k for k in range(r.shape[1]) if mask[j, k]]
            return sum(float(r[j, k]) for k in p) / max(len(p), 1)

        b = sum(tok_mean(j) for j in peers) / len(peers) if peers else 0.0
        oo = float(o[i]) - (sum(float(o[j]) for j in peers) / len(peers) if peers else 0.0)
        for idx, k in enumerate(pos):
            out[i, k] = pc * sum(float(r[i, q]) - b for q in pos[idx:]) + oc * oo
    return out


def test_prime_advantages_match_naive_loop_with_gaps_and_singletons():
    g = torch.Generator().manual_seed(0)
    r = torch.randn(6, 5, generator=g, dtype=F64)
    o = (torch.rand(6, generator=g) > 0.5).to(F64)
    mask = torch.tensor(
        [
            [0, 1, 1, 1, 0],
            [0, 1, 0, 1, 1],
            [1, 1, 0, 0, 0],
            [0, 0, 1, 1, 1],
            [1, 1, 1, 1, 1],
            [0, 1, 1, 0, 0],
        ]
    )
    gids = torch.tensor([3, 1, 3, 1, 1, 9])
    adv = prime_advantages(r, o, mask, gids, process_coef=5.0, outcome_coef=2.0, whiten=False)
    torch.testing.assert_close(adv, naive_prime(r, o, mask, gids, 5.0, 2.0), **TOL)
    white = prime_advantages(r, o, mask, gids, process_coef=5.0, outcome_coef=2.0)
    vals = white[mask > 0]
    assert abs(float(vals.mean())) < 1e-9 and abs(float(vals.std()) - 1.0) < 1e-6


def test_prime_bad_inputs_name_the_argument():
    with pytest.raises(InputError, match="beta=0"):
        implicit_process_rewards(RM, REF, MASK2, beta=0)
    with pytest.raises(InputError, match="labels must be a \\[batch\\] vector of length 2"):
        prime_rm_loss(RM, REF, MASK2, t([1.0]), beta=0.1)


# ----- SPIN / SPPO --------------------------------------------------------------------


def test_spin_loss_on_a_hand_made_pair():
    chosen = t([-10.0]).requires_grad_()
    loss, metrics = spin_loss(chosen, t([-12.0]), t([-11.0]), t([-11.0]), beta=0.1)
    # margin = 0.1 * ((-10 + 11) - (-12 + 11)) = 0.2
    assert math.isclose(float(loss.detach()), math.log1p(math.exp(-0.2)), rel_tol=1e-12)
    assert math.isclose(metrics["spin/margin"], 0.2, rel_tol=1e-12)
    assert metrics["spin/accuracy"] == 1.0
    loss.backward()
    assert math.isclose(float(chosen.grad), -0.1 / (1 + math.exp(0.2)), rel_tol=1e-9)


def test_spin_objective_sums_to_the_mean_over_pairs():
    # 3 pairs, the chosen row first in pairs 0 and 2, second in pair 1; per-token log-probs
    g = torch.Generator().manual_seed(0)
    lp, ref = -torch.rand(6, 4, generator=g, dtype=F64), -torch.rand(6, 4, generator=g, dtype=F64)
    mask = torch.tensor([[0, 1, 1, 1]] * 6)
    chosen = t([1.0, 0.0, 0.0, 1.0, 1.0, 0.0])
    pair = torch.tensor([0, 0, 1, 1, 2, 2])
    seq, rseq = lp[:, 1:].sum(-1), ref[:, 1:].sum(-1)
    want, _ = spin_loss(seq[[0, 3, 4]], seq[[1, 2, 5]], rseq[[0, 3, 4]], rseq[[1, 2, 5]])
    objective = SpinObjective(0.1)
    total = 0.0
    for rows in (slice(0, 2), slice(2, 6)):  # two micro-batches of whole pairs
        batch = {
            "ref_log_probs": ref[rows],
            "response_mask": mask[rows],
            SPIN_CHOSEN: chosen[rows],
            "keep_together": pair[rows],
            "global_seq_count": torch.full((6,), 6.0),
        }
        loss, _ = objective({"log_probs": lp[rows]}, batch)
        total += float(loss)
    assert math.isclose(total, float(want), rel_tol=1e-12)
    batch = {
        "ref_log_probs": ref[1:3],
        "response_mask": mask[1:3],
        SPIN_CHOSEN: chosen[1:3],
        "keep_together": pair[1:3],
        "global_seq_count": torch.full((2,), 6.0),
    }
    with pytest.raises(InputError, match="SPIN pairs are cut"):
        objective({"log_probs": lp[1:3]}, batch)
    with pytest.raises(InputError, match=r"batch\['keep_together'\] is missing: the SPIN loss"):
        objective({"log_probs": lp[1:3]}, {k: v for k, v in batch.items() if k != "keep_together"})


def test_sequence_log_probs_sum_response_tokens():
    lp = t([[-9.0, -1.0, -2.0], [-9.0, -0.5, -9.0]])
    mask = torch.tensor([[0, 1, 1], [0, 1, 0]])
    torch.testing.assert_close(sequence_log_probs(lp, mask), t([-3.0, -0.5]))


def test_win_rates_bradley_terry_by_hand():
    p = win_rates(t([1.0, 0.0, 0.0, 4.0]), torch.tensor([0, 0, 0, 1]))
    s1 = 1 / (1 + math.exp(-1))
    torch.testing.assert_close(p, t([s1, (1 - s1 + 0.5) / 2, (1 - s1 + 0.5) / 2, 0.5]), **TOL)


def test_sppo_loss_by_hand():
    # eta 10: targets 10 * (0.6 - 0.5) = 1 and 0; log-ratios 1 and 1 -> residuals 0, 1
    lp = t([-5.0, -5.0]).requires_grad_()
    loss, _ = sppo_loss(lp, t([-6.0, -6.0]), t([0.6, 0.5]), eta=10.0)
    assert math.isclose(float(loss.detach()), 0.5, rel_tol=1e-9)
    loss.backward()
    torch.testing.assert_close(lp.grad, t([0.0, 1.0]), **TOL)  # 2 * resid / n


def test_self_play_bad_inputs():
    with pytest.raises(InputError, match="SPPO win_rate must lie in"):
        sppo_loss(t([0.0]), t([0.0]), t([1.5]))
    with pytest.raises(InputError, match="rejected must be a \\[batch\\] vector of length 1"):
        spin_loss(t([0.0]), t([0.0, 1.0]), t([0.0]), t([0.0]))


def test_sppo_estimator_and_policy_loss_by_hand():
    # one prompt, two samples scored 1 and 0; eta 2: P = sigmoid(+-1), A = 2 (P - 0.5)
    rewards = t([[0.0, 0.0, 1.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[0, 1, 1], [0, 1, 0]])
    adv, _ = compute_advantages(
        "sppo",
        token_rewards=rewards,
        response_mask=mask,
        group_ids=torch.tensor([4, 4]),
        config=AdvantageConfig(sppo_eta=2.0),
    )
    a0 = 2 * (1 / (1 + math.exp(-1)) - 0.5)
    torch.testing.assert_close(adv, t([[0.0, a0, a0], [0.0, -a0, 0.0]]), **TOL)
    old = t([[-3.0, -1.0, -2.0], [-3.0, -1.0, -3.0]])
    log_probs = (old + t([[9.0, 0.1, 0.2], [9.0, -0.1, 9.0]])).requires_grad_()
    loss, _ = compute_policy_loss(
        "sppo",
        log_probs,
        old,
        adv,
        mask,
        loss_agg_mode="token-mean",  # ignored: sppo averages over sequences
        global_token_count=3.0,
        global_seq_count=2.0,
    )
    r0, r1 = 0.3 - a0, -0.1 + a0  # sequence log-ratio minus target
    assert math.isclose(float(loss.detach()), (r0**2 + r1**2) / 2, rel_tol=1e-9)
    want, _ = sppo_loss(
        t([0.3, -0.1]), t([0.0, 0.0]), t([1 / (1 + math.exp(-1)), 1 / (1 + math.exp(1))]), eta=2.0
    )
    assert math.isclose(float(loss.detach()), float(want), rel_tol=1e-9)


def test_prime_rm_objective_micro_batches_sum_to_the_full_batch_loss():
    g = torch.Generator().manual_seed(3)
    rm = torch.randn(5, 4, generator=g, dtype=F64)
    ref = torch.randn(5, 4, generator=g, dtype=F64)
    mask = torch.tensor([[1, 1, 0, 0], [0, 1, 1, 1], [1, 0, 0, 0], [1, 1, 1, 1], [0, 0, 1, 1]])
    labels = t([1.0, 0.0, 1.0, 1.0, 0.0])
    full, _ = prime_rm_loss(rm, ref, mask, labels, beta=0.3)
    objective = PrimeRMObjective(beta=0.3)
    total = 0.0
    for part in (slice(0, 2), slice(2, 5)):
        batch = {
            "ref_log_probs": ref[part],
            "response_mask": mask[part],
            "prime_labels": labels[part],
            "global_seq_count": torch.tensor([5.0]),
        }
        loss, _ = objective({"log_probs": rm[part]}, batch)
        total += float(loss.detach())
    assert math.isclose(total, float(full.detach()), rel_tol=1e-12)
    with pytest.raises(InputError, match=r"batch\['prime_labels'\] is missing"):
        objective({"log_probs": rm}, {"ref_log_probs": ref, "response_mask": mask})
