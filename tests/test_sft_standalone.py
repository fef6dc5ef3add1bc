"""apps/sft installs and runs on its own: its wheel and the wheels of the tephra packages it
needs, built with `uv build`, installed into a throw-away virtual environment outside the
workspace (no apps/ppo, no megatron), and `tephra-sft -p smoke` trains there."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NEEDED = [
    "tephra-core",
    "tephra-engine-api",
    "tephra-kernels",
    "tephra-engine-fsdp",
    "tephra-rollout",
    "tephra-episodes",
    "tephra-algos",
    "tephra-controller",
    "tephra-app-sft",
]


@pytest.mark.multiproc
def test_sft_wheel_installs_and_trains_in_a_fresh_venv(tmp_path):
    uv = shutil.which("uv")
    if uv is None:
        pytest.skip("uv is not on PATH")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "UV_PROJECT"))}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TEPHRA_CACHE=str(tmp_path / "cache"))
    dist = tmp_path / "dist"
    for package in NEEDED:
        built = subprocess.run(
            [uv, "build", "--wheel", "--package", package, "-o", str(dist)],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert built.returncode == 0, built.stderr
    venv = tmp_path / "venv"
    subprocess.run(
        [uv, "venv", "--python", "3.11", str(venv)],
        env=env,
        check=True,
        capture_output=True,
        timeout=120,
    )
    # the workspace's torch, so the shared uv cache already holds it
    constraints = tmp_path / "constraints.txt"
    constraints.write_text("torch>=2.13,<2.14\n")
    install = [
        uv,
        "pip",
        "install",
        "--python",
        str(venv / "bin" / "python"),
        "-c",
        str(constraints),
        *map(str, sorted(dist.glob("*.whl"))),
    ]
    done = subprocess.run(install, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:  # no registry reachable: the shared uv cache has everything
        done = subprocess.run(
            [*install, "--offline"], env=env, capture_output=True, text=True, timeout=900
        )
    assert done.returncode == 0, done.stderr
    run = subprocess.run(
        [
            str(venv / "bin" / "tephra-sft"),
            "-p",
            "smoke",
            "train.steps=2",
            "train.export_hf=false",
            f"train.run_dir={tmp_path / 'run'}",
            "resources.num_cpus=1",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    summary = json.loads(run.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 2 and summary["loss_after"] < summary["loss_before"]
    # nothing the SFT app does not need came along: no RL app, no megatron, no vLLM
    probe = subprocess.run(
        [
            str(venv / "bin" / "python"),
            "-c",
            "import importlib.util as u; print([m for m in "
            "('tephra.apps.ppo', 'megatron', 'vllm') if u.find_spec(m)])",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert probe.stdout.strip() == "[]", probe.stdout + probe.stderr
