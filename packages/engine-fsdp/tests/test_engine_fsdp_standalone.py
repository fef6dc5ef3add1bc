"""Another project that installs only tephra-engine-fsdp (no Ray, vLLM or Megatron) trains.

Builds a throw-away uv project in a temporary folder outside the workspace, with
tephra-engine-fsdp and its three tephra dependencies as path dependencies, `uv sync`s it
(from the shared uv cache: seconds) and runs a few SFT steps there in a fresh interpreter.
"""

import shutil
import textwrap
from pathlib import Path

import pytest

from tephra.core.testing import run_in_throwaway_project

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
    members = ["engine-fsdp", "engine-api", "core", "kernels"]
    result = run_in_throwaway_project(tmp_path / "fsdp-user", uv, PACKAGES, members, SFT_SCRIPT)
    assert result["absent"] == {"ray": True, "vllm": True, "megatron": True}
    losses = result["losses"]
    assert losses[-1] < losses[0] - 0.1, losses
