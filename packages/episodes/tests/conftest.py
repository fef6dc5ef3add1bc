"""Fixtures of the episodes tests: one tiny model per session, the vLLM environment on demand."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tephra.rollout.testing import build_tiny_model

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """An untied tiny qwen2 (vocab 384, hidden 64, 2 layers), fp32."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-untied"))


@pytest.fixture(scope="session")
def tiny_tied_model(tmp_path_factory):
    """A tiny llama with tied input/output embeddings (the case vLLM reloads get wrong)."""
    return build_tiny_model(
        tmp_path_factory.mktemp("tiny-tied"), model_type="llama", tie_word_embeddings=True, seed=3
    )


@pytest.fixture(scope="session")
def vllm_python() -> str:
    """Python of the CPU vLLM environment; built by scripts/build_vllm_env.sh on first use
    (~7.5 minutes once, then a marker file makes it instant)."""
    if os.environ.get("TEPHRA_VLLM_PYTHON"):
        return os.environ["TEPHRA_VLLM_PYTHON"]
    result = subprocess.run(
        ["bash", str(REPO / "scripts" / "build_vllm_env.sh")],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if result.returncode != 0:
        pytest.fail(f"building the vLLM environment failed:\n{result.stderr[-3000:]}")
    return result.stdout.strip().splitlines()[-1]
