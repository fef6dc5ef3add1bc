"""What tells the driver that a worker died, so the loop can rebuild its group and resume."""

from __future__ import annotations

from ray.exceptions import ActorDiedError, RayActorError

from tephra.rollout.base import ServerDiedError

# Ray re-raises a worker's exception as a subclass of its cause, so a rollout server that
# died inside a worker method is caught here like a dead worker
WORKER_FAILURES: tuple[type[BaseException], ...] = (RayActorError, ActorDiedError, ServerDiedError)
"""What a dead worker process (SIGKILL, out of memory) or a dead rollout server raises in the
driver."""
