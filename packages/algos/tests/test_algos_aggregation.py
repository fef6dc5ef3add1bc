"""Aggregation modes vs naive loops, and micro-batch / rank splits summing to the full loss."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tephra.algos import (
    AGGREGATION_MODES,
    POLICY_LOSSES,
    ActorObjective,
    ActorObjectiveConfig,
    CriticObjective,
    CriticObjectiveConfig,
    InputError,
    PolicyLossConfig,
    RegistryError,
    aggregate_loss,
    compute_policy_loss,
    global_normalisers,
)
from tephra.algos.testing import random_mask, response_positions

TOL = dict(atol=1e-6, rtol=1e-6)
C = 16.0


def naive_aggregate(loss_mat, mask, mode):
    rows = [
        [float(loss_mat[b, t]) for t in response_positions(mask[b])] for b in range(mask.shape[0])
    ]
    rows = [r for r in rows if r]
    n_tok = sum(len(r) for r in rows)
    if mode == "token-mean":
        return sum(sum(r) for r in rows) / n_tok
    if mode == "token-sum":
        return sum(sum(r) for r in rows)
    if mode == "seq-mean-token-sum":
        return sum(sum(r) for r in rows) / len(rows)
    if mode == "seq-mean-token-mean":
        return sum(sum(r) / len(r) for r in rows) / len(rows)
    if mode == "seq-mean-token-sum-norm":
        return sum(sum(r) / C for r in rows) / len(rows)
    raise AssertionError(mode)


def case(seed, batch=10, seq=12):
    gen = torch.Generator().manual_seed(seed)
    mask = random_mask(gen, batch, seq)
    mask[3] = 0  # a padding row: no response token, counts for nothing
    loss_mat = torch.randn(batch, seq, generator=gen, dtype=torch.float64)
    loss_mat[mask == 0] = float("nan")  # masked positions never leak
    return loss_mat, mask


@pytest.mark.parametrize("mode", AGGREGATION_MODES.names())
@pytest.mark.parametrize("seed", [0, 1])
def test_matches_naive_loop(mode, seed):
    loss_mat, mask = case(seed)
    tokens, seqs = global_normalisers([mask])
    got = aggregate_loss(
        loss_mat, mask, mode, global_token_count=tokens, global_seq_count=seqs, norm_constant=C
    )
    assert float(got) == pytest.approx(naive_aggregate(loss_mat, mask, mode), abs=1e-9)


def test_hand_cases():
    loss_mat = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    kw = dict(global_token_count=4.0, global_seq_count=2.0, norm_constant=2.0)
    expect = {
        "token-mean": 10 / 4,
        "seq-mean-token-sum": 10 / 2,
        "seq-mean-token-mean": (2 + 4) / 2,
        "seq-mean-token-sum-norm": (6 / 2 + 4 / 2) / 2,
    }
    for mode, want in expect.items():
        assert float(aggregate_loss(loss_mat, mask, mode, **kw)) == pytest.approx(want)


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    mode=st.sampled_from(AGGREGATION_MODES.names()),
    n_parts=st.integers(1, 5),
)
def test_micro_batch_split_sums_to_full_batch(seed, mode, n_parts):
    """Any split into micro-batches (or ranks), each divided by the GLOBAL normalisers,
    sums to the full-batch loss; and so does its gradient."""
    loss_mat, mask = case(seed)
    loss_mat = torch.where(mask > 0, loss_mat, 0.0).requires_grad_(True)
    tokens, seqs = global_normalisers([mask])
    kw = dict(global_token_count=tokens, global_seq_count=seqs, norm_constant=C)
    full = aggregate_loss(loss_mat, mask, mode, **kw)
    (g_full,) = torch.autograd.grad(full, loss_mat)
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(mask.shape[0], generator=gen)
    parts = [p for p in torch.tensor_split(order, n_parts) if p.numel()]
    assert global_normalisers([mask[p] for p in parts]) == (tokens, seqs)
    total = sum(aggregate_loss(loss_mat[p], mask[p], mode, **kw) for p in parts)
    (g_parts,) = torch.autograd.grad(total, loss_mat)
    torch.testing.assert_close(total, full, **TOL)
    torch.testing.assert_close(g_parts, g_full, **TOL)


@pytest.mark.parametrize("mode", AGGREGATION_MODES.names())
def test_objectives_split_sums_to_full_batch(mode):
    """The engine-facing objectives obey the same rule with the batch's normalisers."""
    gen = torch.Generator().manual_seed(7)
    loss_mat, mask = case(7)
    b, t = mask.shape
    old = -torch.rand(b, t, generator=gen, dtype=torch.float64)
    log_probs = old + 0.3 * torch.randn(b, t, generator=gen, dtype=torch.float64)
    batch = {
        "old_log_probs": old,
        "advantages": torch.randn(b, t, generator=gen, dtype=torch.float64),
        "response_mask": mask,
        "ref_log_probs": old - 0.1,
        "rollout_log_probs": old + 0.2 * torch.randn(b, t, generator=gen, dtype=torch.float64),
        "values": torch.randn(b, t, generator=gen, dtype=torch.float64),
        "returns": torch.randn(b, t, generator=gen, dtype=torch.float64),
    }
    tokens, seqs = global_normalisers([mask])
    batch["global_token_count"] = torch.full((b,), tokens, dtype=torch.float32)
    batch["global_seq_count"] = torch.full((b,), seqs, dtype=torch.float32)
    outputs = {
        "log_probs": log_probs,
        "entropy": torch.rand(b, t, generator=gen, dtype=torch.float64),
        "values": batch["values"] + 0.3,
    }
    actor = ActorObjective(
        ActorObjectiveConfig(
            policy=PolicyLossConfig(clip_ratio_high=0.28),
            loss_agg_mode=mode,
            loss_agg_norm_constant=C,
            entropy_coeff=0.01,
            use_kl_loss=True,
            tis_level="sequence",
        )
    )
    critic = CriticObjective(CriticObjectiveConfig(loss_agg_mode=mode, loss_agg_norm_constant=C))
    for objective in (actor, critic):
        full, _ = objective(outputs, batch)
        parts = [torch.arange(0, 4), torch.arange(4, 7), torch.arange(7, b)]
        total = sum(
            objective({k: v[p] for k, v in outputs.items()}, {k: v[p] for k, v in batch.items()})[0]
            for p in parts
        )
        torch.testing.assert_close(total, full, **TOL)


def test_errors():
    loss_mat, mask = case(0)
    with pytest.raises(RegistryError, match="did you mean 'token-mean'.*registered: "):
        aggregate_loss(loss_mat, mask, "token_mean", global_token_count=1.0, global_seq_count=1.0)
    with pytest.raises(InputError, match="norm_constant=None"):
        aggregate_loss(
            loss_mat, mask, "seq-mean-token-sum-norm", global_token_count=1.0, global_seq_count=1.0
        )
    with pytest.raises(InputError, match="global_token_count=0"):
        aggregate_loss(loss_mat, mask, "token-mean", global_token_count=0, global_seq_count=1.0)
    with pytest.raises(InputError, match="must be a scalar"):
        aggregate_loss(
            loss_mat, mask, "token-mean", global_token_count=torch.ones(3), global_seq_count=1.0
        )
    with pytest.raises(InputError, match="no response token"):
        global_normalisers([torch.zeros(2, 3)])


def test_half_precision_losses_reduce_in_float32():
    mask = torch.ones(1, 12345, dtype=torch.int64)
    loss_mat = torch.ones(1, 12345, dtype=torch.bfloat16)
    got = aggregate_loss(
        loss_mat, mask, "token-mean", global_token_count=12345.0, global_seq_count=1.0
    )
    assert got.dtype == torch.float32 and float(got) == 1.0


def _pad(t: torch.Tensor, cols: list[int], fill) -> torch.Tensor:
    out = t
    for c in sorted(cols, reverse=True):
        col = torch.full_like(out[:, :1], fill)
        out = torch.cat([out[:, :c], col, out[:, c:]], dim=1)
    return out


@settings(max_examples=15, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    mode=st.sampled_from(AGGREGATION_MODES.names()),
    loss=st.sampled_from(POLICY_LOSSES.names()),
    cols=st.lists(st.integers(0, 12), min_size=1, max_size=4),
)
def test_objective_mask_invariance(seed, mode, loss, cols):
    """Inserting masked-out columns (garbage values) anywhere leaves the actor loss, its
    gradient at the real tokens and its metrics unchanged."""
    gen = torch.Generator().manual_seed(seed)
    _, mask = case(seed)
    b, t = mask.shape
    rnd = lambda: torch.randn(b, t, generator=gen, dtype=torch.float64)  # noqa: E731
    old = -rnd().abs()
    fields = {
        "old_log_probs": old,
        "advantages": rnd(),
        "ref_log_probs": old + 0.1 * rnd(),
        "rollout_log_probs": old + 0.2 * rnd(),
        "log_probs": old + 0.3 * rnd(),
        "entropy": rnd().abs(),
    }
    tokens, seqs = global_normalisers([mask])
    cfg = ActorObjectiveConfig(
        policy_loss=loss,
        loss_agg_mode=mode,
        loss_agg_norm_constant=C,
        entropy_coeff=0.01,
        use_kl_loss=True,
        tis_level="token",
        policy=PolicyLossConfig(
            clip_cov_lb=-1, clip_cov_ub=1, clip_cov_ratio=0.05, clip_cov_seed=0
        ),
    )

    def run(fields, mask):
        lp = fields["log_probs"].clone().requires_grad_(True)
        batch = {k: v for k, v in fields.items() if k not in ("log_probs", "entropy")}
        batch.update(
            response_mask=mask,
            global_token_count=torch.full((b,), tokens),
            global_seq_count=torch.full((b,), seqs),
        )
        value, metrics = ActorObjective(cfg)({"log_probs": lp, "entropy": fields["entropy"]}, batch)
        (grad,) = torch.autograd.grad(value, lp)
        return value, grad, metrics

    value, grad, metrics = run(fields, mask)
    padded = {k: _pad(v, cols, -3.0 if "log_probs" in k else 1e3) for k, v in fields.items()}
    value2, grad2, metrics2 = run(padded, _pad(mask, cols, 0))
    real = _pad(torch.ones_like(mask), cols, 0) > 0
    torch.testing.assert_close(value2, value, **TOL)
    torch.testing.assert_close(grad2[:, real[0]], grad, **TOL)
    assert (grad2[:, ~real[0]] == 0).all()
    assert metrics2 == pytest.approx(metrics)


# ----- the trainer's path (ActorObjective) and compute_policy_loss agree ---------------------


@pytest.mark.parametrize("mode", AGGREGATION_MODES.names())
@pytest.mark.parametrize("loss", POLICY_LOSSES.names())
def test_trainer_path_equals_compute_policy_loss(loss, mode):
    """Every policy loss in every aggregation mode, with rollout IS weights: ActorObjective
    (what the engines run) gives compute_policy_loss's value and gradient; a loss that fixes
    its own aggregation (geo_mean) ignores `mode` in both, as verl does."""

    gen = torch.Generator().manual_seed(3)
    mask = random_mask(gen, 5, 7)
    rnd = lambda: torch.randn(5, 7, generator=gen, dtype=torch.float64)  # noqa: E731
    old = -rnd().abs()
    adv, lp0 = rnd(), old + 0.2 * rnd()
    weights = torch.where(mask > 0, 0.5 + rnd().abs(), torch.zeros(()))
    tokens, seqs = global_normalisers([mask])
    policy = PolicyLossConfig(clip_cov_lb=-1, clip_cov_ub=1, clip_cov_ratio=0.05, clip_cov_seed=0)
    cfg = ActorObjectiveConfig(
        policy_loss=loss, loss_agg_mode=mode, loss_agg_norm_constant=C, policy=policy
    )
    lp = lp0.clone().requires_grad_(True)
    batch = {
        "old_log_probs": old,
        "advantages": adv,
        "response_mask": mask,
        "rollout_is_weights": weights,
        "global_token_count": torch.full((5,), tokens),
        "global_seq_count": torch.full((5,), seqs),
    }
    trainer, _ = ActorObjective(cfg)({"log_probs": lp}, batch)
    (g_trainer,) = torch.autograd.grad(trainer, lp)
    lp2 = lp0.clone().requires_grad_(True)
    direct, _ = compute_policy_loss(
        loss,
        lp2,
        old,
        adv,
        mask,
        config=policy,
        loss_agg_mode=mode,
        global_token_count=tokens,
        global_seq_count=seqs,
        norm_constant=C,
        token_weights=weights,
    )
    (g_direct,) = torch.autograd.grad(direct, lp2)
    torch.testing.assert_close(trainer, direct, **TOL)
    torch.testing.assert_close(g_trainer, g_direct, **TOL)


@pytest.mark.parametrize("mode", AGGREGATION_MODES.names())
def test_geo_mean_on_the_trainer_path_is_verls_in_every_mode(mode):
    """Two rows of lengths 3 and 1, advantages +1 / -1, on-policy: verl's geo_mean loss is
    mean_i(-A_i * 1) = (-1 + 1) / 2 = 0 whatever loss_agg_mode says (it was -0.5 with
    token-mean and -2.0 with token-sum on the trainer path)."""
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    lp = torch.log(torch.tensor([[0.5, 0.4, 0.3], [0.2, 1.0, 1.0]], dtype=torch.float64))
    adv = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]], dtype=torch.float64)
    tokens, seqs = global_normalisers([mask])
    batch = {
        "old_log_probs": lp,
        "advantages": adv,
        "response_mask": mask,
        "global_token_count": torch.full((2,), tokens),
        "global_seq_count": torch.full((2,), seqs),
    }
    cfg = ActorObjectiveConfig(policy_loss="geo_mean", loss_agg_mode=mode, loss_agg_norm_constant=C)
    loss, _ = ActorObjective(cfg)({"log_probs": lp.clone().requires_grad_(True)}, batch)
    assert float(loss.detach()) == pytest.approx(0.0, abs=1e-12)
    # and with rollout IS weights, one per sequence: their geometric means 2 and 0.5 scale
    # the sequences' losses (verl: exp(mean_t log w_t)), -1 * 2 + 1 * 0.5 over 2 sequences
    w = torch.tensor([[1.0, 2.0, 4.0], [0.5, 9.0, 9.0]], dtype=torch.float64)
    loss, _ = ActorObjective(cfg)(
        {"log_probs": lp.clone().requires_grad_(True)}, {**batch, "rollout_is_weights": w}
    )
    assert float(loss.detach()) == pytest.approx((-1 * 2 + 1 * 0.5) / 2, rel=1e-6)
