"""`linear`: `x @ weight.T (+ bias)` without autograd, on the faster of torch's CPU matmul and
oneDNN's linear primitive, chosen by timing both once per machine.

Why: torch's CPU `linear` goes to MKL's sgemm, which on an AVX2 CPU ran small-row products
at half the speed of oneDNN's linear (measured on a 2-core EPYC, fp32: 32 rows x 576 ->
49152 (an lm head during decoding) 31 vs 69 GFLOPS; 170 rows 71 vs 112). Both are exact fp32
(or bf16) products; they differ only in summation order. oneDNN is reached through
`torch.ops.mkldnn._linear_pointwise`, the op torch's own compiler emits for CPU linears; where
it is missing (a build without oneDNN) or slower, torch's `linear` runs.

One choice per machine (`tephra.core.decided_once_per_machine`, keyed by CPU, torch version,
dtype and thread count): timed in each process instead, a loaded machine flipped the choice
between processes (a resumed run, another rank), and the different summation order changed the
last bits of the same training step.

Forward-only: nothing here records a graph. Use it in no-grad code (generation) and inside
`autograd.Function` bodies; `use_fast_linears` routes a module's `nn.Linear` layers through it
only while autograd is off.

Packed weights: oneDNN reorders a weight into its blocked layout on every call. A module routed
with `use_fast_linears(model, prepack=True)` keeps the reordered copy and reuses it until the
weight changes (an in-place update bumps the tensor's version; the copy is redone on the next
call). Decoding's products ran 1.3x faster that way on a 2-core EPYC (Zen 1, fp32: 30 layers of
SmolLM2-135M at 32 rows, 142 -> 110 ms per token). Like the choice of oneDNN it is timed once
per machine, and costs one more copy of the linear weights in memory.
"""

from __future__ import annotations

import functools
import time
import types
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from tephra.core import cpu_name, decided_once_per_machine

ONEDNN_MARGIN = 0.9
"""oneDNN (and its packed weights) is chosen only when it takes under this fraction of the
other path's time, so that timing noise cannot flip the choice on a machine where the two are
level."""

PACK_ROWS_HINT = 64
"""Rows oneDNN is told to expect when it lays out a packed weight: decoding's tens of rows
(a hint of 1 picks the unpacked layout's speed; 32 and 256 ran alike)."""


def _onednn_op() -> Any:  # the op, or None where this build has none
    ops = getattr(torch.ops, "mkldnn", None)
    if not torch.backends.mkldnn.is_available() or ops is None:
        return None
    try:
        return ops._linear_pointwise
    except (AttributeError, RuntimeError):  # not registered in this build
        return None


def _onednn_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    flat = x.reshape(-1, x.shape[-1])
    if not flat.is_contiguous():
        flat = flat.contiguous()
    out: torch.Tensor = _onednn_op()(flat, weight, bias, "none", [], "")
    return out.reshape(*x.shape[:-1], weight.shape[0])


def _pack(weight: torch.Tensor) -> torch.Tensor | None:
    """`weight` in oneDNN's blocked layout for `_onednn_linear`; None where this build or CPU
    cannot pack this dtype (bf16 packing needs AVX-512 or AVX-NE-CONVERT)."""
    try:
        packed: torch.Tensor = torch.ops.mkldnn._reorder_linear_weight(
            weight.detach(), PACK_ROWS_HINT
        )
        return packed
    except (AttributeError, RuntimeError):
        return None


def _seconds(fn: Callable[[], object], repeats: int = 3) -> float:
    fn()  # warm-up: the first call picks kernels and allocates
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _decided_per_machine(question: str, dtype: torch.dtype, measure: Callable[[], bool]) -> bool:
    threads = torch.get_num_threads()
    key = f"cpu_linear.{question} | {dtype} | {cpu_name()} | torch {torch.__version__} | {threads} threads"
    return decided_once_per_machine(key, measure, accept=lambda v: isinstance(v, bool))


@functools.cache
def onednn_is_faster(dtype: torch.dtype = torch.float32) -> bool:
    """Whether oneDNN's linear beats torch's on this CPU for `dtype`: timed once per machine
    (see the module docstring) on a decoding-shaped product (32 rows x 512 -> 8192; some tens
    of milliseconds), and checked to give the same numbers."""
    if _onednn_op() is None or dtype not in (torch.float32, torch.bfloat16):
        return False
    return _decided_per_machine("onednn_is_faster", dtype, lambda: _time_onednn(dtype))


def _time_onednn(dtype: torch.dtype) -> bool:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(32, 512, generator=gen).to(dtype)
    w = torch.randn(8192, 512, generator=gen).to(dtype)
    try:
        fast = _onednn_linear(x, w, None)
    except RuntimeError:  # the op exists but refuses this dtype / build
        return False
    tol = 1e-3 if dtype == torch.float32 else 0.5
    if not torch.allclose(fast.float(), F.linear(x, w).float(), atol=tol, rtol=1e-2):
        return False
    with torch.no_grad():
        return _seconds(lambda: _onednn_linear(x, w, None)) < ONEDNN_MARGIN * _seconds(
            lambda: F.linear(x, w)
        )


@functools.cache
def packing_is_faster(dtype: torch.dtype = torch.float32) -> bool:
    """Whether oneDNN runs a packed weight faster than an unpacked one on this CPU for
    `dtype` (and oneDNN is chosen at all): timed once per machine on decoding-shaped products
    whose weights do not fit in cache (8 weights of 512 -> 2048 at 32 rows), and checked to
    give the same numbers."""
    if not onednn_is_faster(dtype):
        return False
    return _decided_per_machine("packing_is_faster", dtype, lambda: _time_packing(dtype))


def _time_packing(dtype: torch.dtype) -> bool:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(32, 512, generator=gen).to(dtype)
    weights = [torch.randn(2048, 512, generator=gen).to(dtype) for _ in range(8)]
    packed = [p for w in weights if (p := _pack(w)) is not None]
    if len(packed) < len(weights):
        return False
    if not torch.allclose(
        _onednn_linear(x, packed[0], None).float(),
        F.linear(x, weights[0]).float(),
        atol=1e-3,
        rtol=1e-2,
    ):
        return False
    with torch.no_grad():
        return _seconds(
            lambda: [_onednn_linear(x, p, None) for p in packed]
        ) < ONEDNN_MARGIN * _seconds(lambda: [_onednn_linear(x, w, None) for w in weights])


def _onednn_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (
        x.device.type == "cpu"
        and weight.device.type == "cpu"
        and x.dtype == weight.dtype
        and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
        and onednn_is_faster(x.dtype)
    )


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` on the faster CPU path (see the module docstring); other
    devices and dtypes, and calls that need a graph, take `F.linear`."""
    if _onednn_applies(x, weight):
        return _onednn_linear(x, weight, bias)
    return F.linear(x, weight, bias)


def _fast_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return linear(x, self.weight, self.bias)


def _packed_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    weight = self.weight
    if _onednn_applies(x, weight) and packing_is_faster(x.dtype):
        # the copy is valid while the weight is the same tensor at the same version
        key = (weight.data_ptr(), weight._version, weight.dtype)
        cache = vars(self)  # `_tephra_packed` is a plain attribute (use_fast_linears)
        if cache["_tephra_packed"][0] != key:
            cache["_tephra_packed"] = (key, _pack(weight))
        packed = cache["_tephra_packed"][1]
        if packed is not None:
            return _onednn_linear(x, packed, self.bias)
    return linear(x, weight, self.bias)


def use_fast_linears(model: torch.nn.Module, prepack: bool = False) -> int:
    """Route every `nn.Linear` of `model` through `linear` (their own parameters, so in-place
    weight updates still apply); returns how many. A call that needs a graph still takes
    `F.linear`, so training through the model is unchanged. `prepack`: keep each weight's
    packed copy where that is faster (see the module docstring)."""
    count = 0
    for module in model.modules():
        if type(module) is torch.nn.Linear:  # subclasses (LoRA, quantised) keep their forward
            vars(module)["_tephra_packed"] = (None, None)  # a plain attribute, not a buffer
            # this instance's forward, on purpose (mypy refuses assigning to a method)
            forward = _packed_forward if prepack else _fast_forward
            module.forward = types.MethodType(forward, module)  # type: ignore[method-assign]
            count += 1
    return count
