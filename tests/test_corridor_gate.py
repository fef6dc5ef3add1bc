"""The convergence gate: the gate run's metrics stay inside the stored corridors, and the
check names what leaves them (`python -m tephra.apps.ppo.corridor_gate check|record`)."""

from __future__ import annotations

import json
import math

import pytest

from tephra.apps.ppo.corridor_gate import (
    CORRIDORS,
    GATE_METRICS,
    GATE_STEPS,
    main,
    make_corridors,
    violations,
)


def test_corridors_hold_every_seed_and_name_what_leaves_them():
    runs = [
        [{m: float(seed + step) for m in GATE_METRICS} for step in range(GATE_STEPS)]
        for seed in (0, 2)
    ]
    corridors = make_corridors(runs, margin=0.5)
    # step 0 spans 0..2: widened by 0.5 x 2 + 5% of 2 + 1e-6 on each side
    assert corridors["reward/mean"][0] == pytest.approx([-1.1 - 1e-6, 3.1 + 1e-6])
    assert all(violations(r, corridors) == [] for r in runs)
    broken = [dict(r) for r in runs[0]]
    broken[2]["actor/grad_norm"] = math.nan
    broken[4]["reward/mean"] = 100.0
    del broken[5]["actor/entropy"]
    assert violations(broken, corridors) == [
        "step 3: actor/grad_norm = nan (not finite)",
        "step 5: reward/mean = 100 outside [2.7, 7.3]",
        "step 6: actor/entropy was not logged",
    ]
    assert violations(runs[0][:4], corridors)[0] == (
        f"the run logged 4 steps, the gate expects {GATE_STEPS}"
    )


@pytest.mark.multiproc
def test_gate_run_stays_inside_the_stored_corridors(ray_session, capsys):
    stored = json.loads(CORRIDORS.read_text())
    assert sorted(stored) == sorted(GATE_METRICS)
    assert all(len(stored[m]) == GATE_STEPS for m in GATE_METRICS)
    code = main(["check"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert f"corridor gate: passed ({GATE_STEPS} steps)" in out
