"""Another project that installs only tephra-rollout generates with `hf`, without the episodes'
dependencies.

Builds a throw-away uv project in a temporary folder outside the workspace, with
tephra-rollout and its three tephra dependencies as path dependencies
(`tephra.core.testing.run_in_throwaway_project`: synced from the shared uv cache in seconds)
and generates greedily there in a fresh interpreter; the tokens must
equal transformers' own greedy `generate` in that environment (the independent reference), and
math_verify, reasoning_gym, bm25s and mcp must not be importable.
"""

import shutil
import textwrap
from pathlib import Path

import pytest

from tephra.core.testing import run_in_throwaway_project

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
    members = ["rollout", "engine-api", "core", "kernels"]
    result = run_in_throwaway_project(
        tmp_path / "rollout-user", uv, PACKAGES, members, GENERATE_SCRIPT
    )
    assert result["absent"] == {
        "math_verify": True,
        "reasoning_gym": True,
        "bm25s": True,
        "mcp": True,
        "tephra.episodes": True,
    }
    assert result["ids"] == result["reference"]
    assert all(len(ids) > 0 for ids in result["ids"])
