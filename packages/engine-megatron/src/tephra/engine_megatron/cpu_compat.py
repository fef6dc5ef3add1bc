"""Everything megatron-core 0.16.1 needs to run on a machine without CUDA, in one place.

megatron-core is written for GPUs: it asks `torch.cuda.current_device()`, creates tensors on
`device="cuda"`, builds CUDA streams/events in the MoE dispatchers and calls TransformerEngine
GEMMs when it believes they exist. On CPU (tests, CI) these calls are answered here; the engine
logic never branches on the device. With CUDA available only the missing TransformerEngine
GEMM is stood in for (megatron-core 0.16.1 names it whether or not TransformerEngine is
installed); the engine then runs on the GPU (checked on an H100: tests marked `gpu`).
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Callable, Collection, Iterator
from typing import Any

import torch
from megatron.core import tensor_parallel
from megatron.core.tensor_parallel import mappings
from megatron.core.tensor_parallel import random as mp_random
from megatron.core.transformer import multi_latent_attention
from megatron.core.transformer.moe import moe_utils
from torch.overrides import TorchFunctionMode

_APPLIED = False


def cuda_absent() -> bool:
    return not torch.cuda.is_available()


class _FakeStream:
    """Stands in for `torch.cuda.Stream` / `Event`: CPU work is already ordered."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    def wait_stream(self, *args: object, **kwargs: object) -> None:
        pass

    def wait_event(self, *args: object, **kwargs: object) -> None:
        pass

    def record_event(self, *args: object, **kwargs: object) -> _FakeStream:
        return _FakeStream()

    def record(self, *args: object, **kwargs: object) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def wait(self, *args: object, **kwargs: object) -> None:
        pass

    def query(self) -> bool:
        return True

    def __enter__(self) -> _FakeStream:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def _is_cuda(device: object) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return False


class _CudaToCpu(TorchFunctionMode):
    """Maps `device="cuda"` (factories, `.to`, `.cuda()`) to CPU inside megatron calls.

    megatron's schedules hard-code `device="cuda"` for token counters; this mode sends those
    tensors to the CPU instead of failing. It also names CPU tensor types as CUDA ones
    (`_tensor_type`), which megatron's optimizers check.
    """

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Collection[type],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.type:
            return _tensor_type(func, args, kwargs)
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.pin_memory:
            return args[0]
        if "device" in kwargs and _is_cuda(kwargs["device"]):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.to:
            args = tuple("cpu" if _is_cuda(a) else a for a in args)
            kwargs.pop("non_blocking", None)
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        return func(*args, **kwargs)


def _tensor_type(
    func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> str | torch.Tensor:
    """`t.type()` answers with the CUDA type name ('torch.cuda.FloatTensor'): megatron's
    distributed optimizer and grad clipping assert on it to tell fp32 from bf16 parameters.
    A conversion `t.type('torch.cuda.X')` converts to the CPU type instead."""
    target = args[1] if len(args) > 1 else kwargs.get("dtype")
    if target is None:
        name = func(*args, **kwargs)
        return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
    if isinstance(target, str) and target.startswith("torch.cuda."):
        target = target.replace("torch.cuda.", "torch.", 1)
        args = (args[0], target, *args[2:]) if len(args) > 1 else args
        if "dtype" in kwargs:
            kwargs["dtype"] = target
    kwargs.pop("non_blocking", None)
    return func(*args, **kwargs)


def apply() -> None:
    """Answer megatron's CUDA calls on CPU (idempotent; with CUDA present only the
    TransformerEngine stand-in below is set)."""
    global _APPLIED
    # 0.16.1 leaves `te_general_gemm` undefined when TransformerEngine is missing (MoE routers
    # fail with a NameError on any device).
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    # Without TransformerEngine megatron's TE extension module defines MagicMock stand-ins,
    # so MLA's `from ...transformer_engine import TELinear` succeeds and sets HAVE_TE, and its
    # `isinstance(linear_proj, TELinear)` then fails on a MagicMock (DeepSeek-V3's attention)
    if importlib.util.find_spec("transformer_engine") is None:
        multi_latent_attention.HAVE_TE = False
    if _APPLIED or not cuda_absent():
        return
    _APPLIED = True
    # torch.cuda's names that megatron calls, answered on CPU. `current_device` is where
    # megatron puts its tensors, so it answers "cpu" (torch declares a CUDA index): the
    # stand-ins differ from torch's declared types on purpose, hence setattr.
    stand_ins: dict[str, object] = {
        "current_device": lambda: "cpu",
        "Stream": _FakeStream,
        "Event": _FakeStream,
        "current_stream": lambda *a, **k: _FakeStream(),
        "default_stream": lambda *a, **k: _FakeStream(),
        "stream": lambda *a, **k: contextlib.nullcontext(),
        "synchronize": lambda *a, **k: None,
        "empty_cache": lambda: None,
    }
    for name, stand_in in stand_ins.items():
        setattr(torch.cuda, name, stand_in)

    _patch_alltoall_split_sizes()

    # Activation recomputation saves and restores the CUDA RNG state around each layer;
    # on CPU the torch CPU generator (saved beside it) is the only one.
    mp_random._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mp_random._set_cuda_rng_state = lambda *a, **k: None


def _patch_alltoall_split_sizes() -> None:
    """The alltoall dispatcher keeps split sizes as CPU tensors; gloo's uneven
    `all_to_all_single` wants Python lists."""
    original = mappings._AllToAll.forward

    def forward(
        ctx: Any,
        group: torch.distributed.ProcessGroup,
        input: torch.Tensor,
        output_split_sizes: torch.Tensor | list[int] | None,
        input_split_sizes: torch.Tensor | list[int] | None,
    ) -> torch.Tensor:
        if isinstance(output_split_sizes, torch.Tensor):
            output_split_sizes = output_split_sizes.tolist()
        if isinstance(input_split_sizes, torch.Tensor):
            input_split_sizes = input_split_sizes.tolist()
        return original(ctx, group, input, output_split_sizes, input_split_sizes)

    mappings._AllToAll.forward = staticmethod(forward)


@contextlib.contextmanager
def device_scope() -> Iterator[None]:
    """Context around calls into megatron: maps CUDA tensor creation to CPU when CUDA is
    absent, and is a no-op otherwise."""
    if cuda_absent():
        with _CudaToCpu():
            yield
    else:
        yield


def seed_model_parallel_rng(seed: int) -> None:
    """Seed megatron's model-parallel RNG tracker. Without CUDA the tracker cannot hold CUDA
    RNG states, so it is built as the inference tracker (which does not fork CUDA states)."""
    torch.manual_seed(seed)
    if cuda_absent():
        tensor_parallel.model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True)
    else:
        tensor_parallel.model_parallel_cuda_manual_seed(seed)


def default_backend() -> str:
    """gloo on CPU; on GPUs NCCL for CUDA tensors and gloo for the CPU ones (token counts,
    loss metrics and gathered outputs are reduced on the host)."""
    return "gloo" if cuda_absent() else "cpu:gloo,cuda:nccl"
