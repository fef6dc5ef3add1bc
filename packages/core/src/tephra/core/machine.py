"""Per-machine state: the cache folder, choices timed once per machine, published GPU peaks.

Why once per machine: a choice between two exact kernels or dtypes, timed in each process,
can flip between processes on a loaded machine (a resumed run, another rank, the next run),
and the two paths differ in summation order, so the same step gives other last bits. The
first process to time a question records the answer; every later one reads it.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import platform
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

CHOICES_FILE = "timed_choices.json"
"""The recorded answers, under `cache_root()`; delete it to time again."""
CPUINFO = Path("/proc/cpuinfo")
"""Where `cpu_fields` reads the CPU's identity (Linux)."""
MASK_FLAGS_ENV = "TEPHRA_CPU_MASK_FLAGS"
"""Environment variable: CPU flags (separated by spaces or commas) that tephra treats as
absent, to see on this machine what a lesser CPU gets (e.g. `avx512f avx512_bf16 amx_bf16`
for an AVX2 CPU). It changes what `cpu_flags`, `cpu_fields` and `cpu_name` say (so timed
choices are recorded apart), not which instructions torch runs: pair it with
`ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2` for that."""

T = TypeVar("T")


def cache_root() -> Path:
    """`$TEPHRA_CACHE` or `~/.cache/tephra`: converted models, tiny test models, timed
    choices. Ray workers inherit the variable, so every process of a run shares the folder."""
    return Path(os.environ.get("TEPHRA_CACHE", Path.home() / ".cache" / "tephra"))


def cpu_fields() -> dict[str, str]:
    """The first processor's fields in `/proc/cpuinfo` ("model name", "cpu family", "flags",
    ...), less the flags `$TEPHRA_CPU_MASK_FLAGS` hides; empty where that file is missing."""
    try:
        text = CPUINFO.read_text()
    except OSError:
        return {}
    fields: dict[str, str] = {}
    for line in text.split("\n\n", 1)[0].splitlines():  # a blank line ends a processor
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    masked = set(os.environ.get(MASK_FLAGS_ENV, "").replace(",", " ").split())
    for key in ("flags", "Features"):  # x86 / Arm
        if masked and key in fields:
            fields[key] = " ".join(f for f in fields[key].split() if f not in masked)
    return fields


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (`/proc/cpuinfo`'s `flags` on x86, `Features` on Arm) less
    those `$TEPHRA_CPU_MASK_FLAGS` hides; empty where that file is missing."""
    fields = cpu_fields()
    return frozenset((fields.get("flags") or fields.get("Features") or "").split())


def cpu_name() -> str:
    """The CPU as the timed choices' keys name it: `/proc/cpuinfo`'s model name, family and
    model, and a digest of its feature flags, or what `platform` knows where that file is
    missing. Virtual machines often report one generic model name ("AMD EPYC") for CPU
    generations that time differently; the family, model and flags tell them apart where
    several machines share a cache folder."""
    fields = cpu_fields()
    name = fields.get("model name") or platform.processor() or platform.machine()
    detail = [f"{k} {fields[k]}" for k in ("cpu family", "model") if fields.get(k)]
    flags = fields.get("flags") or fields.get("Features")  # x86 / Arm
    if flags:
        digest = hashlib.sha256(" ".join(sorted(flags.split())).encode()).hexdigest()
        detail.append(f"flags {digest[:8]}")
    return f"{name} ({', '.join(detail)})" if detail else name


def decided_once_per_machine(
    key: str, measure: Callable[[], T], accept: Callable[[Any], bool] = lambda value: True
) -> T:
    """The answer recorded under `key` in `cache_root()/CHOICES_FILE`, or `measure()`'s
    (a JSON value), recorded for the next process. One process measures at a time (a file
    lock), so processes starting together agree too. Put in `key` all that the answer depends
    on (CPU, library version, thread count); a recorded answer that `accept` refuses (a
    hand-edited file) is measured again. Without a writable cache folder, this process
    measures for itself."""
    path = cache_root() / CHOICES_FILE
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.with_name(CHOICES_FILE + ".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                choices = json.loads(path.read_text())
            except (OSError, ValueError):  # none yet, or a torn / hand-edited file
                choices = {}
            if not isinstance(choices, dict):
                choices = {}
            if key not in choices or not accept(choices[key]):
                choices[key] = measure()
                tmp = path.with_name(f"{CHOICES_FILE}.{os.getpid()}.tmp")
                tmp.write_text(json.dumps(choices, indent=1, sort_keys=True))
                os.replace(tmp, path)
            answer: T = choices[key]  # a JSON value that `accept` took
            return answer
    except OSError:
        return measure()


PUBLISHED_PEAK_FLOPS: dict[tuple[str, str], float] = {
    # dense (no 2:4 sparsity) tensor-core rates from NVIDIA's data sheets; float32 is the
    # non-tensor-core rate, what torch's default (TF32 off) matmuls get
    ("H100 PCIe", "bfloat16"): 756e12,
    ("H100 PCIe", "float16"): 756e12,
    ("H100 PCIe", "float32"): 51e12,
    ("H100", "bfloat16"): 989e12,  # SXM and the H100 80GB HBM3 name torch reports for it
    ("H100", "float16"): 989e12,
    ("H100", "float32"): 67e12,
    ("H200", "bfloat16"): 989e12,
    ("H200", "float16"): 989e12,
    ("H200", "float32"): 67e12,
    ("A100", "bfloat16"): 312e12,
    ("A100", "float16"): 312e12,
    ("A100", "float32"): 19.5e12,
}
"""FLOP/s per GPU by (name fragment, compute dtype); the longest fragment in the device's
name wins (so `H100 PCIe` before `H100`)."""


def published_peak(device_name: str, dtype: str) -> float | None:
    """The published dense peak (FLOP/s) of a GPU named `device_name` in `dtype`, if known."""
    matches = [
        (len(fragment), peak)
        for (fragment, kind), peak in PUBLISHED_PEAK_FLOPS.items()
        if kind == dtype and fragment in device_name
    ]
    return max(matches)[1] if matches else None
