"""The 1-rank default process group an engine creates when it runs in a single process
without torch.distributed, and its release. One owner flag per process, whichever engine
created the group, so tests and programs can release it without knowing the backend."""

from __future__ import annotations

import torch.distributed as dist

_OWNED_GROUP = False
"""Whether `ensure_single_process_group` created the default group (so it may destroy it)."""


def ensure_single_process_group(backend: str, store: dist.Store | None = None) -> bool:
    """Initialise a 1-rank default group with `backend` when none exists (in-memory store
    unless one is given); returns whether this call created it."""
    global _OWNED_GROUP
    if dist.is_initialized():
        return False
    dist.init_process_group(backend, store=store or dist.HashStore(), rank=0, world_size=1)
    _OWNED_GROUP = True
    return True


def release_process_group() -> bool:
    """Destroy the 1-rank group `ensure_single_process_group` created, if any (engines built
    on it stop working). For test suites and programs that initialise torch.distributed
    themselves afterwards. Returns whether a group was destroyed."""
    global _OWNED_GROUP
    if not (_OWNED_GROUP and dist.is_initialized()):
        return False
    dist.destroy_process_group()
    _OWNED_GROUP = False
    return True
