"""What tells the driver that a worker died or hung, so the loop can rebuild its group and resume."""

from __future__ import annotations

from ray.exceptions import ActorDiedError, OutOfMemoryError, RayActorError

from tephra.controller.cluster.watchdog import StageFailure
from tephra.rollout.base import ServerDiedError

# Ray re-raises a worker's exception as a subclass of its cause, so a rollout server that
# died inside a worker method is caught here like a dead worker
WORKER_FAILURES: tuple[type[BaseException], ...] = (
    RayActorError,
    ActorDiedError,
    OutOfMemoryError,
    ServerDiedError,
    StageFailure,
)
"""What a dead worker process (SIGKILL, killed for memory by Ray's monitor or the kernel), a dead
rollout server or a stage past its watchdog deadline raises in the driver. A stage's call names
a rank killed for memory in a `StageFailure` of kind `out_of_memory` (`watchdog`,
`memory_kills`); `OutOfMemoryError` is here for the waits outside a stage's call."""
