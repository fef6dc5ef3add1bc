"""Recovery from a dead worker: how many restarts a run has left (`trainer.max_restarts`) and
the line that reports one; the loop tears its groups down, builds them again and continues
from the latest intact checkpoint (`Trainer.recover`)."""

from __future__ import annotations


class Recovery:
    """The count of restarts after a failed worker group."""

    def __init__(self, max_restarts: int, can_rebuild: bool) -> None:
        self.max_restarts = max_restarts
        self.can_rebuild = can_rebuild
        """Whether the trainer was given a `make_group` (None: no recovery)."""
        self.restarts = 0

    def allow(self, exc: BaseException, step: int) -> None:
        """Count a restart after a failure at 0-based step `step`, reporting the worker's
        own exception; `exc` is raised again when no restart is left."""
        self.restarts += 1
        if not self.can_rebuild or self.restarts > self.max_restarts:
            raise exc
        origin = getattr(exc, "cause", None) or exc  # a worker's own exception inside Ray's
        cause = str(origin).strip().splitlines()[0] if str(origin).strip() else ""
        print(
            f"worker group failed at step {step + 1} ({type(origin).__name__}: "
            f"{cause}); restart {self.restarts} of {self.max_restarts}",
            flush=True,
        )
