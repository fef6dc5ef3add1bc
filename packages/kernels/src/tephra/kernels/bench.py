"""Benchmark: naive vs chunked (and Triton and Liger on CUDA), forward + backward, memory, time.

    python -m tephra.kernels.bench [--quick] [--json PATH] [--threads 1] [--device cpu|cuda]

Each (shape, dtype, method) runs in a fresh subprocess so that peak memory is its own:
on CPU, peak RSS (VmHWM, or ru_maxrss without /proc) minus the RSS once the inputs (hidden,
weight, labels, output gradients) are allocated, built without large temporaries so that the
process's peak before the method is the RSS at that point; on CUDA,
torch.cuda.max_memory_allocated minus the memory allocated after the inputs, after one warm-up
call (Triton compiles on first use); seconds are the best of REPEATS timed calls there. The
naive run saves its outputs and gradients; every other method is compared with them (max abs
error). Only torch and tephra.kernels are needed, and liger-kernel for the "liger" rows.

On CUDA each bf16 shape also runs "logp-only": the log-prob term alone (no entropy), the
work that Liger's fused linear cross-entropy does. Liger's loss is -log p per token
(reduction="none", its backward given -dL/dlogp per token) on hidden / T, since it has no
temperature; naive and triton run the same term with compute_entropy=False, so those rows
compare like with like. TFLOP/s counts the head's three products (6 x tokens x hidden x vocab)
for every method, whatever it recomputes, against the device's published dense peak.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from tephra.core.machine import published_peak
from tephra.kernels import linear_logprob_entropy
from tephra.kernels.logprob_entropy import METHODS, triton_available

# Shapes are (tokens, hidden, vocab, dtype). The first is the acceptance shape (a Qwen-sized
# 152k vocabulary); the bf16 one is the dtype RL training actually runs the lm head in.
FULL_SHAPES = [
    (2048, 512, 151936, "float32"),
    (1024, 512, 151936, "bfloat16"),
    (2048, 512, 32000, "float32"),
]
CUDA_SHAPES = [*FULL_SHAPES, (8192, 2048, 151936, "bfloat16")]
"""On a GPU: the shapes above and a large bf16 head (a 2048-wide model, 8k tokens)."""
QUICK_SHAPES = [(256, 64, 4096, "float32"), (128, 64, 4096, "bfloat16")]
REPEATS = 3
"""Timed calls per CUDA record after the warm-up (the best is kept)."""
TEMPERATURE = 0.7
IGNORED_FRACTION = 0.1


@dataclass
class Record:
    """One benchmark row; errors are max |method - naive| over all elements."""

    shape: list[int]
    dtype: str
    method: str
    device: str
    peak_memory_bytes_above_inputs: int
    seconds: float
    max_abs_err_logprob: float
    max_abs_err_entropy: float
    max_abs_err_grad_hidden: float
    max_abs_err_grad_weight: float
    chunk_size: int | None = None
    logp_only: bool = False
    """The log-prob term alone (no entropy), as Liger computes it."""
    tflops: float = 0.0
    """6 x tokens x hidden x vocab / seconds / 1e12: the head's three products."""
    fraction_of_peak: float | None = None
    """tflops over the device's published dense peak in this dtype (None: not known)."""


def _make_inputs(
    tokens: int, hidden_size: int, vocab: int, dtype: str, device: torch.device, seed: int = 0
) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    dt = getattr(torch, dtype)

    def randn(rows: int, cols: int, scale: float) -> torch.Tensor:
        # filled block by block in the target dtype: a whole fp32 temporary would raise the
        # process's peak RSS before the baseline and hide that much of a method's peak
        out = torch.empty(rows, cols, dtype=dt)
        for start in range(0, rows, 4096):
            block = torch.randn(min(4096, rows - start), cols, generator=gen)
            out[start : start + block.shape[0]] = block.mul_(scale)
        return out.to(device).requires_grad_()

    hidden = randn(tokens, hidden_size, 1.0)
    # scaled so logits spread over a few units, like a trained lm head
    weight = randn(vocab, hidden_size, 2.0 / hidden_size**0.5)
    labels = torch.randint(0, vocab, (tokens,), generator=gen)
    labels[torch.rand(tokens, generator=gen) < IGNORED_FRACTION] = -100
    g_lp = torch.randn(tokens, generator=gen)
    g_ent = torch.randn(tokens, generator=gen)
    return hidden, weight, labels.to(device), g_lp.to(device), g_ent.to(device)


def _rss_now_bytes() -> int:
    """Resident set size now (Linux /proc); the peak so far where /proc is missing."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return _rss_peak_bytes()


def _rss_peak_bytes() -> int:
    # Linux: VmHWM is this address space's own high-water mark. ru_maxrss is not: exec keeps
    # the parent's peak (a worker started from a large pytest process would report it).
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    # ru_maxrss is KiB on Linux, bytes on macOS
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def run_one(spec: dict[str, Any]) -> dict[str, Any]:  # noqa: PLR0915 (older than the limit; to split)
    """Run one method once in this process (meant to be a fresh subprocess); return a Record."""

    torch.set_num_threads(spec["threads"])
    device = torch.device(spec["device"])
    tokens, hidden_size, vocab = spec["shape"]
    hidden, weight, labels, g_lp, g_ent = _make_inputs(
        tokens, hidden_size, vocab, spec["dtype"], device
    )
    method, chunk_size = spec["method"], spec.get("chunk_size")
    logp_only = bool(spec.get("logp_only"))
    # chunked's memory floor: it would keep log-probs this small from forward to backward
    keep: dict[str, Any] = {"keep_logits_bytes": 0} if method == "chunked" else {}

    def step() -> tuple[torch.Tensor, torch.Tensor]:
        if method == "liger":
            lp = -_liger_loss(hidden, weight, labels)
            lp.backward(g_lp)
            return lp.detach(), torch.zeros_like(lp)
        lp, ent, *_ = linear_logprob_entropy(
            hidden,
            weight,
            labels,
            TEMPERATURE,
            method=method,
            chunk_size=chunk_size,
            compute_entropy=not logp_only,
            **keep,
        )
        if logp_only:
            lp.backward(g_lp)
            return lp.detach(), torch.zeros_like(lp)
        assert ent is not None  # compute_entropy=True
        torch.autograd.backward([lp, ent], [g_lp, g_ent])
        return lp.detach(), ent.detach()

    # Warm-up on a tiny problem of the same method: the first autograd/matmul call loads
    # libraries and allocates pools (tens of MiB) that belong to no method. On CUDA the
    # warm-up is the real shape, so Triton compiles and cuBLAS picks kernels beforehand.
    if device.type == "cuda":
        step()
        hidden.grad = weight.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        seconds = float("inf")
        for _ in range(REPEATS):
            hidden.grad = weight.grad = None
            torch.cuda.synchronize()
            start = time.perf_counter()
            lp, ent = step()
            torch.cuda.synchronize()
            seconds = min(seconds, time.perf_counter() - start)
    else:
        tiny = _make_inputs(8, hidden_size, 64, spec["dtype"], device, seed=1)
        th, tw, ty, tg_lp, tg_ent = tiny
        t_lp, t_ent, *_ = linear_logprob_entropy(
            th, tw, ty, TEMPERATURE, method=method, chunk_size=chunk_size, **keep
        )
        assert t_ent is not None  # compute_entropy=True
        torch.autograd.backward([t_lp, t_ent], [tg_lp, tg_ent])
        del tiny, th, tw, ty, tg_lp, tg_ent, t_lp, t_ent
        base = _rss_now_bytes()
        start = time.perf_counter()
        lp, ent = step()
        seconds = time.perf_counter() - start
    peak = (
        torch.cuda.max_memory_allocated() if device.type == "cuda" else _rss_peak_bytes()
    ) - base

    assert hidden.grad is not None and weight.grad is not None  # step() ran the backward
    outputs = {
        "logprob": lp.float().cpu(),
        "entropy": ent.float().cpu(),
        "grad_hidden": hidden.grad.float().cpu(),
        "grad_weight": weight.grad.float().cpu(),
    }
    if spec.get("save_reference"):
        torch.save(outputs, spec["reference_path"])
        errors = dict.fromkeys(outputs, 0.0)
    else:
        ref = torch.load(spec["reference_path"])
        errors = {k: (outputs[k] - ref[k]).abs().max().item() for k in outputs}
    tflops = 6 * tokens * hidden_size * vocab / seconds / 1e12
    peak_flops = (
        published_peak(torch.cuda.get_device_name(device), spec["dtype"])
        if device.type == "cuda"
        else None
    )
    return asdict(
        Record(
            logp_only=logp_only,
            tflops=tflops,
            fraction_of_peak=tflops * 1e12 / peak_flops if peak_flops else None,
            shape=[tokens, hidden_size, vocab],
            dtype=spec["dtype"],
            method=method,
            device=device.type,
            peak_memory_bytes_above_inputs=int(peak),
            seconds=seconds,
            max_abs_err_logprob=errors["logprob"],
            max_abs_err_entropy=errors["entropy"],
            max_abs_err_grad_hidden=errors["grad_hidden"],
            max_abs_err_grad_weight=errors["grad_weight"],
            chunk_size=chunk_size,
        )
    )


def _liger_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Liger's fused linear cross-entropy per token (-log p at temperature TEMPERATURE)."""
    from liger_kernel.ops.fused_linear_cross_entropy import (  # optional: carried as a wheel
        LigerFusedLinearCrossEntropyFunction,
    )

    out = LigerFusedLinearCrossEntropyFunction.apply(
        hidden / TEMPERATURE, weight, labels, None, None, -100, 0.0, 0.0, "none"
    )
    loss: torch.Tensor = out[0] if isinstance(out, tuple) else out
    return loss


def run_in_subprocess(spec: dict[str, Any], timeout: float | None = None) -> dict[str, Any]:
    """Run `run_one(spec)` in a fresh Python process, so its peak memory is its own."""
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = str(spec["threads"])
    env["MKL_NUM_THREADS"] = str(spec["threads"])
    proc = subprocess.run(
        [sys.executable, "-m", "tephra.kernels.bench", "--worker", json.dumps(spec)],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"benchmark worker failed for {spec}:\n{proc.stderr[-4000:]}")
    record: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return record


def run_shape(
    shape: tuple[int, int, int],
    dtype: str,
    methods: list[str],
    device: str,
    threads: int,
    chunk_size: int | None = None,
    workdir: str | None = None,
    logp_only: bool = False,
) -> list[dict[str, Any]]:
    """Naive first (it writes the reference), then every other method, each in a subprocess."""
    records = []
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        ref = os.path.join(tmp, "reference.pt")
        for method in ["naive", *[m for m in methods if m != "naive"]]:
            spec = {
                "logp_only": logp_only,
                "shape": list(shape),
                "dtype": dtype,
                "method": method,
                "device": device,
                "threads": threads,
                "reference_path": ref,
                "save_reference": method == "naive",
                "chunk_size": None if method == "naive" else chunk_size,
            }
            records.append(run_in_subprocess(spec))
    return records


def format_table(records: list[dict[str, Any]]) -> str:
    """A markdown table; 'vs naive' is peak memory above inputs relative to naive's."""
    naive = {
        (tuple(r["shape"]), r["dtype"], r.get("logp_only")): r["peak_memory_bytes_above_inputs"]
        for r in records
        if r["method"] == "naive"
    }
    lines = [
        "| tokens x hidden x vocab | dtype | method | peak above inputs | vs naive | fwd+bwd s "
        "| TFLOP/s | err logp | err entropy | err grad h | err grad W |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        base = naive.get((tuple(r["shape"]), r["dtype"], r.get("logp_only")))
        ratio = f"{r['peak_memory_bytes_above_inputs'] / base:.1%}" if base else "-"
        method = r["method"] + (" (logp only)" if r.get("logp_only") else "")
        peak = f" ({r['fraction_of_peak']:.0%})" if r.get("fraction_of_peak") else ""
        lines.append(
            f"| {' x '.join(map(str, r['shape']))} | {r['dtype']} | {method} "
            f"| {r['peak_memory_bytes_above_inputs'] / 2**20:.0f} MiB | {ratio} "
            f"| {r['seconds'] * 1e3:.1f} ms | {r.get('tflops', 0):.1f}{peak} "
            f"| {r['max_abs_err_logprob']:.1e} | {r['max_abs_err_entropy']:.1e} "
            f"| {r['max_abs_err_grad_hidden']:.1e} | {r['max_abs_err_grad_weight']:.1e} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(
        prog="python -m tephra.kernels.bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--quick", action="store_true", help="small shapes (seconds, for a smoke run)"
    )
    parser.add_argument("--json", metavar="PATH", help="write the records as a JSON list to PATH")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per run (default 1)")
    parser.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when available")
    parser.add_argument(
        "--methods",
        default=None,
        help="comma-separated; default naive,chunked (+triton on CUDA with triton, +liger in "
        "the logp-only rows where liger-kernel imports)",
    )
    parser.add_argument(
        "--chunk-size", type=int, default=None, help="tokens per chunk (default auto)"
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.worker:
        print(json.dumps(run_one(json.loads(args.worker))))
        return []

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.methods:
        methods = args.methods.split(",")
        unknown = [m for m in methods if m not in METHODS and m != "liger"]
        if unknown:
            parser.error(f"--methods: unknown {unknown}; choose from {sorted(METHODS)}")
    else:
        methods = ["naive", "chunked"] + (
            ["triton"] if device == "cuda" and triton_available() else []
        )
    liger = importlib.util.find_spec("liger_kernel") is not None
    shapes = QUICK_SHAPES if args.quick else CUDA_SHAPES if device == "cuda" else FULL_SHAPES
    runs = []
    for tokens, hidden_size, vocab, dtype in shapes:
        full_methods = [m for m in methods if m != "liger"]
        runs.append(((tokens, hidden_size, vocab), dtype, full_methods, False))
        if device == "cuda" and dtype == "bfloat16" and not args.quick:
            logp_methods = [m for m in ["naive", "triton"] if m in methods]
            logp_methods += ["liger"] if liger and (not args.methods or "liger" in methods) else []
            runs.append(((tokens, hidden_size, vocab), dtype, logp_methods, True))
    records = []
    for shape, dtype, run_methods, logp_only in runs:
        for record in run_shape(
            shape, dtype, run_methods, device, args.threads, args.chunk_size, logp_only=logp_only
        ):
            records.append(record)
            print(
                f"{record['shape']} {record['dtype']} {record['method']}: "
                f"{record['peak_memory_bytes_above_inputs'] / 2**20:.0f} MiB, "
                f"{record['seconds']:.2f} s",
                file=sys.stderr,
                flush=True,
            )
    print(format_table(records))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(records, f, indent=2)
    return records


if __name__ == "__main__":
    main()
