"""`auto` compute dtype: the faster of bfloat16 and float32 on a device.

A CPU with bf16 units (AMX, avx512_bf16) runs bf16 matmuls faster than fp32; one without
them (AVX2 only) emulates bf16 and runs it 3-7x slower (measured on a 2-core AVX2 EPYC).
Neither the CPU's flags nor torch say which kernel path a matmul takes, so the choice is made
by timing both, once per machine (`tephra.core.decided_once_per_machine`: a run resumed in a
new process computes in the dtype it was trained in). A CUDA device with bf16 support always
takes bf16.
"""

from __future__ import annotations

import functools
import time

import torch

from tephra.core import cpu_name, decided_once_per_machine

AUTO = "auto"
"""The dtype name that asks for the measured choice."""
BF16_MARGIN = 0.8
"""bf16 is chosen on a CPU only when it takes under this fraction of fp32's time, so that
timing noise cannot flip the choice between runs on the same machine."""


def _matmul_seconds(dtype: torch.dtype, size: int = 512, repeats: int = 3) -> float:
    a = torch.randn(size, size, dtype=dtype)
    a @ a  # warm-up: first calls pick kernels and allocate
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ a
        best = min(best, time.perf_counter() - start)
    return best


@functools.cache
def fastest_dtype(device_type: str = "cpu") -> str:
    """`bfloat16` or `float32`, whichever computes faster on `device_type` (`cpu`, `cuda`);
    measured once per machine (a few hundred milliseconds on a CPU)."""
    if device_type == "cuda":
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float32"
    key = (
        f"fastest_dtype | cpu | {cpu_name()} | torch {torch.__version__} | "
        f"{torch.get_num_threads()} threads"
    )
    return decided_once_per_machine(
        key, _time_cpu_dtypes, accept=lambda v: v in ("bfloat16", "float32")
    )


def _time_cpu_dtypes() -> str:
    bf16, fp32 = _matmul_seconds(torch.bfloat16), _matmul_seconds(torch.float32)
    return "bfloat16" if bf16 < BF16_MARGIN * fp32 else "float32"


def resolve_dtype(name: str, device_type: str = "cpu") -> str:
    """`name`, or for `auto` the measured `fastest_dtype` of the device."""
    return (
        fastest_dtype("cuda" if device_type.startswith("cuda") else "cpu") if name == AUTO else name
    )
