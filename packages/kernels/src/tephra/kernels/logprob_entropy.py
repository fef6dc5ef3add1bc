"""`linear_logprob_entropy`: the public entry point, its input checks and method choice.

Methods, chosen by name:
    naive    full logits (the reference; [tokens, vocab] memory)
    chunked  torch, token chunks, logits recomputed in backward (any device)
    triton   cuBLAS products per vocab block with Triton fusing the online log-sum-exp and the
             logits gradient (CUDA, or CPU under TRITON_INTERPRET=1)
    auto     on CUDA, triton where it beat chunked on this device and dtype (timed once per
             machine, `triton_is_faster`); chunked otherwise
The environment variable TEPHRA_KERNEL_METHOD replaces "auto" (an explicit method wins).
"""

from __future__ import annotations

import functools
import importlib.util
import math
import os
import time
from collections.abc import Callable
from typing import Any

import torch

from tephra.core import decided_once_per_machine
from tephra.core.registry import Registry
from tephra.kernels.chunked import chunked_logprob_entropy
from tephra.kernels.errors import KernelInputError
from tephra.kernels.head_transform import HeadTransform, check_head
from tephra.kernels.reference import LogprobEntropy, naive_logprob_entropy

METHOD_ENV_VAR = "TEPHRA_KERNEL_METHOD"


def _triton_logprob_entropy(*args: Any, **kwargs: Any) -> LogprobEntropy:
    # Imported on first use: triton decides at kernel definition time whether it runs
    # compiled or interpreted (TRITON_INTERPRET), and it is an optional dependency.
    from tephra.kernels.triton_kernels import triton_logprob_entropy

    return triton_logprob_entropy(*args, **kwargs)


def _naive(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: float,
    ignore_index: int,
    *,
    chunk_size: int | None,
    head: HeadTransform | None = None,
    **flags: bool,
) -> LogprobEntropy:
    del chunk_size  # the reference has no chunks
    return naive_logprob_entropy(
        hidden, weight, labels, temperature, ignore_index, head=head, **flags
    )


METHODS: Registry[Callable[..., LogprobEntropy]] = Registry("kernel method")
METHODS.register("naive", _naive)
METHODS.register("chunked", chunked_logprob_entropy)
METHODS.register("triton", _triton_logprob_entropy)


def triton_available() -> bool:
    """True when the optional `triton` package can be imported."""
    return importlib.util.find_spec("triton") is not None


def _cuda_seconds(fn: Callable[[], object], repeats: int = 3) -> float:
    fn()  # warm-up: Triton compiles, cuBLAS picks its kernels
    best = float("inf")
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def _time_triton_vs_chunked(device: torch.device, dtype: torch.dtype) -> bool:
    gen = torch.Generator(device=device).manual_seed(0)
    tokens, hidden, vocab = 2048, 1024, 65536  # a head large enough to be bandwidth bound
    h = torch.randn(tokens, hidden, device=device, generator=gen).to(dtype).requires_grad_()
    w = (torch.randn(vocab, hidden, device=device, generator=gen) * 0.03).to(dtype)
    w.requires_grad_()
    y = torch.randint(0, vocab, (tokens,), device=device, generator=gen)

    def step(name: str) -> Callable[[], object]:
        def run() -> object:
            lp, ent, *_ = METHODS.get(name)(
                h, w, y, 1.0, -100, compute_entropy=True, chunk_size=None
            )
            assert ent is not None  # compute_entropy=True
            return torch.autograd.grad((lp + ent).sum(), [h, w])

        return run

    return _cuda_seconds(step("triton")) < _cuda_seconds(step("chunked"))


@functools.cache
def triton_is_faster(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the Triton method beat chunked (forward and backward of a 2048 x 1024 x 65536
    head) on this CUDA device in `dtype`: timed once per machine and recorded, keyed by the
    device's name and the torch and triton versions (`tephra.core.decided_once_per_machine`)."""
    if device.type != "cuda" or not triton_available():
        return False
    import triton  # optional dependency; only its version is read here

    key = (
        f"kernels.triton_is_faster | {dtype} | {torch.cuda.get_device_name(device)} "
        f"| torch {torch.__version__} | triton {triton.__version__}"
    )
    return decided_once_per_machine(
        key, lambda: _time_triton_vs_chunked(device, dtype), accept=lambda v: isinstance(v, bool)
    )


def resolve_method(method: str, device: torch.device, dtype: torch.dtype | None = None) -> str:
    """The concrete method name for `method` ("auto" or a name of METHODS) on `device`;
    `dtype` (the inputs') lets "auto" use the timed choice on CUDA."""
    source = "method"
    if method == "auto" and os.environ.get(METHOD_ENV_VAR):
        method, source = os.environ[METHOD_ENV_VAR], f"environment variable {METHOD_ENV_VAR}"
    if method == "auto":
        if device.type == "cuda" and dtype is not None and triton_is_faster(device, dtype):
            return "triton"
        return "chunked"
    if method not in METHODS:
        raise KernelInputError(
            f"{source}={method!r} is not a kernel method; choose one of "
            f"{['auto', *sorted(METHODS)]}"
        )
    if method == "triton":
        if not triton_available():
            raise KernelInputError(
                f"{source}='triton' but triton is not installed; install the extra "
                f"(pip install 'tephra-kernels[triton]') or use method='chunked'"
            )
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise KernelInputError(
                f"{source}='triton' needs CUDA tensors (got device {device}) or "
                f"TRITON_INTERPRET=1 set before triton is imported; use method='chunked' on CPU"
            )
    return method


def check_inputs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: float,
    chunk_size: int | None,
    *,
    weight_name: str = "weight",
) -> None:
    """Raise KernelInputError naming the argument when shapes, dtypes or values disagree."""
    if not isinstance(hidden, torch.Tensor) or hidden.dim() < 1:
        raise KernelInputError("hidden must be a tensor [..., hidden_size] (e.g. [tokens, hidden])")
    if not hidden.is_floating_point():
        raise KernelInputError(f"hidden has dtype {hidden.dtype}; expected a floating dtype")
    if weight.dim() != 2:
        raise KernelInputError(
            f"{weight_name} has shape {tuple(weight.shape)}; expected [vocab, hidden_size] "
            f"(the lm_head weight, not its transpose)"
        )
    if weight.shape[1] != hidden.shape[-1]:
        raise KernelInputError(
            f"{weight_name} has hidden size {weight.shape[1]} but hidden has {hidden.shape[-1]}; "
            f"{weight_name} must be [vocab, {hidden.shape[-1]}]"
        )
    if weight.dtype != hidden.dtype:
        raise KernelInputError(
            f"{weight_name} dtype {weight.dtype} differs from hidden dtype {hidden.dtype}; "
            f"cast one of them so both match"
        )
    if labels.shape != hidden.shape[:-1]:
        raise KernelInputError(
            f"labels has shape {tuple(labels.shape)}; expected {tuple(hidden.shape[:-1])} "
            f"(hidden's shape without the last dimension)"
        )
    if labels.dtype not in (torch.int64, torch.int32):
        raise KernelInputError(f"labels has dtype {labels.dtype}; expected torch.int64 token ids")
    if not (hidden.device == weight.device == labels.device):
        raise KernelInputError(
            f"hidden ({hidden.device}), {weight_name} ({weight.device}) and labels "
            f"({labels.device}) must be on one device"
        )
    if not (
        isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0
    ):
        raise KernelInputError(f"temperature={temperature!r}; expected a finite number > 0")
    if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
        raise KernelInputError(f"chunk_size={chunk_size!r}; expected a positive int or None (auto)")


def linear_logprob_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    ignore_index: int = -100,
    *,
    compute_entropy: bool = True,
    method: str = "auto",
    chunk_size: int | None = None,
    keep_logits_bytes: int | None = None,
    compute_sum_pi_squared: bool = False,
    head: HeadTransform | None = None,
) -> LogprobEntropy:
    """Log-prob of each label and entropy of softmax((hidden @ weight.T) / temperature).

    hidden [..., hidden_size] (fp32 or bf16), weight [vocab, hidden_size] (same dtype),
    labels [...] int64 -> (log_probs [...] fp32, entropy [...] fp32, or None when
    compute_entropy=False). With z = (hidden @ weight.T) / temperature:
        log_probs = z[label] - logsumexp(z)                  0 where label == ignore_index
        entropy   = logsumexp(z) - sum_v softmax(z)_v z_v    computed at every position,
                                                             ignored labels included
    Ignored positions get no gradient through log_probs; mask entropy yourself if needed.
    Gradients flow to hidden and weight; the [tokens, vocab] logits are never held whole
    (except by method="naive"). All math is fp32 inside; gradients come back in the input
    dtype. With `compute_sum_pi_squared`, a third element
        sum_pi_squared = sum_v softmax(z)_v^2                  [...] fp32, every position,
    computed in the same pass over the vocabulary (no gradient: a statistic of the policy,
    e.g. for the optimal-token-baseline advantage estimators). chunk_size is tokens per chunk for "chunked" (None: about 32 MiB of logits);
    keep_logits_bytes is how large the [tokens, vocab] log-probs may be for "chunked" to keep
    them from forward to backward instead of recomputing (None: KEEP_LOGITS_BYTES, 0: never).
    `head` describes what the model does around W h (a `HeadTransform`: hidden and logit
    scales, a soft-cap, a bias, a vocabulary cut); every method applies it, z is then
        z = softcap(logit_scale (hidden_scale W h + bias)) / temperature
    over the first head.vocab_size rows, and the bias gets a gradient. None: the plain head.
    """
    check_inputs(hidden, weight, labels, temperature, chunk_size)
    if head is not None:
        check_head(head, weight)
    vocab = weight.shape[0] if head is None or head.vocab_size is None else head.vocab_size
    bad = (labels != ignore_index) & ((labels < 0) | (labels >= vocab))
    if bool(bad.any()):
        first = labels[bad].flatten()[0].item()
        raise KernelInputError(
            f"labels holds {first}, outside [0, {vocab}) and not ignore_index={ignore_index}; "
            f"labels must be token ids of this vocabulary or ignore_index"
        )
    name = resolve_method(method, hidden.device, hidden.dtype)
    if keep_logits_bytes is not None and keep_logits_bytes < 0:
        raise KernelInputError(f"keep_logits_bytes={keep_logits_bytes}; expected >= 0 or None")
    extra = (
        {"keep_logits_bytes": keep_logits_bytes}
        if (name == "chunked" and keep_logits_bytes is not None)
        else {}
    )
    lead = labels.shape
    outs = METHODS.get(name)(
        hidden.reshape(-1, hidden.shape[-1]),
        weight,
        labels.reshape(-1).long(),
        float(temperature),
        ignore_index,
        compute_entropy=compute_entropy,
        chunk_size=chunk_size,
        **extra,
        **({"compute_sum_pi_squared": True} if compute_sum_pi_squared else {}),
        **({"head": head} if head is not None and not head.is_plain else {}),
    )
    log_probs, entropy, *rest = outs
    log_probs = log_probs.reshape(lead)
    entropy = entropy.reshape(lead) if compute_entropy and entropy is not None else None
    if compute_sum_pi_squared:
        return log_probs, entropy, rest[0].reshape(lead)
    return log_probs, entropy
