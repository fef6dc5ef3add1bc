"""The apps' presets compose to the configs recorded in `fixtures/preset_configs.json`: what
`uv run apps/NAME [-p PRESET ...] --print-config` printed on the code before the demo's
defaults moved out of the library into the apps/ppo `default` preset. Every preset of the
three apps (and the combinations the tests use) must compose to exactly the same values, so
`uv run apps/ppo` still runs the same demo and each preset the same run.

A change meant to alter a preset records them again:
`TEPHRA_RECORD_PRESET_CONFIGS=1 uv run pytest tests/test_preset_configs.py -n 0`."""

from __future__ import annotations

import contextlib
import io
import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from tephra.apps.eval.main import main as eval_main
from tephra.apps.ppo.main import main as ppo_main
from tephra.apps.sft.main import main as sft_main

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = Path(__file__).parent / "fixtures" / "preset_configs.json"
RECORD = os.environ.get("TEPHRA_RECORD_PRESET_CONFIGS") == "1"
MAINS: dict[str, Callable[[list[str]], None]] = {
    "ppo": ppo_main,
    "sft": sft_main,
    "eval": eval_main,
}
COMBINED = [["smoke", p] for p in ("distill", "judge", "spin", "ppo_critic", "dapo")]
"""apps/ppo presets laid over `smoke`, as the end-to-end tests run them."""


def _cases() -> list[tuple[str, list[str]]]:
    """(app, presets) of every recorded composition: no preset, each preset, the combinations."""
    out: list[tuple[str, list[str]]] = []
    for app in MAINS:
        folder = ROOT / "apps" / app / "src" / "tephra" / "apps" / app / "presets"
        # `default` is the demo's base, applied under every ppo run: the no-preset case
        names = sorted(p.stem for p in folder.glob("*.yaml") if p.stem != "default")
        out += [(app, []), *((app, [n]) for n in names)]
        if app == "ppo":
            out += [(app, combo) for combo in COMBINED]
    return out


def _key(app: str, presets: list[str]) -> str:
    return f"{app}:{'+'.join(presets) or '(default)'}"


def _composed(app: str, presets: list[str]) -> dict:
    argv = [a for p in presets for a in ("-p", p)] + ["--print-config"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        MAINS[app](argv)
    return yaml.safe_load(out.getvalue())


def _differences(got: object, want: object, where: str = "") -> list[str]:
    """The dotted keys where two composed configs differ, with both values."""
    if isinstance(got, dict) and isinstance(want, dict):
        return [
            d
            for k in sorted(set(got) | set(want))
            for d in _differences(got.get(k, "<absent>"), want.get(k, "<absent>"), f"{where}{k}.")
        ]
    return [] if got == want else [f"{where.rstrip('.')}: {got!r}, recorded {want!r}"]


def test_every_preset_composes_to_the_recorded_config() -> None:
    cases = _cases()
    composed = {_key(app, presets): _composed(app, presets) for app, presets in cases}
    if RECORD:
        FIXTURE.write_text(json.dumps(composed, indent=1, sort_keys=True) + "\n")
        pytest.skip(f"recorded {len(composed)} configs to {FIXTURE}")
    recorded = json.loads(FIXTURE.read_text())
    missing = sorted(set(recorded) - set(composed))
    assert not missing, f"recorded presets no longer composed: {missing}"
    unrecorded = sorted(set(composed) - set(recorded))
    assert not unrecorded, f"presets without a recorded config (record them): {unrecorded}"
    differ = {
        key: diff
        for key, config in composed.items()
        if (diff := _differences(json.loads(json.dumps(config)), recorded[key]))
    }
    assert not differ, f"composed configs differ from the recorded ones: {differ}"


def test_eval_defaults_to_the_demo_held_out_items() -> None:
    """apps/eval's default data is apps/ppo's demo data (its `default` preset), so that a demo
    run's models are evaluated on the items it validated on; the library's is no task."""
    from tephra.apps.eval.config import EvalConfig
    from tephra.apps.ppo.config import app_defaults
    from tephra.controller.config.tree import DataSection

    demo = app_defaults().data
    assert EvalConfig().data == demo
    assert (demo.source, demo.task, demo.instruction) == (
        "reasoning_gym",
        "basic_arithmetic",
        "Answer with just the final number.",
    )
    assert (DataSection().source, DataSection().task, DataSection().task_config) == (None, "", {})
