"""`auto` compute dtype: the measured choice agrees with an independent timing, and every
config that accepts `auto` resolves it to a concrete dtype."""

from __future__ import annotations

import importlib
import json
import time

import pytest
import torch

from tephra.core.machine import CHOICES_FILE
from tephra.engine_api import ConfigError
from tephra.engine_api.config import PrecisionConfig
from tephra.engine_api.fastest_dtype import BF16_MARGIN, fastest_dtype, resolve_dtype

# the module itself (the package exports a function of the same name)
fastest_dtype_module = importlib.import_module("tephra.engine_api.fastest_dtype")


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


def test_the_cpu_choice_is_read_from_the_machine_record(tmp_path, monkeypatch):
    """A run resumed in a new process (or another rank) computes in the recorded dtype, not in
    one timed again under other load; a hand-edited record naming no dtype is timed again.
    The timing is a stub here (under load a real one can flip) and the thread count in the key
    fixed, so only the record decides."""
    monkeypatch.setenv("TEPHRA_CACHE", str(tmp_path))
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    timings = []
    monkeypatch.setattr(
        fastest_dtype_module, "_time_cpu_dtypes", lambda: timings.append(1) or "float32"
    )
    try:
        fastest_dtype.cache_clear()
        assert fastest_dtype("cpu") == "float32" and len(timings) == 1
        (key,) = json.loads((tmp_path / CHOICES_FILE).read_text())
        for recorded, want, timed in (("bfloat16", "bfloat16", 1), ("fp8", "float32", 2)):
            (tmp_path / CHOICES_FILE).write_text(json.dumps({key: recorded}))
            fastest_dtype.cache_clear()
            assert fastest_dtype("cpu") == want and len(timings) == timed
    finally:
        fastest_dtype.cache_clear()  # later tests read the machine's own record
