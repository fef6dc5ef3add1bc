"""Recovery from a dead worker: the groups torn down and built again, and the run continued
from the latest intact checkpoint (or from the start), at most `trainer.max_restarts` times."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tephra.controller.data import PromptLoader

if TYPE_CHECKING:
    from tephra.controller.rl_loop import Trainer


class Recovery:
    """The `Trainer`'s part that rebuilds its worker groups after a failure."""

    def __init__(self, max_restarts: int, can_rebuild: bool) -> None:
        self.max_restarts = max_restarts
        self.can_rebuild = can_rebuild
        """Whether the trainer was given a `make_group` (None: no recovery)."""
        self.restarts = 0

    def recover(self, trainer: Trainer, exc: BaseException) -> None:
        """A worker died: tear `trainer`'s groups down, build them again and continue from
        the latest intact checkpoint (or from the start when there is none); `exc` is raised
        again when no restart is left."""
        self.restarts += 1
        if not self.can_rebuild or self.restarts > self.max_restarts:
            raise exc
        origin = getattr(exc, "cause", None) or exc  # a worker's own exception inside Ray's
        cause = str(origin).strip().splitlines()[0] if str(origin).strip() else ""
        print(
            f"worker group failed at step {trainer.step + 1} ({type(origin).__name__}: "
            f"{cause}); restart {self.restarts} of {self.max_restarts}",
            flush=True,
        )
        trainer.close_group(grace_s=0)  # its live ranks may be stuck in a collective
        trainer.build_groups()
        trainer.peak_flops = trainer.measure_peak_flops()
        trainer.ahead.running = None  # a generation ahead died with the group
        if not trainer.checkpoints.resume(trainer, resume="auto"):
            trainer.step = 0
            trainer.ahead.pending = None
            trainer.loader = PromptLoader(
                len(trainer.train.ids),
                trainer.cfg.batch.prompts_per_step,
                trainer.cfg.trainer.seed,
                trainer.data_fingerprint,
            )
        if trainer.make_replicas is not None:
            trainer.connect_replicas()
