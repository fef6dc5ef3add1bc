"""Behaviour unchanged: the smoke, smoke_tools, spin, prime, distill, judge, critic-warmup and
vlm_smoke presets (two steps each on tiny models, one Ray session) log bitwise the metrics
recorded in `fixtures/preset_metrics.json` on the code before the recipes became plug-ins of the
step; only the timings (and what is computed from them) are left out.

A change meant to alter the numbers records them again:
`TEPHRA_RECORD_PRESET_METRICS=1 uv run pytest -m slow tests/test_preset_metrics.py -n 0`.
Bitwise holds only on the CPU kind and torch build that recorded them (another kind rounds
bf16 and fp32 reductions differently), so the test skips elsewhere, naming both; and it is
`slow` (eight runs) so that the default run's time stays bounded."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from tephra.apps.ppo.main import parse_config, run
from tephra.controller.run.trackers import read_jsonl
from tephra.controller.testing import SMOKE_REWARD, untimed_metrics
from tephra.core.machine import cpu_name
from tephra.rollout.testing import build_tiny_model

FIXTURE = Path(__file__).parent / "fixtures" / "preset_metrics.json"
RECORD = os.environ.get("TEPHRA_RECORD_PRESET_METRICS") == "1"


def _overrides(name: str, tmp_path: Path) -> list[str]:
    """The preset's command line: the smoke settings (two steps) under the preset named."""
    if name in ("smoke", "smoke_tools", "vlm_smoke"):
        return ["-p", name]
    if name == "prime":
        return ["-p", "smoke", "algorithm.prime.enabled=true"]
    if name == "distill":
        teacher = build_tiny_model(tmp_path / "teacher", seed=7)
        return [
            "-p",
            "smoke",
            "-p",
            "distill",
            f"algorithm.distillation.teacher_path={teacher.path}",
        ]
    if name == "judge":
        judge = build_tiny_model(tmp_path / "judge", seed=3)
        return [
            "-p",
            "smoke",
            "-p",
            "judge",
            f"reward.judge.model_path={judge.path}",
            "reward.judge.parser=last_number",
            "reward.judge.prompt_template=Rate {prompt} answer {response}",
            "reward.judge.chat_template=false",
            "reward.judge.max_new_tokens=6",
            "reward.judge.max_model_len=512",
        ]
    if name == "critic_warmup":
        return ["-p", "smoke", "-p", "vapo", "trainer.critic_warmup=1"]
    return ["-p", "smoke", "-p", name]


PRESETS = [
    "smoke",
    "smoke_tools",
    "spin",
    "prime",
    "distill",
    "judge",
    "critic_warmup",
    "vlm_smoke",
]


def _same(a: object, b: object) -> bool:
    """Bitwise equality of two metric values (NaN equals NaN)."""
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return type(a) is type(b) and a == b


def _machine() -> str:
    """What the bitwise numbers depend on: the CPU kind and the torch build."""
    import torch  # the fixture's key names the build that computed it

    return f"{cpu_name()}, torch {torch.__version__}"


@pytest.mark.slow
@pytest.mark.multiproc
# eight runs: 5 minutes alone on 2 cores, 16 when the machine is shared
@pytest.mark.timeout(2400)
def test_presets_log_the_recorded_metrics(ray_session, tmp_path):
    recorded = json.loads(FIXTURE.read_text()) if FIXTURE.exists() else {}
    if not RECORD and recorded.get("machine") != _machine():
        pytest.skip(
            f"the metrics were recorded on {recorded.get('machine')}; this is {_machine()}: "
            "record them here first (TEPHRA_RECORD_PRESET_METRICS=1) to guard a change"
        )
    reward = tmp_path / "reward.py"
    reward.write_text(SMOKE_REWARD)
    got: dict[str, object] = {"machine": _machine()}
    for name in PRESETS:
        run_dir = tmp_path / name
        cfg = parse_config(
            [
                *_overrides(name, tmp_path),
                f"reward.custom_function_path={reward}",
                "trainer.resume=off",
                f"trainer.run_dir={run_dir}",
            ]
        )
        run(cfg)
        got[name] = [untimed_metrics(r) for r in read_jsonl(run_dir / "metrics.jsonl")]
    if RECORD:
        FIXTURE.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
        return
    for name in PRESETS:
        want, have = recorded[name], got[name]
        assert isinstance(have, list)
        assert len(have) == len(want), f"{name}: {len(have)} records, recorded {len(want)}"
        for step, (w, h) in enumerate(zip(want, have, strict=True), start=1):
            assert sorted(h) == sorted(w), f"{name} step {step}: metric names differ: " + str(
                sorted(set(h) ^ set(w))
            )
            diff = {k: (w[k], h[k]) for k in w if not _same(w[k], h[k])}
            assert not diff, f"{name} step {step}: (recorded, now) differ: {diff}"
