"""`--help` and `--print-config` of the three apps: what they print, and that `--help` loads
neither torch nor Ray (it is answered from the shipped config index)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tephra.apps.eval.config import EvalConfig
from tephra.apps.eval.main import main as eval_main
from tephra.apps.ppo.config import PPOConfig, app_defaults
from tephra.apps.ppo.main import main as ppo_main
from tephra.apps.sft.config import SFTConfig
from tephra.apps.sft.main import main as sft_main
from tephra.core.config import load_config, to_dict

ROOT = Path(__file__).resolve().parent.parent

APPS = {
    # app -> (config class, a preset and its first sentence as written in its YAML, a section
    # field and the start of its docstring as written in the source)
    "ppo": (
        PPOConfig,
        ("smoke", "Two GRPO steps on a tiny random model"),
        ("actor.optimizer.lr: float = 3e-05", "Peak learning rate (after warmup)."),
    ),
    "sft": (
        SFTConfig,
        ("smoke", "Eight SFT steps on a tiny random model"),
        ("train.steps: int = 20", "Optimizer steps."),
    ),
    "eval": (
        EvalConfig,
        ("smoke", "A tiny random model on 8 held-out items, 4 samples each"),
        ("val.n: int = 4", "Samples per prompt (1 with temperature 0"),
    ),
}


def _run(args: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=60
    )


@pytest.mark.parametrize("app", sorted(APPS))
def test_help_lists_usage_presets_sections_and_a_sections_fields(app: str) -> None:
    cls, (preset, preset_line), (field_line, field_doc) = APPS[app]
    out = _run([f"apps/{app}", "--help"])
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert text.startswith(f"usage: uv run apps/{app} [-p PRESET ...] [key=value ...]")
    assert "--print-config" in text and "docs/config.md" in text
    presets = sorted(p.stem for p in (ROOT / "apps" / app).glob("src/tephra/apps/*/presets/*.yaml"))
    listed = text.split("presets:\n", 1)[1].split("\n\n", 1)[0].splitlines()
    assert [line.split()[0] for line in listed] == presets
    assert f"  {preset} " in text and preset_line in text.split(f"  {preset} ", 1)[1].split("\n")[0]
    sections = text.split("keys):\n", 1)[1].split("\n\n", 1)[0].splitlines()
    assert [line.split()[0] for line in sections] == [f.name for f in dataclasses.fields(cls)]

    section = field_line.split(":", 1)[0].rsplit(".", 1)[0]
    out = _run([f"apps/{app}", "--help", section])
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert field_line in lines
    assert lines[lines.index(field_line) + 1].strip().startswith(field_doc)

    out = _run([f"apps/{app}", "--help", "no_such_section"])
    assert out.returncode == 2 and out.stdout == ""
    assert "--help no_such_section: no config section of that name" in out.stderr


def test_help_imports_neither_torch_nor_ray() -> None:
    probe = (
        "import sys, json\n"
        "from tephra.apps.{app}.cli import main\n"
        "main(['--help'])\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in "
        "('torch', 'ray', 'transformers', 'tensordict', 'numpy'))\n"
        "print(json.dumps(heavy), file=sys.stderr)\n"
    )
    for app in APPS:
        out = _run(["-c", probe.format(app=app)])
        assert out.returncode == 0, out.stderr
        assert out.stdout.startswith("usage: ")
        assert json.loads(out.stderr.strip().splitlines()[-1]) == [], app


@pytest.mark.parametrize(
    ("main", "cls", "preset_dir"),
    [
        (ppo_main, PPOConfig, "ppo"),
        (sft_main, SFTConfig, "sft"),
        (eval_main, EvalConfig, "eval"),
    ],
)
def test_print_config_prints_presets_and_overrides_composed(main, cls, preset_dir, capsys) -> None:
    override = {"ppo": "trainer.steps=7", "sft": "train.steps=7", "eval": "seed=7"}[preset_dir]
    main(["-p", "smoke", override, "--print-config"])
    printed = yaml.safe_load(capsys.readouterr().out)
    presets = ROOT / "apps" / preset_dir / "src" / "tephra" / "apps" / preset_dir / "presets"
    base = app_defaults() if preset_dir == "ppo" else None  # the demo, under every ppo run
    expected = to_dict(load_config(cls, ["smoke"], [override], preset_dir=presets, base=base))
    assert printed == json.loads(json.dumps(expected))  # tuples print as lists
    key, value = override.split("=")
    node = printed
    for part in key.split("."):
        node = node[part]
    assert node == 7
