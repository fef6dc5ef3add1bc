"""What tells the driver that a worker died or hung, so the loop can rebuild its group and resume."""

from __future__ import annotations

from ray.exceptions import ActorDiedError, RayActorError

from tephra.controller.watchdog import StageFailure
from tephra.rollout.base import ServerDiedError

# Ray re-raises a worker's exception as a subclass of its cause, so a rollout server that
# died inside a worker method is caught here like a dead worker
WORKER_FAILURES: tuple[type[BaseException], ...] = (
    RayActorError,
    ActorDiedError,
    ServerDiedError,
    StageFailure,
)
"""What a dead worker process (SIGKILL, out of memory), a dead rollout server or a stage past
its watchdog deadline raises in the driver."""
