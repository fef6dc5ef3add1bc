"""trainer.mode=one_step_off and algorithm.rollout_correction: names refused before Ray
starts, the correction's wiring on a batch (no Ray), and one app run of 4 steps (generation
overlapped in a worker thread) that a second run, resumed from its step-2 checkpoint and
generating ahead serially, repeats bitwise; every trained sample's weight version is
checked from the dumped generations."""

from __future__ import annotations

import json
import math

import pytest
import torch
from tensordict import TensorDict

from tephra.algos import RolloutCorrectionConfig
from tephra.apps.ppo.main import parse_config, run
from tephra.controller.run.models import resolve_model_path
from tephra.controller.run.trackers import read_jsonl
from tephra.controller.samples import Prompt, RewardResult, Sample, sample_from_dict, sample_to_dict
from tephra.controller.step.metrics import staleness_metrics
from tephra.controller.step.mismatch import (
    MismatchAlarm,
    apply_rejection,
    check_mismatch_alarm,
    correct_old_log_probs,
)
from tephra.controller.step.rounds import PENDING_FILE, Round, round_from_dict, round_to_dict
from tephra.controller.testing import SMOKE_REWARD, untimed_metrics
from tephra.core.errors import ConfigError

CAP = 1.5


def test_bad_names_are_refused_before_ray_starts():
    import ray

    with pytest.raises(
        ConfigError,
        match=r"trainer.mode='asnyc': choose one of \['sync', 'one_step_off', 'async'\]",
    ):
        parse_config(["-p", "smoke", "trainer.mode=asnyc"])
    with pytest.raises(
        ConfigError, match=r"algorithm.rollout_correction='tiss'.*did you mean 'tis'"
    ):
        parse_config(["-p", "smoke", "algorithm.rollout_correction=tiss"])
    with pytest.raises(ConfigError, match=r"algorithm.rollout_correction_level='seq'"):
        parse_config(["-p", "smoke", "algorithm.rollout_correction_level=seq"])
    with pytest.raises(ConfigError, match=r"algorithm.rollout_correction_cap=0.5 must be >= 1"):
        parse_config(["-p", "smoke", "algorithm.rollout_correction_cap=0.5"])
    with pytest.raises(ConfigError, match=r"would correct twice"):
        parse_config(
            ["-p", "smoke", "algorithm.rollout_correction=tis", "actor.objective.tis_level=token"]
        )
    assert not ray.is_initialized()


def _batch(seed=0):
    gen = torch.Generator().manual_seed(seed)
    mask = torch.tensor([[0, 1, 1, 1, 0], [0, 0, 1, 1, 1], [0, 1, 1, 0, 0]])
    rollout = torch.where(mask > 0, -torch.rand(3, 5, generator=gen), torch.zeros(3, 5))
    train = rollout + torch.where(mask > 0, torch.randn(3, 5, generator=gen), torch.zeros(3, 5))
    return TensorDict({"rollout_log_probs": rollout, "response_mask": mask}, batch_size=[3]), train


def test_bypass_uses_the_rollout_log_probs_and_skips_the_recompute():
    def never(_):
        raise AssertionError("bypass must not recompute old log-probs")

    batch, _ = _batch()
    for recompute in (False, True):  # several mini-batches would otherwise recompute them
        metrics, passes = correct_old_log_probs(
            batch, RolloutCorrectionConfig("bypass"), recompute, never
        )
        assert passes == 0 and metrics == {}
        assert torch.equal(batch["old_log_probs"], batch["rollout_log_probs"])
        assert "rollout_is_weights" not in batch.keys()


def test_tis_and_none_wiring_on_a_batch():
    batch, train = _batch(1)
    metrics, passes = correct_old_log_probs(
        batch, RolloutCorrectionConfig("tis", "token", CAP), False, lambda b: train
    )
    assert passes == 1 and torch.equal(batch["old_log_probs"], train)
    w, mask = batch["rollout_is_weights"], batch["response_mask"]
    for b in range(3):
        for t in range(5):
            want = min(math.exp(float(train[b, t]) - float(batch["rollout_log_probs"][b, t])), CAP)
            assert float(w[b, t]) == pytest.approx(want if mask[b, t] else 0.0, rel=1e-6)
    assert float(w.max()) == CAP  # this batch has ratios above the cap
    gaps = [
        float(train[b, t] - batch["rollout_log_probs"][b, t])
        for b in range(3)
        for t in range(5)
        if mask[b, t]
    ]
    assert metrics["rollout_corr/ratio_max"] == pytest.approx(math.exp(max(gaps)), rel=1e-6)
    # none: one mini-batch leaves old log-probs to the worker; several recompute them
    batch, train = _batch(2)
    assert correct_old_log_probs(batch, RolloutCorrectionConfig(), False, None) == ({}, 0)
    assert "old_log_probs" not in batch.keys()
    metrics, passes = correct_old_log_probs(batch, RolloutCorrectionConfig(), True, lambda b: train)
    assert passes == 1 and torch.equal(batch["old_log_probs"], train)
    assert "rollout_is_weights" not in batch.keys()
    gaps = [
        float(train[b, t] - batch["rollout_log_probs"][b, t])
        for b in range(3)
        for t in range(5)
        if batch["response_mask"][b, t]
    ]
    assert metrics["rollout_corr/log_prob_gap_mean"] == pytest.approx(sum(gaps) / len(gaps))
    assert metrics["rollout_corr/kl_k3"] == pytest.approx(
        sum(math.exp(g) - 1 - g for g in gaps) / len(gaps), rel=1e-5
    )


def test_the_mismatch_probe_rejection_and_the_alarm_on_a_batch():
    """Without old log-probs of its own the step probes a seeded subset of rows (rounded to
    the data-parallel size) for the mismatch figures; rejection drops tokens from the mask
    only after the advantages; the alarm names the step and the causes."""
    gen = torch.Generator().manual_seed(5)
    mask = torch.ones(6, 4, dtype=torch.long)
    rollout = -torch.rand(6, 4, generator=gen)
    train = rollout + 0.3 * torch.randn(6, 4, generator=gen)
    batch = TensorDict({"rollout_log_probs": rollout, "response_mask": mask}, batch_size=[6])
    seen = []

    def forward(b):
        seen.append(b["rollout_log_probs"].clone())
        rows = [
            int(((rollout - r).abs().sum(-1) == 0).nonzero()[0]) for r in b["rollout_log_probs"]
        ]
        return train[rows]

    metrics, passes = correct_old_log_probs(
        batch, RolloutCorrectionConfig(), False, forward, probe_rows=3, dp_size=2, probe_seed=7
    )
    assert passes == 0 and "old_log_probs" not in batch.keys()  # the update is untouched
    assert metrics["rollout_corr/probe_rows"] == 2.0 and seen[0].shape[0] == 2
    rows = [int(((rollout - r).abs().sum(-1) == 0).nonzero()[0]) for r in seen[0]]
    gaps = [float(train[b, t] - rollout[b, t]) for b in rows for t in range(4)]
    assert metrics["rollout_corr/log_prob_abs_gap_mean"] == pytest.approx(
        sum(abs(g) for g in gaps) / len(gaps), rel=1e-5
    )
    assert metrics["rollout_corr/kl_k3"] == pytest.approx(
        sum(math.exp(g) - 1 - g for g in gaps) / len(gaps), rel=1e-4
    )
    correct_old_log_probs(
        batch, RolloutCorrectionConfig(), False, forward, probe_rows=3, dp_size=2, probe_seed=7
    )
    assert torch.equal(seen[1], seen[0])  # the same seed probes the same rows
    assert correct_old_log_probs(
        batch, RolloutCorrectionConfig(), False, forward, probe_rows=0
    ) == ({}, 0)

    # rejection: the trainer's log-probs are computed, tokens over the bound leave the mask
    cfg = RolloutCorrectionConfig(rejection=("token_k3",), rejection_threshold=0.02)
    metrics, passes = correct_old_log_probs(batch, cfg, False, lambda b: train)
    assert passes == 1 and torch.equal(batch["old_log_probs"], train)
    g = train - rollout
    expected = (torch.expm1(g) - g <= 0.02).long()
    assert 0 < int(expected.sum()) < expected.numel()
    assert torch.equal(batch["response_mask"], mask)  # not yet: advantages come first
    apply_rejection(batch)
    assert torch.equal(batch["response_mask"], expected)
    assert "rejection_keep" not in batch.keys()
    assert metrics["rollout_corr/rs_masked_frac"] == pytest.approx(1 - expected.float().mean())

    check_mismatch_alarm(metrics, None, 3)
    check_mismatch_alarm(metrics, 10.0, 3)
    with pytest.raises(
        MismatchAlarm,
        match=r"step 3: the rollout's log-probs differ from the "
        r"trainer's by KL .* over algorithm.mismatch_alarm_kl=0.001\. Likely "
        r"causes: .*dtype",
    ):
        check_mismatch_alarm(metrics, 1e-3, 3)


def test_staleness_is_the_version_lag():
    samples = [Sample([1], [2], [1], None, "stop", weight_version=v) for v in (3, 3, 2, 3)]
    assert staleness_metrics(samples, 4) == {
        "staleness/mean": 1.25,
        "staleness/max": 2.0,
        "staleness/weight_version_min": 2.0,
        "staleness/weight_version_max": 3.0,
    }


def test_a_pending_batch_survives_its_json_file_exactly():
    """Two dynamic-sampling rounds (kept groups, filler) with float32 rollout log-probs
    (as the rollout returns them), an exotic score with its extras, error and clip flag, and a
    tool reward, through JSON text."""
    lp = torch.randn(2, 3, generator=torch.Generator().manual_seed(0)).tolist()
    rounds = []
    for r in range(2):
        items = [
            Prompt([], "src", "4", sample_id=f"step3r{r}-{j}", prompt_ids=[1, 2, r])
            for j in range(2)
        ]
        samples = [
            Sample(
                [1, 2, r],
                [5, 6, 7],
                [1, 0, 1],
                lp[k],
                "length",
                text="x y",
                reward=RewardResult(
                    1 / 3 + k, {"acc": 0.1 * k}, "ValueError: x" if k else None, clipped=k == 0
                ),
                sample_id=f"s{k}",
                num_turns=2,
                tool_calls=1,
                tool_rewards={"python": 0.1},
                weight_version=7 + r,
            )
            for k in range(2)
        ]
        rnd = Round(items, samples, 1, indices=[4 + r, 9], tag=f"step3r{r}", scored=True)
        rnd.informative = r
        rnd.keep([r], filler=r == 1)
        rounds.append(rnd)
    text = json.dumps([round_to_dict(r) for r in rounds])
    back = [round_from_dict(d, rnd.items) for d, rnd in zip(json.loads(text), rounds)]
    assert back == rounds
    assert [s.log_probs for r in back for s in r.samples] == [lp[0], lp[1]] * 2


def test_a_pending_sample_saved_with_flat_reward_fields_still_loads():
    """A sample as tephra-controller 0.3.0 wrote it into a checkpoint (its reward as four flat
    fields beside the tokens) loads with that reward, as `Sample.reward`."""
    saved = {
        "prompt_ids": [1, 2],
        "response_ids": [5, 6],
        "response_mask": [1, 1],
        "log_probs": [-0.5, -0.25],
        "finish_reason": "stop",
        "text": "x",
        "score": 0.75,
        "reward_error": "ValueError: x",
        "reward_clipped": True,
        "reward_extras": {"acc": 1.0},
        "sample_id": "s0",
        "weight_version": 3,
    }
    sample = sample_from_dict(saved)
    assert sample.reward == RewardResult(0.75, {"acc": 1.0}, "ValueError: x", True)
    assert (sample.response_ids, sample.log_probs, sample.weight_version) == (
        [5, 6],
        [-0.5, -0.25],
        3,
    )
    assert sample_from_dict(sample_to_dict(sample)) == sample  # and saves in today's form


def _compared(records):
    # wall-clock metrics differ run to run; everything computed from data must not
    return [untimed_metrics(r) for r in records]


@pytest.mark.multiproc
def test_one_step_off_resumes_exactly_and_trains_on_one_version_old_samples(
    ray_session, tmp_path, grpo_step_reference, smoke_score
):
    reward = tmp_path / "reward.py"
    reward.write_text(SMOKE_REWARD)

    def cfg(run_dir, *extra):
        return parse_config(
            [
                "-p",
                "smoke",
                f"reward.custom_function_path={reward}",
                "trainer.mode=one_step_off",
                "algorithm.rollout_correction=tis",
                f"algorithm.rollout_correction_cap={CAP}",
                "trainer.steps=4",
                "trainer.save_every=2",
                "trainer.dump_generations=1",
                f"trainer.run_dir={tmp_path / run_dir}",
                *extra,
            ]
        )

    full = run(cfg("full"))
    assert full["steps"] == 4
    step2 = tmp_path / "full" / "checkpoints" / "step_2"
    pending = json.loads((step2 / PENDING_FILE).read_text())
    # the checkpoint holds step 3's batch: 2 prompts x 4 samples, generated by version 1
    assert [len(r["samples"]) for r in pending] == [8]
    assert {s["weight_version"] for s in pending[0]["samples"]} == {1}
    # a second run continues from step 2's checkpoint (as if the first had stopped there),
    # generating ahead serially: the worker thread's overlap must not change a number
    resumed = run(
        cfg("resumed", f"trainer.resume_from={step2}", "trainer.overlap_generation=false")
    )
    assert resumed["steps"] == 4
    a = read_jsonl(tmp_path / "full" / "metrics.jsonl")
    b = read_jsonl(tmp_path / "resumed" / "metrics.jsonl")
    assert [r["step"] for r in a] == [1, 2, 3, 4] and [r["step"] for r in b] == [3, 4]
    assert _compared(a[2:]) == _compared(b)  # bitwise: floats compared with ==

    # step k trains on samples of weight version max(k - 2, 0): generated during step k-1,
    # before its update (step 1's batch is generated at the start, by version 0)
    for run_dir in ("full", "resumed"):
        for step in (1, 2, 3, 4) if run_dir == "full" else (3, 4):
            rows = [
                json.loads(x)
                for x in (tmp_path / run_dir / "generations" / f"train_step{step}.jsonl")
                .read_text()
                .splitlines()
            ]
            assert len(rows) == 8
            assert {r["weight_version"] for r in rows} == {max(step - 2, 0)}, (run_dir, step)
            # each score is the reward on the text; the advantages and the logged reward
            # mean are GRPO's, written out on those scores
            assert [r["score"] for r in rows] == [smoke_score(r["response"]) for r in rows]
            record = (a if run_dir == "full" else b)[step - 1 if run_dir == "full" else step - 3]
            want = grpo_step_reference(resolve_model_path("tiny", 0) if step == 1 else None, rows)
            assert [r["advantage"] for r in rows] == pytest.approx(want["advantages"], abs=1e-5)
            assert len({round(x, 6) for x in want["advantages"]}) > 1  # something to learn
            assert record["reward/mean"] == pytest.approx(want["reward/mean"], abs=1e-6)
            if step == 1:  # version 0 trains on its own samples: on-policy, tis weights 1 up
                # to the engines' rounding; the step's loss and gradient recomputed here
                assert record["actor/pg_loss"] == pytest.approx(want["pg_loss"], abs=1e-4)
                assert record["actor/grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-3)
    for r in a:
        lag = 0.0 if r["step"] == 1 else 1.0
        assert r["staleness/mean"] == r["staleness/max"] == lag
        assert (
            r["staleness/weight_version_min"]
            == r["staleness/weight_version_max"]
            == max(r["step"] - 2, 0)
        )
        # tis: mismatch metrics every step, weights never above the cap
        assert r["rollout_corr/kl_k3"] >= 0 and r["rollout_corr/tis_weight_mean"] <= CAP
        assert (r["rollout_corr/tis_capped_frac"] > 0) == (r["rollout_corr/ratio_max"] > CAP)
        assert "time/old_log_probs_s" in r and "time/generate_wait_s" in r
    # fresh samples differ from the trainer only by engine numerics; one version old they
    # differ by a whole update
    assert a[0]["rollout_corr/log_prob_abs_gap_mean"] < 1e-4
    assert all(r["rollout_corr/log_prob_abs_gap_mean"] > 1e-3 for r in a[1:])
