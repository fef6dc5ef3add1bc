"""Keep freed host memory in the process instead of handing it back to the kernel (glibc).

Why: glibc serves blocks over its mmap threshold (128 KiB, growing to at most 32 MiB as
such blocks are freed) with a fresh `mmap` and unmaps them on `free`. A CPU training step
allocates and frees the same large tensors every step (gradient buffers, the output head's
logits and weight gradient), so each step pays the kernel's page faults and zero fills again:
0.5-0.8 s of a 2-3 s update of a 135M-parameter model on a 2-core CPU. With the thresholds
raised, freed blocks stay in the heap and the next step reuses them; the process's resident
memory then stays near its peak instead of shrinking between steps.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform

M_TRIM_THRESHOLD = -1
"""`mallopt` parameter: free memory at the heap's top beyond this goes back to the kernel."""
M_MMAP_THRESHOLD = -3
"""`mallopt` parameter: allocations from this size up get their own mapping."""
RETAIN_BYTES = (1 << 31) - 1
"""Both thresholds are set to this, the largest value `mallopt` takes (an `int`): blocks up to
2 GiB come from the heap and up to 2 GiB of free heap is kept."""


def _libc() -> ctypes.CDLL | None:
    if platform.libc_ver()[0] != "glibc":
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def retain_supported() -> bool:
    """Whether this process's C library is glibc, whose thresholds `retain_freed_memory` sets."""
    return _libc() is not None


def retain_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds to `RETAIN_BYTES` for the rest of the process:
    later large allocations reuse freed heap memory instead of new mappings. Returns whether
    it took effect (False where the C library is not glibc). Blocks allocated before the call
    are unaffected."""
    libc = _libc()
    if libc is None:
        return False
    ok = int(libc.mallopt(M_MMAP_THRESHOLD, RETAIN_BYTES)) == 1
    return int(libc.mallopt(M_TRIM_THRESHOLD, RETAIN_BYTES)) == 1 and ok
