"""Another project that installs only tephra-engine-fsdp (no Ray, vLLM or Megatron) trains.

Builds a throw-away uv project in a temporary folder outside the workspace, with
tephra-engine-fsdp and its three tephra dependencies as path dependencies, `uv sync`s it
(from the shared uv cache: seconds) and runs a few SFT steps there in a fresh interpreter.
"""

import json
import os
import shutil
import subprocess
import textwrap
from pathlib import Path

import pytest

PACKAGES = Path(__file__).resolve().parents[2]

SFT_SCRIPT = textwrap.dedent("""
    import importlib.util, json, torch
    torch.set_num_threads(1)
    from tephra.engine_api import EngineConfig, ModelConfig, get_engine, make_batch
    model = dict(model_type="qwen2", vocab_size=128, hidden_size=32, intermediate_size=64,
                 num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1)
    engine = get_engine("fsdp", EngineConfig(model=ModelConfig(hf_config=model),
                                             optimizer={"lr": 1e-2}, device="cpu"))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 128, (4, 12), generator=g)
    resp = torch.zeros_like(ids); resp[:, 4:] = 1
    batch = make_batch(ids, torch.ones_like(ids), resp)
    def sft_loss(out, mb):
        mask = mb["response_mask"].float()
        loss = -(out["log_probs"] * mask).sum() / mb["global_token_count"][0]
        return loss, {}
    losses = []
    for _ in range(4):
        with engine.train_mode():
            losses.append(engine.forward_backward(batch, sft_loss)["loss"])
            engine.optimizer_step()
    absent = {m: importlib.util.find_spec(m) is None for m in ("ray", "vllm", "megatron")}
    print(json.dumps({"losses": losses, "absent": absent}))
""")


def test_project_depending_only_on_engine_fsdp_trains(tmp_path):
    uv = shutil.which("uv")
    if uv is None:
        pytest.skip("uv is not on PATH")
    project = tmp_path / "fsdp-user"
    project.mkdir()
    (project / "pyproject.toml").write_text(
        textwrap.dedent(f'''
        [project]
        name = "fsdp-user"
        version = "0.0.0"
        requires-python = ">=3.11"
        dependencies = ["tephra-engine-fsdp"]

        [tool.uv]
        # the workspace's torch, so the shared uv cache already holds it
        constraint-dependencies = ["torch>=2.13,<2.14"]
        environments = ["sys_platform == 'linux'"]

        [tool.uv.sources]
        tephra-engine-fsdp = {{ path = "{PACKAGES / "engine-fsdp"}" }}
        tephra-engine-api = {{ path = "{PACKAGES / "engine-api"}" }}
        tephra-core = {{ path = "{PACKAGES / "core"}" }}
        tephra-kernels = {{ path = "{PACKAGES / "kernels"}" }}
    ''')
    )
    (project / "sft.py").write_text(SFT_SCRIPT)
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
        [str(python), "sft.py"], cwd=project, env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["absent"] == {"ray": True, "vllm": True, "megatron": True}
    losses = result["losses"]
    assert losses[-1] < losses[0] - 0.1, losses
