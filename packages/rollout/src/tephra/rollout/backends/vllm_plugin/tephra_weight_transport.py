"""Tensors from the trainer to a generation server: over a torch.distributed process group
(`gloo`, `nccl`), or as shared-memory handles (`ipc`).

Used on both sides: in the trainer (as `tephra.rollout.backends.vllm_plugin.tephra_weight_transport`)
and inside the vLLM server, whose environment has its own torch and no tephra, where this folder
is put on PYTHONPATH (as `tephra_weight_transport`). So it imports nothing but torch.

The group is private to the transfer (its own TCPStore and process group, never the default
group), gloo on CPU and NCCL on GPU; the trainer is rank 0 and broadcasts. A bucket travels as
one flat buffer of the rollout dtype: a few large broadcasts instead of one per tensor, and the
bucket size bounds the extra memory on both sides.

`ipc` sends no data through a group: the sender pickles the bucket with torch's
multiprocessing reductions (`share`), which turn a CUDA tensor into a CUDA IPC handle and a
CPU tensor into a shared-memory file, and the receiver rebuilds a view of the sender's memory
from it (`open_shared`) and copies it into its weights. One code path for both devices: CUDA
IPC between two processes on one GPU (a colocated server), CPU shared memory on one machine
(how the tests and the benchmark run it without a GPU).
"""

from __future__ import annotations

import base64
import contextlib
import datetime
import functools
import importlib
import io
import json
import math
import pickle
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import TYPE_CHECKING, Any, TypeAlias

import torch
import torch.distributed as dist
import torch.multiprocessing  # registers the tensor reductions ForkingPickler uses

if TYPE_CHECKING:
    # The private group of a transfer: a c10d backend made on its own store (not a
    # `ProcessGroup`), used through its own collectives. Named here only: a torch built
    # without NCCL has no `ProcessGroupNCCL`.
    TransferGroup: TypeAlias = dist.ProcessGroupGloo | dist.ProcessGroupNCCL


@dataclass
class BucketMeta:
    """What one flat buffer holds, in order (sent as JSON next to the broadcast)."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]

    def numel(self) -> int:
        return sum(math.prod(s) for s in self.shapes)


def open_group(
    address: str, port: int, rank: int, world_size: int, backend: str, timeout_s: float
) -> TransferGroup:
    """Join (rank 0: host) a private process group of `world_size` ranks at `address:port`."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store: dist.Store = dist.TCPStore(
        address, port, world_size, is_master=rank == 0, timeout=timeout, wait_for_workers=False
    )
    store = dist.PrefixStore("tephra-weights", store)
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world_size, timeout)
    if backend == "nccl":
        # torch's stub omits the default of `options` that the binding has
        return dist.ProcessGroupNCCL(store, rank, world_size)  # type: ignore[call-arg]
    raise ValueError(
        f"weight transport backend {backend!r}: a group is 'gloo' or 'nccl' ('ipc' needs none)"
    )


def broadcast(group: TransferGroup, flat: torch.Tensor) -> None:
    """Broadcast `flat` from rank 0 of `group` into every rank's `flat` (in place)."""
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    # torch's stub of the c10d Backend lists none of its collectives; the binding has them
    group.broadcast([flat], opts).wait()  # type: ignore[union-attr]


def buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype, bucket_bytes: int
) -> Iterator[tuple[BucketMeta, torch.Tensor]]:
    """Group (name, tensor) pairs into flat `dtype` buffers of at most `bucket_bytes` (a tensor
    larger than that travels alone), yielding (meta, buffer) as each fills."""
    pending: list[tuple[str, torch.Tensor]] = []
    size = 0

    def flush() -> tuple[BucketMeta, torch.Tensor]:
        meta = BucketMeta(
            [n for n, _ in pending],
            [str(dtype).removeprefix("torch.")] * len(pending),
            [list(t.shape) for _, t in pending],
        )
        if len(pending) == 1:  # a tensor alone (often the embedding, the largest) is not copied
            flat = pending[0][1].reshape(-1)
        else:
            flat = torch.cat([t.reshape(-1) for _, t in pending])
        return meta, flat

    for name, tensor in named_tensors:
        tensor = tensor.detach().to(dtype=dtype).contiguous()
        nbytes = tensor.numel() * tensor.element_size()
        if pending and size + nbytes > bucket_bytes:
            yield flush()
            pending, size = [], 0
        pending.append((name, tensor))
        size += nbytes
    if pending:
        yield flush()


def unpack(meta: BucketMeta, flat: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """The named views of `flat` that `meta` describes."""
    out, offset = [], 0
    for name, shape in zip(meta.names, meta.shapes):
        n = math.prod(shape)
        out.append((name, flat[offset : offset + n].view(shape)))
        offset += n
    return out


def broadcast_meta(
    group: TransferGroup, meta: BucketMeta | None, device: torch.device | None = None
) -> BucketMeta | None:
    """Rank 0 sends `meta` (None: the end of an update) as JSON; every rank returns it."""
    size = torch.zeros(1, dtype=torch.int64, device=device)
    payload = b""
    if meta is not None:
        payload = json.dumps([meta.names, meta.dtype_names, meta.shapes]).encode()
        size[0] = len(payload)
    broadcast(group, size)
    n = int(size[0])
    data = torch.empty(max(n, 1), dtype=torch.uint8, device=device)
    if meta is not None:
        data[:n] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    broadcast(group, data)
    if n == 0:
        return None
    names, dtype_names, shapes = json.loads(bytes(data[:n].cpu().tolist()))
    return BucketMeta(names, dtype_names, shapes)


def send_all(
    group: TransferGroup,
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    dtype: torch.dtype,
    bucket_bytes: int,
    device: torch.device | None = None,
) -> int:
    """Rank 0: every (name, tensor) in buckets (meta, then the flat buffer), then the end
    marker. Returns the bytes sent."""
    sent = 0
    for meta, flat in buckets(named_tensors, dtype, bucket_bytes):
        broadcast_meta(group, meta, device)
        flat = flat.to(device) if device is not None else flat
        broadcast(group, flat)
        sent += flat.numel() * flat.element_size()
    broadcast_meta(group, None, device)
    return sent


def receive_all(
    group: TransferGroup, device: torch.device | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Other ranks: the (name, tensor) pairs of one `send_all`, bucket by bucket."""
    while (meta := broadcast_meta(group, None, device)) is not None:
        flat = torch.empty(meta.numel(), dtype=getattr(torch, meta.dtype_names[0]), device=device)
        broadcast(group, flat)
        yield from unpack(meta, flat)


# -- ipc: shared-memory handles instead of a group ---------------------------------------------


@contextlib.contextmanager
def _file_sharing() -> Iterator[None]:
    """CPU tensors shared as named shared-memory files for the pickle's duration: torch's
    default (file descriptors) reaches only processes that torch.multiprocessing started,
    a file name reaches any process on the machine (the server was started by Popen)."""
    previous = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy("file_system")
    try:
        yield
    finally:
        torch.multiprocessing.set_sharing_strategy(previous)


def gpu_uuid(device: torch.device | None) -> str | None:
    """The physical GPU of `device` (None on CPU): how both ends check that they share one."""
    if device is None or device.type != "cuda":
        return None
    return str(torch.cuda.get_device_properties(device).uuid)


def pickle_shared(obj: Any) -> str:
    """`obj` pickled with every tensor in it as a shared-memory handle (CUDA IPC; a named
    shared-memory file on CPU), base64 for a JSON body. A CPU tensor's storage is moved into
    shared memory in place: pickle a copy of anything the caller keeps. The tensors must stay
    alive until the receiver has copied them."""
    buffer = io.BytesIO()
    with _file_sharing():
        ForkingPickler(buffer, pickle.HIGHEST_PROTOCOL).dump(obj)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def share(tensors: torch.Tensor | list[torch.Tensor], device: torch.device | None = None) -> str:
    """`pickle_shared` of `tensors` (a tensor, or a list of them) with the sender's GPU (None
    on CPU), which `open_shared` checks."""
    return pickle_shared((gpu_uuid(device), tensors))


_HANDLE_GLOBALS = {
    ("torch.multiprocessing.reductions", name)
    for name in (
        "rebuild_tensor",
        "rebuild_cuda_tensor",
        "rebuild_typed_storage",
        "rebuild_storage_filename",
    )
} | {
    ("torch", "Tensor"),
    ("torch", "Size"),
    ("torch.storage", "UntypedStorage"),
    ("torch.storage", "TypedStorage"),  # the storage class a CUDA tensor's handle names
}
"""What a pickled handle may name (anything else is refused: the body comes over HTTP)."""

_CUDA_DEVICE_ARG = 6
"""Position of the device index in `rebuild_cuda_tensor`'s arguments."""


def _rebuild_cuda_on(index: int, *args: Any) -> torch.Tensor:
    # the receiver may number the shared GPU differently (its own CUDA_VISIBLE_DEVICES)
    args = list(args)  # type: ignore[assignment]  # rebinding *args to a list, as a list
    args[_CUDA_DEVICE_ARG] = index  # type: ignore[index]  # (see the line above)
    return torch.multiprocessing.reductions.rebuild_cuda_tensor(*args)


class _HandleUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, device_index: int | None) -> None:
        super().__init__(io.BytesIO(data))
        self.device_index = device_index

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) not in _HANDLE_GLOBALS:
            raise pickle.UnpicklingError(f"a weight handle may not name {module}.{name}")
        if name == "rebuild_cuda_tensor" and self.device_index is not None:
            return functools.partial(_rebuild_cuda_on, self.device_index)
        return getattr(importlib.import_module(module), name)


def _cuda_index(device: torch.device | None) -> int | None:
    if device is None or device.type != "cuda":
        return None
    return device.index if device.index is not None else torch.cuda.current_device()


def open_pickled(text: str, device: torch.device | None = None) -> Any:
    """What `pickle_shared` made, each tensor a view of the sender's memory (a CUDA tensor on
    `device`'s GPU, which must be the sender's; CPU shared memory when the sender's was on
    CPU). Only torch's tensor-rebuild functions may be named in it."""
    return _HandleUnpickler(base64.b64decode(text), _cuda_index(device)).load()


def open_shared(text: str, device: torch.device | None = None) -> Any:
    """What `share` sent (`open_pickled`), checking that sender and receiver share a GPU."""
    sender_gpu, tensors = open_pickled(text, device)
    index = _cuda_index(device)
    here = gpu_uuid(torch.device("cuda", index)) if index is not None else None
    if sender_gpu is not None and sender_gpu != here:
        raise RuntimeError(
            f"weight_transport=ipc: the sender's tensors are on GPU {sender_gpu} "
            f"and this receiver is on {here}; CUDA IPC shares one GPU's memory "
            "between processes on it, use nccl between different GPUs"
        )
    return tensors
