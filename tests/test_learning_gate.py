"""The learning gate's arithmetic: thresholds from recorded runs, and the verdict naming what
fails (`python -m tephra.apps.ppo.learning_gate check|record`; CI runs `check` as its own
time-boxed step, since it trains the demo's model for real)."""

from __future__ import annotations

import json
import math

import pytest

from tephra.apps.ppo.learning_gate import (
    GAP_FACTOR,
    GAP_FLOOR,
    GATE_SEEDS,
    GATE_STEPS,
    SHARE,
    SIGMAS,
    THRESHOLDS,
    GateRun,
    thresholds_from,
    verdict,
)


def runs_of(gains: list[float], gap: float = 0.01, dtype: str = "bfloat16") -> list[GateRun]:
    return [GateRun(i, dtype, 0.3, 0.3 + g, gap) for i, g in enumerate(gains)]


def test_thresholds_are_the_recorded_mean_less_three_standard_errors_or_half_of_it():
    recorded = runs_of([0.15, 0.35, 0.25, 0.35], gap=0.02)
    t = thresholds_from(recorded, gate_seeds=2)
    # gains by hand: mean 0.275, sample sd sqrt(0.0275 / 3) = 0.095743
    assert t["gain_mean"] == pytest.approx(0.275)
    assert t["gain_sd"] == pytest.approx(0.0957, abs=1e-4)
    assert t["min_gain"] == pytest.approx(0.275 - 3 * 0.095743 / math.sqrt(2), abs=1e-4)
    # a tight recording: half the mean is the lower bound
    tight = thresholds_from(runs_of([0.30, 0.31, 0.29, 0.30]), gate_seeds=2)
    assert tight["min_gain"] == pytest.approx(0.15)
    assert t["max_gap"] == pytest.approx(3 * 0.02)
    # fp32's gaps are ~1e-5: the bound does not go below GAP_FLOOR
    assert thresholds_from(runs_of([0.2, 0.3], gap=1e-5), 2)["max_gap"] == GAP_FLOOR
    assert t["steps"] == GATE_STEPS and t["recorded_seeds"] == [0, 1, 2, 3]


def test_a_recording_that_cannot_tell_learning_from_none_is_refused():
    with pytest.raises(ValueError, match="too close to no learning"):
        thresholds_from(runs_of([0.0, 0.3, -0.1, 0.2]), gate_seeds=2)


def test_the_verdict_names_each_failure():
    stored = {"bfloat16": thresholds_from(runs_of([0.20, 0.30, 0.25, 0.35], gap=0.02), 2)}
    assert verdict(runs_of([0.25, 0.30]), stored) == []
    # lr 0: the weights never move, greedy accuracy after == before
    no_learning = verdict(runs_of([0.0, 0.0]), stored)
    assert len(no_learning) == 1
    assert no_learning[0].startswith("mean held-out accuracy gain +0.000 over seeds [0, 1]")
    # a planted mismatch: the log-probs the batch carries are not the rollout's
    broken = runs_of([0.25, 0.30])
    broken[1].max_gap = 0.5
    assert verdict(broken, stored) == [
        "seed 1: rollout/trainer log-prob gap 0.5 exceeds 0.06 (bfloat16): the trainer's "
        "log-probs are not the rollout's"
    ]
    nan = runs_of([0.25, 0.30])
    nan[0].max_gap = math.nan
    assert len(verdict(nan, stored)) == 1
    assert (
        "no thresholds recorded for compute dtype float32"
        in verdict(runs_of([0.3, 0.3], dtype="float32"), stored)[0]
    )


def test_stored_thresholds_cover_both_compute_dtypes_of_this_gate():
    stored = json.loads(THRESHOLDS.read_text())
    assert sorted(stored) == ["bfloat16", "float32"]
    for dtype, t in stored.items():
        assert t["steps"] == GATE_STEPS, dtype
        assert t["gate_seeds"] == len(GATE_SEEDS), dtype
        # the threshold was derived by the rule above from the gains stored beside it
        sd = t["gain_sd"]
        assert t["min_gain"] == pytest.approx(
            min(t["gain_mean"] - SIGMAS * sd / math.sqrt(len(GATE_SEEDS)), SHARE * t["gain_mean"]),
            abs=2e-4,
        )
        assert t["max_gap"] == pytest.approx(max(GAP_FACTOR * max(t["max_gaps"]), GAP_FLOOR))
        assert t["min_gain"] > 0.05, dtype
