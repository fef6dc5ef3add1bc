"""Registry semantics, engine lookup through entry points, the dependency boundary, and
the multi-process helper."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tephra.engine_api.errors import RegistryError
from tephra.engine_api.registry import Registry, get_engine_class, installed_engines
from tephra.engine_api.testing.distributed import all_reduce_probe, run_distributed


def test_registry_refuses_rebinding_and_lists_names_on_unknown():
    reg: Registry = Registry("estimator")

    @reg.register("grpo")
    def grpo():
        return 1

    reg.register("grpo", grpo)  # the same object again is fine
    with pytest.raises(RegistryError, match="already registered"):
        reg.register("grpo", lambda: 2)
    with pytest.raises(
        RegistryError, match=r"unknown estimator 'grp'; did you mean 'grpo'\? registered: grpo"
    ):
        reg.get("grp")
    assert reg.get("grpo") is grpo and "grpo" in reg and len(reg) == 1


def test_unknown_engine_lists_installed_ones():
    with pytest.raises(RegistryError) as info:
        get_engine_class("deepspeed")
    message = str(info.value)
    assert "unknown engine 'deepspeed'" in message
    for name in installed_engines():
        assert name in message


def test_engine_api_base_install_pulls_no_heavy_dependency():
    uv = shutil.which("uv")
    if uv is None:
        pytest.skip("uv is not on PATH")
    root = Path(__file__).resolve().parents[3]
    tree = subprocess.run(
        [uv, "tree", "--package", "tephra-engine-api", "--no-dev", "--frozen"],
        cwd=root,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "tensordict" in tree and "torch" in tree
    for heavy in ("ray", "vllm", "megatron", "transformers"):
        assert f"{heavy} v" not in tree and f"{heavy}-core v" not in tree, tree


@pytest.mark.multiproc
def test_run_distributed_returns_every_rank_and_reports_failures():
    assert run_distributed(all_reduce_probe, world_size=2) == [(3.0, 0), (3.0, 1)]
    with pytest.raises(RuntimeError, match="(?s)rank 0 of 2 failed:.*deliberate failure on rank 0"):
        run_distributed(all_reduce_probe, world_size=2, args=(0,), timeout=300)
