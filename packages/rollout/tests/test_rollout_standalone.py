"""Another project that installs only tephra-rollout generates with `hf`, without the episodes'
dependencies.

Builds a throw-away uv project in a temporary folder outside the workspace, with
tephra-rollout and its three tephra dependencies as path dependencies, `uv sync`s it (from the
shared uv cache: seconds) and generates greedily there in a fresh interpreter; the tokens must
equal transformers' own greedy `generate` in that environment (the independent reference), and
math_verify, reasoning_gym, bm25s and mcp must not be importable.
"""

import json
import os
import shutil
import subprocess
import textwrap
from pathlib import Path

import pytest

PACKAGES = Path(__file__).resolve().parents[2]

GENERATE_SCRIPT = textwrap.dedent("""
    import importlib.util, json, sys, tempfile, torch
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM
    from tephra.rollout import RolloutConfig, SamplingParams, get_rollout
    from tephra.rollout.testing import build_tiny_model, reference_greedy
    tiny = build_tiny_model(tempfile.mkdtemp(prefix="tiny-"))
    prompts = [[5, 6, 7], [10, 20, 30, 40]]
    with get_rollout("hf", RolloutConfig(model_path=tiny.path, max_model_len=64)) as rollout:
        out = rollout.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8))
    model = AutoModelForCausalLM.from_pretrained(tiny.path, dtype=torch.float32)
    reference = [reference_greedy(model, p, 8, tiny.eos_token_id) for p in prompts]
    absent = {m: importlib.util.find_spec(m) is None
              for m in ("math_verify", "reasoning_gym", "bm25s", "mcp", "tephra.episodes")}
    print(json.dumps({"ids": out.response_ids, "reference": reference, "absent": absent}))
""")


def test_project_depending_only_on_rollout_generates_with_hf(tmp_path):
    uv = shutil.which("uv")
    if uv is None:
        pytest.skip("uv is not on PATH")
    project = tmp_path / "rollout-user"
    project.mkdir()
    (project / "pyproject.toml").write_text(
        textwrap.dedent(f'''
        [project]
        name = "rollout-user"
        version = "0.0.0"
        requires-python = ">=3.11"
        dependencies = ["tephra-rollout"]

        [tool.uv]
        # the workspace's torch, so the shared uv cache already holds it
        constraint-dependencies = ["torch>=2.13,<2.14"]
        environments = ["sys_platform == 'linux'"]

        [tool.uv.sources]
        tephra-rollout = {{ path = "{PACKAGES / "rollout"}" }}
        tephra-engine-api = {{ path = "{PACKAGES / "engine-api"}" }}
        tephra-core = {{ path = "{PACKAGES / "core"}" }}
        tephra-kernels = {{ path = "{PACKAGES / "kernels"}" }}
    ''')
    )
    (project / "generate.py").write_text(GENERATE_SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "UV_PROJECT"))}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    sync = subprocess.run(
        [uv, "sync", "--python", "3.11"],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if sync.returncode != 0:  # no registry reachable: the shared uv cache has everything
        sync = subprocess.run(
            [uv, "sync", "--offline", "--python", "3.11"],
            cwd=project,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
    assert sync.returncode == 0, sync.stderr
    python = project / ".venv" / "bin" / "python"
    run = subprocess.run(
        [str(python), "generate.py"],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["absent"] == {
        "math_verify": True,
        "reasoning_gym": True,
        "bm25s": True,
        "mcp": True,
        "tephra.episodes": True,
    }
    assert result["ids"] == result["reference"]
    assert all(len(ids) > 0 for ids in result["ids"])
