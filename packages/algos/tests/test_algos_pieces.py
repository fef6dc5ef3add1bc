"""Value loss, entropy, DAPO pieces, truncated importance sampling, the engine-facing
objectives, configs and the registry, each against naive loops or hand-computed values."""

from __future__ import annotations

import math
import re

import pytest
import torch

from tephra.algos import (
    ADVANTAGE_ESTIMATORS,
    AGGREGATION_MODES,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    ActorObjective,
    ActorObjectiveConfig,
    ConfigError,
    CriticObjective,
    CriticObjectiveConfig,
    InputError,
    PolicyLossConfig,
    Registry,
    RegistryError,
    clipped_value_loss,
    entropy_from_logits,
    filter_groups,
    global_normalisers,
    overlong_penalty,
    truncated_importance_weights,
)
from tephra.algos.testing import random_mask, response_positions

TOL = dict(atol=1e-6, rtol=1e-6)


def tensors(seed, batch=6, seq=8):
    gen = torch.Generator().manual_seed(seed)
    mask = random_mask(gen, batch, seq)
    rnd = lambda: torch.randn(batch, seq, generator=gen, dtype=torch.float64)  # noqa: E731
    return gen, mask, rnd


# ----- value loss ----------------------------------------------------------------------


def test_value_loss_matches_naive():
    _, mask, rnd = tensors(0)
    values, old, returns = rnd(), rnd(), rnd()
    loss, metrics = clipped_value_loss(values, old, returns, mask, 0.5)
    n_clip = n = 0
    for b in range(6):
        for t in response_positions(mask[b]):
            v, o, r = float(values[b, t]), float(old[b, t]), float(returns[b, t])
            vc = o + min(max(v - o, -0.5), 0.5)
            assert float(loss[b, t]) == pytest.approx(0.5 * max((v - r) ** 2, (vc - r) ** 2))
            n_clip += (vc - r) ** 2 > (v - r) ** 2
            n += 1
    assert metrics["vf_clipfrac"] == pytest.approx(n_clip / n)
    loss_nc, _ = clipped_value_loss(values, old, returns, mask, None)
    torch.testing.assert_close(loss_nc, 0.5 * (values - returns) ** 2)


def test_value_loss_hand():
    t = lambda x: torch.tensor([[x]], dtype=torch.float64)  # noqa: E731
    # v = 2, old = 0, R = 0: clipped v = .5; max(4, .25) / 2 = 2
    loss, m = clipped_value_loss(t(2.0), t(0.0), t(0.0), torch.ones(1, 1), 0.5)
    assert float(loss) == 2.0 and m["vf_clipfrac"] == 0.0
    # v = 2, old = 0, R = 3: clipped .5 is further: max(1, 6.25) / 2
    loss, m = clipped_value_loss(t(2.0), t(0.0), t(3.0), torch.ones(1, 1), 0.5)
    assert float(loss) == 3.125 and m["vf_clipfrac"] == 1.0


# ----- entropy -------------------------------------------------------------------------


def test_entropy_from_logits():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 3, 4, generator=gen, dtype=torch.float64)
    got = entropy_from_logits(logits)
    for b in range(2):
        for t in range(3):
            z = [math.exp(float(x)) for x in logits[b, t]]
            p = [x / sum(z) for x in z]
            assert float(got[b, t]) == pytest.approx(-sum(q * math.log(q) for q in p))
    uniform = entropy_from_logits(torch.zeros(1, 1, 8, dtype=torch.float64))
    assert float(uniform) == pytest.approx(math.log(8))


# ----- DAPO ----------------------------------------------------------------------------


def test_filter_groups_hand_and_naive():
    scores = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.5, 0.7, 0.3])
    ids = torch.tensor([4, 4, 8, 8, 2, 2, 9, 5, 5])
    keep, report = filter_groups(scores, ids)
    # group 4: all 1 (solved), group 2: all 0 (unsolved), group 9: singleton (kept)
    assert keep.tolist() == [False, False, True, True, False, False, True, True, True]
    assert report["n_groups"] == 5 and report["n_groups_dropped"] == 2
    assert report["n_groups_all_max"] == 1 and report["n_groups_all_min"] == 1
    assert report["n_samples_kept"] == 5 and report["frac_groups_dropped"] == pytest.approx(0.4)
    keep, report = filter_groups(scores, ids, keep_singletons=False)
    assert not keep[6] and report["n_groups_dropped"] == 3
    gen = torch.Generator().manual_seed(2)
    scores = torch.randint(0, 2, (40,), generator=gen).double()
    ids = torch.randint(0, 10, (40,), generator=gen)
    keep, _ = filter_groups(scores, ids)
    for i in range(40):
        members = [j for j in range(40) if ids[j] == ids[i]]
        flat = len({float(scores[j]) for j in members}) == 1 and len(members) > 1
        assert bool(keep[i]) == (not flat)


def test_overlong_penalty():
    lengths = torch.tensor([10, 12, 14, 16, 20])
    got = overlong_penalty(
        lengths, max_response_length=16, overlong_buffer_len=4, penalty_factor=0.5
    )
    # expected 12: 0, 0, -(2/4), -(4/4), beyond the max: -1; all times .5
    assert got.tolist() == pytest.approx([0.0, 0.0, -0.25, -0.5, -0.5])
    with pytest.raises(InputError, match="overlong_buffer_len=0"):
        overlong_penalty(lengths, 16, 0)


# ----- truncated importance sampling ---------------------------------------------------


def test_truncated_importance_weights_match_naive():
    _, mask, rnd = tensors(3)
    old = -rnd().abs()
    rollout = old + 0.6 * rnd()
    for level in ("token", "sequence"):
        w, m = truncated_importance_weights(old, rollout, mask, level=level, threshold=1.5)
        n_trunc = n_units = 0
        for b in range(6):
            pos = response_positions(mask[b])
            seq_lr = sum(float(old[b, t] - rollout[b, t]) for t in pos)
            if level == "sequence":
                n_trunc += math.exp(seq_lr) > 1.5
                n_units += 1
            for t in range(8):
                if t not in pos:
                    assert float(w[b, t]) == 0.0
                    continue
                raw = math.exp(seq_lr if level == "sequence" else float(old[b, t] - rollout[b, t]))
                assert float(w[b, t]) == pytest.approx(min(raw, 1.5))
                if level == "token":
                    n_trunc += raw > 1.5
                    n_units += 1
        assert m["tis/frac_truncated"] == pytest.approx(n_trunc / n_units)
    pos = [(b, t) for b in range(6) for t in response_positions(mask[b])]
    k1 = sum(float(rollout[p] - old[p]) for p in pos) / len(pos)
    assert m["mismatch/k1"] == pytest.approx(k1)
    k3 = sum(
        math.exp(float(old[p] - rollout[p])) - 1 - float(old[p] - rollout[p]) for p in pos
    ) / len(pos)
    assert m["mismatch/k3"] == pytest.approx(k3)


# ----- objectives vs a naive composition ------------------------------------------------


def _objective_case(seed):
    gen, mask, rnd = tensors(seed, batch=5, seq=7)
    old = -rnd().abs()
    batch = {
        "old_log_probs": old,
        "advantages": rnd(),
        "response_mask": mask,
        "ref_log_probs": old + 0.2 * rnd(),
        "rollout_log_probs": old + 0.3 * rnd(),
        "values": rnd(),
        "returns": rnd(),
    }
    tokens, seqs = global_normalisers([mask])
    batch["global_token_count"] = torch.full((5,), tokens)
    batch["global_seq_count"] = torch.full((5,), seqs)
    outputs = {
        "log_probs": (old + 0.2 * rnd()).requires_grad_(True),
        "entropy": rnd().abs(),
        "values": (batch["values"] + 0.4 * rnd()),
    }
    return outputs, batch, tokens, seqs


def test_actor_objective_matches_naive_composition():
    outputs, batch, tokens, seqs = _objective_case(4)
    cfg = ActorObjectiveConfig(
        policy_loss="vanilla",
        loss_agg_mode="seq-mean-token-mean",
        entropy_coeff=0.02,
        use_kl_loss=True,
        kl_loss_coef=0.3,
        kl_loss_type="k3+",
        tis_level="token",
        tis_threshold=1.3,
    )
    loss, metrics = ActorObjective(cfg)(outputs, batch)
    mask = batch["response_mask"]
    want = 0.0
    for b in range(5):
        pos = response_positions(mask[b])
        acc = 0.0
        for t in pos:
            lp = float(outputs["log_probs"].detach()[b, t])
            old = float(batch["old_log_probs"][b, t])
            a = float(batch["advantages"][b, t])
            r = math.exp(lp - old)
            pg = max(-a * r, -a * min(max(r, 0.8), 1.2))
            if a < 0:
                pg = min(pg, -a * 3.0)
            w = min(math.exp(old - float(batch["rollout_log_probs"][b, t])), 1.3)
            ref = float(batch["ref_log_probs"][b, t])
            k3 = math.exp(ref - lp) - (ref - lp) - 1
            acc += w * pg - 0.02 * float(outputs["entropy"][b, t]) + 0.3 * k3
        want += acc / len(pos) / seqs
    assert float(loss.detach()) == pytest.approx(want, abs=1e-9)
    assert {
        "actor/pg_loss",
        "actor/pg_clipfrac",
        "actor/ppo_kl",
        "actor/entropy",
        "actor/kl_loss",
        "actor/tis/weight_mean",
        "actor/mismatch/k1",
    } <= set(metrics)
    assert all(isinstance(v, float) for v in metrics.values())


def test_critic_objective_matches_naive():
    outputs, batch, tokens, _ = _objective_case(5)
    loss, metrics = CriticObjective(CriticObjectiveConfig(cliprange_value=0.2))(outputs, batch)
    want = 0.0
    mask = batch["response_mask"]
    for b in range(5):
        for t in response_positions(mask[b]):
            v, o, r = (
                float(outputs["values"][b, t]),
                float(batch["values"][b, t]),
                float(batch["returns"][b, t]),
            )
            vc = o + min(max(v - o, -0.2), 0.2)
            want += 0.5 * max((v - r) ** 2, (vc - r) ** 2) / tokens
    assert float(loss) == pytest.approx(want, abs=1e-9)
    assert metrics["critic/vf_loss"] == pytest.approx(want)


def test_objectives_name_missing_inputs():
    outputs, batch, _, _ = _objective_case(6)
    no_entropy = {"log_probs": outputs["log_probs"]}
    with pytest.raises(InputError, match=r"outputs\['entropy'\] is missing.*entropy_coeff"):
        ActorObjective(ActorObjectiveConfig(entropy_coeff=0.1))(no_entropy, batch)
    loss, metrics = ActorObjective()(no_entropy, batch)  # entropy is optional otherwise
    assert "actor/entropy" not in metrics
    for key, cfg in [
        ("ref_log_probs", ActorObjectiveConfig(use_kl_loss=True)),
        ("rollout_log_probs", ActorObjectiveConfig(tis_level="token")),
        ("global_token_count", ActorObjectiveConfig()),
        ("advantages", ActorObjectiveConfig()),
    ]:
        partial = {k: v for k, v in batch.items() if k != key}
        with pytest.raises(InputError, match=rf"batch\['{key}'\] is missing"):
            ActorObjective(cfg)(outputs, partial)
    with pytest.raises(InputError, match=r"outputs\['values'\] is missing"):
        CriticObjective()({"log_probs": outputs["log_probs"]}, batch)


# ----- configs -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: PolicyLossConfig(clip_ratio_c=0.9), "policy_loss.clip_ratio_c=0.9 must be > 1"),
        (lambda: PolicyLossConfig(clip_ratio=-1), "policy_loss.clip_ratio=-1"),
        (lambda: PolicyLossConfig(clip_cov_lb=5, clip_cov_ub=1), "policy_loss.clip_cov_lb=5"),
        (lambda: ActorObjectiveConfig(policy_loss="ppo"), "actor.policy_loss='ppo'"),
        (lambda: ActorObjectiveConfig(loss_agg_mode="token-summ"), "actor.loss_agg_mode"),
        (lambda: ActorObjectiveConfig(kl_loss_type="k5"), "actor.kl_loss_type='k5'"),
        (lambda: ActorObjectiveConfig(kl_loss_type="full"), "needs full-vocabulary"),
        (
            lambda: ActorObjectiveConfig(loss_agg_mode="seq-mean-token-sum-norm"),
            "actor.loss_agg_norm_constant=None",
        ),
        (lambda: ActorObjectiveConfig(tis_level="seq"), "actor.tis_level='seq'"),
        (lambda: ActorObjectiveConfig(tis_threshold=1.0), "actor.tis_threshold=1.0"),
        (lambda: CriticObjectiveConfig(cliprange_value=0), "critic.cliprange_value=0"),
    ],
)
def test_config_errors_name_the_field(make, match):
    with pytest.raises(ConfigError, match=match):
        make()


def test_config_defaults_and_dict_policy():
    cfg = PolicyLossConfig(clip_ratio=0.1, clip_ratio_high=0.3)
    assert (cfg.clip_ratio_low, cfg.clip_ratio_high) == (0.1, 0.3)
    actor = ActorObjectiveConfig(policy={"clip_ratio": 0.25})
    assert actor.policy.clip_ratio_high == 0.25


# ----- registry ------------------------------------------------------------------------


def test_registry_semantics():
    reg: Registry = Registry("widget")

    @reg.register("a")
    def a():
        return 1

    reg.register("alias", a)  # the same object under a second name is fine
    reg.register("a", a)  # re-registering the same object is fine
    with pytest.raises(RegistryError, match="widget 'a' is already registered"):
        reg.register("a", lambda: 2)
    assert reg.get("a") is a and reg.names() == ["a", "alias"] and "a" in reg and len(reg) == 2
    with pytest.raises(RegistryError) as err:
        reg.get("aliass")
    assert str(err.value) == "unknown widget 'aliass'; did you mean 'alias'? registered: a, alias"
    assert isinstance(err.value, KeyError)


def test_every_registry_lists_names_on_unknown():
    for reg in (ADVANTAGE_ESTIMATORS, POLICY_LOSSES, KL_ESTIMATORS, AGGREGATION_MODES):
        with pytest.raises(RegistryError, match=re.escape("registered: " + ", ".join(reg.names()))):
            reg.get("nope")


def test_objectives_accept_tensordicts():
    """At runtime engines pass TensorDicts; the result must equal the plain-dict one."""
    tensordict = pytest.importorskip("tensordict")
    outputs, batch, _, _ = _objective_case(7)
    cfg = ActorObjectiveConfig(entropy_coeff=0.01, use_kl_loss=True, tis_level="sequence")
    td_out = tensordict.TensorDict(outputs, batch_size=[5])
    td_batch = tensordict.TensorDict(batch, batch_size=[5])
    for objective in (ActorObjective(cfg), CriticObjective()):
        want, want_metrics = objective(outputs, batch)
        got, got_metrics = objective(td_out, td_batch)
        torch.testing.assert_close(got, want)
        assert got_metrics == want_metrics
    no_entropy = tensordict.TensorDict({"log_probs": outputs["log_probs"]}, batch_size=[5])
    _, metrics = ActorObjective()(no_entropy, td_batch)
    assert "actor/entropy" not in metrics


@pytest.mark.parametrize("name", POLICY_LOSSES.names())
def test_micro_batch_without_response_tokens_contributes_zero(name):
    """A micro-batch of padding rows (ranks can get one) gives loss 0 and zero gradient."""
    outputs, batch, _, _ = _objective_case(8)
    batch["response_mask"] = torch.zeros_like(batch["response_mask"])
    cfg = ActorObjectiveConfig(
        policy_loss=name, entropy_coeff=0.01, use_kl_loss=True, tis_level="sequence"
    )
    loss, metrics = ActorObjective(cfg)(outputs, batch)
    (grad,) = torch.autograd.grad(loss, outputs["log_probs"])
    assert float(loss.detach()) == 0.0 and (grad == 0).all()
    assert all(math.isfinite(v) for v in metrics.values())
