"""Tensors from the trainer to a generation server over a torch.distributed process group.

Used on both sides: in the trainer (as `tephra.rollout.backends.vllm_plugin.tephra_weight_transport`)
and inside the vLLM server, whose environment has its own torch and no tephra, where this folder
is put on PYTHONPATH (as `tephra_weight_transport`). So it imports nothing but torch.

The group is private to the transfer (its own TCPStore and process group, never the default
group), gloo on CPU and NCCL on GPU; the trainer is rank 0 and broadcasts. A bucket travels as
one flat buffer of the rollout dtype: a few large broadcasts instead of one per tensor, and the
bucket size bounds the extra memory on both sides.
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class BucketMeta:
    """What one flat buffer holds, in order (sent as JSON next to the broadcast)."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]

    def numel(self) -> int:
        return sum(math.prod(s) for s in self.shapes)


def open_group(address: str, port: int, rank: int, world_size: int, backend: str,
               timeout_s: float) -> dist.ProcessGroup:
    """Join (rank 0: host) a private process group of `world_size` ranks at `address:port`."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(address, port, world_size, is_master=rank == 0, timeout=timeout,
                          wait_for_workers=False)
    store = dist.PrefixStore("tephra-weights", store)
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world_size, timeout)
    if backend == "nccl":
        return dist.ProcessGroupNCCL(store, rank, world_size)
    raise ValueError(f"weight transport backend {backend!r}: expected 'gloo' or 'nccl'")


def broadcast(group: dist.ProcessGroup, flat: torch.Tensor) -> None:
    """Broadcast `flat` from rank 0 of `group` into every rank's `flat` (in place)."""
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    group.broadcast([flat], opts).wait()


def buckets(named_tensors: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype,
            bucket_bytes: int) -> Iterator[tuple[BucketMeta, torch.Tensor]]:
    """Group (name, tensor) pairs into flat `dtype` buffers of at most `bucket_bytes` (a tensor
    larger than that travels alone), yielding (meta, buffer) as each fills."""
    pending: list[tuple[str, torch.Tensor]] = []
    size = 0

    def flush() -> tuple[BucketMeta, torch.Tensor]:
        meta = BucketMeta([n for n, _ in pending], [str(dtype).removeprefix("torch.")] * len(pending),
                          [list(t.shape) for _, t in pending])
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
        out.append((name, flat[offset:offset + n].view(shape)))
        offset += n
    return out


def broadcast_meta(group: dist.ProcessGroup, meta: BucketMeta | None, device=None) -> BucketMeta | None:
    """Rank 0 sends `meta` (None: the end of an update) as JSON; every rank returns it."""
    import json

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


def send_all(group: dist.ProcessGroup, named_tensors: Iterable[tuple[str, torch.Tensor]],
             dtype: torch.dtype, bucket_bytes: int, device=None) -> int:
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


def receive_all(group: dist.ProcessGroup, device=None) -> Iterator[tuple[str, torch.Tensor]]:
    """Other ranks: the (name, tensor) pairs of one `send_all`, bucket by bucket."""
    while (meta := broadcast_meta(group, None, device)) is not None:
        flat = torch.empty(meta.numel(), dtype=getattr(torch, meta.dtype_names[0]), device=device)
        broadcast(group, flat)
        yield from unpack(meta, flat)
