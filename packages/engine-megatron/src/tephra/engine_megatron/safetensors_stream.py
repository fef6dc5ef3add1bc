"""Write one safetensors file whose tensors arrive one at a time, in any order.

The safetensors layout is an 8-byte little-endian header length, a JSON header naming each
tensor's dtype, shape and byte range, then the raw bytes. When every name, shape and dtype
is known before the data (the export's table), the header is written first and each tensor
goes straight to its byte range as it arrives: the writer holds one tensor at a time.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


class SafetensorsWriter:
    """`with SafetensorsWriter(path, [(name, shape, dtype), ...]) as w: w.write(name, t)`."""

    def __init__(self, path: Path, entries: list[tuple[str, tuple[int, ...], torch.dtype]]):
        header: dict = {"__metadata__": {"format": "pt"}}
        self.ranges: dict[str, tuple[int, int]] = {}
        self.specs = {name: (tuple(shape), dtype) for name, shape, dtype in entries}
        offset = 0
        for name, shape, dtype in sorted(entries):
            nbytes = torch.Size(shape).numel() * dtype.itemsize
            header[name] = {
                "dtype": _DTYPES[dtype],
                "shape": list(shape),
                "data_offsets": [offset, offset + nbytes],
            }
            self.ranges[name] = (offset, offset + nbytes)
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
        self.data_start = 8 + len(raw)
        self.written: set[str] = set()
        self.file = open(path, "wb")
        self.file.write(len(raw).to_bytes(8, "little"))
        self.file.write(raw)
        self.file.truncate(self.data_start + offset)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        shape, dtype = self.specs[name]
        if tuple(tensor.shape) != shape or tensor.dtype != dtype:
            raise ValueError(
                f"{name}: got {tuple(tensor.shape)} {tensor.dtype}, the header says {shape} {dtype}"
            )
        begin, _ = self.ranges[name]
        data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        self.file.seek(self.data_start + begin)
        # numpy's stubs declare ndarray's buffer protocol (`__buffer__`) for Python >= 3.12
        # only; the array is a buffer on 3.11 as well
        self.file.write(memoryview(data))  # type: ignore[arg-type]
        self.written.add(name)

    def __enter__(self) -> SafetensorsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.file.close()
        missing = set(self.specs) - self.written
        if missing and exc[0] is None:
            raise ValueError(f"safetensors file left without {sorted(missing)[:5]}")
