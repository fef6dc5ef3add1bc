"""`auto` compute dtype: the measured choice agrees with an independent timing, and every
config that accepts `auto` resolves it to a concrete dtype."""

from __future__ import annotations

import time

import pytest
import torch

from tephra.engine_api import ConfigError
from tephra.engine_api.config import PrecisionConfig
from tephra.engine_api.fastest_dtype import BF16_MARGIN, fastest_dtype, resolve_dtype


def seconds_per_matmul(dtype: torch.dtype, size: int = 384, repeats: int = 5) -> float:
    a = torch.randn(size, size).to(dtype)
    a @ a
    start = time.perf_counter()
    for _ in range(repeats):
        a @ a
    return (time.perf_counter() - start) / repeats


def test_auto_is_the_faster_dtype_on_this_cpu():
    choice = fastest_dtype("cpu")
    assert choice in ("bfloat16", "float32") and fastest_dtype("cpu") == choice  # measured once
    ratio = seconds_per_matmul(torch.bfloat16) / seconds_per_matmul(torch.float32)
    if abs(ratio - BF16_MARGIN) < 0.3:
        pytest.skip(f"bf16/fp32 time ratio {ratio:.2f} is too close to the margin to check")
    assert choice == ("bfloat16" if ratio < BF16_MARGIN else "float32")


def test_configs_resolve_auto_and_refuse_other_names():
    auto = fastest_dtype("cpu")
    assert resolve_dtype("auto", "cpu") == auto and resolve_dtype("float16", "cpu") == "float16"
    assert PrecisionConfig(param_dtype="auto").compute_dtype("cpu") == auto
    assert PrecisionConfig(param_dtype="bfloat16").compute_dtype("cpu") == "bfloat16"
    with pytest.raises(ConfigError, match="precision.param_dtype.*auto"):
        PrecisionConfig(param_dtype="fp8")
    with pytest.raises(ConfigError, match="precision.reduce_dtype"):
        PrecisionConfig(reduce_dtype="auto")  # the reduction dtype is a numeric choice, not speed
