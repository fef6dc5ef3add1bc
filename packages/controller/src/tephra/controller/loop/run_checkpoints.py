"""A run's checkpoints: the workers' states saved with the trainer's own (data loader position,
KL coefficient, the batch generated ahead, the prompts the async stream owes), and a run
resumed from them exactly where it stopped."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from tephra.algos import AdaptiveKLController, FixedKLController
from tephra.controller.cluster.worker_group import WorkerGroup
from tephra.controller.config.tree import PPOConfig
from tephra.controller.data.prompts import PromptLoader
from tephra.controller.loop.generate_ahead import GenerateAhead
from tephra.controller.run.checkpoints import CheckpointManager
from tephra.controller.samples import Prompt
from tephra.controller.step.rounds import Prompts, read_pending, write_pending


class RunState(Protocol):
    """What a checkpoint holds of the loop beside the workers' states (the `Trainer` is
    one): its step, data position, KL coefficient, the batch generated ahead, the async
    stream's debt, and the groups that save and load."""

    cfg: PPOConfig
    step: int
    loader: PromptLoader
    kl_ctrl: AdaptiveKLController | FixedKLController
    ahead: GenerateAhead
    train: Prompts
    stream: Any
    stream_state: dict[str, Any] | None
    replicas: Any
    wg: WorkerGroup

    def groups(self) -> list[WorkerGroup]: ...
    def items(self, indices: list[int], prompts: Prompts, tag: str) -> list[Prompt]: ...


class RunCheckpoints:
    """The `Trainer`'s part that saves its checkpoints and resumes from one."""

    def __init__(self, root: Path, keep_last: int) -> None:
        self.manager = CheckpointManager(root, keep_last)

    def save(self, trainer: RunState) -> None:
        """Checkpoint `trainer` after its step `trainer.step`."""
        pending = trainer.ahead.pending

        def write(folder: Path) -> None:
            for group in trainer.groups():
                group.save_checkpoint(str(folder))
            if pending is not None:
                write_pending(folder, pending)

        state: dict[str, Any] = {
            "loader": trainer.loader.state_dict(),
            "kl_coef": trainer.kl_ctrl.value,
        }
        if trainer.stream is not None:  # the prompts taken but not trained yet are sent again
            state["stream"] = trainer.stream.state()
        self.manager.save(trainer.step, write, state)

    def resume(self, trainer: RunState, resume: str | None = None) -> bool:
        """Load the checkpoint that `resume` (else `trainer.resume` / `trainer.resume_from`)
        names into `trainer` and its workers; False when there is none."""
        t = trainer.cfg.trainer
        latest = (
            self.manager.resolve(resume)
            if resume is not None
            else self.manager.resolve(t.resume, t.resume_from)
        )
        if latest is None:
            return False
        state = self.manager.load_trainer_state(latest)
        for group in trainer.groups():
            group.load_checkpoint(str(latest))
        if trainer.replicas is not None:
            trainer.replicas.sync(trainer.wg, int(state["step"]))
        trainer.loader.load_state_dict(state["loader"])
        trainer.kl_ctrl.value = float(state.get("kl_coef", trainer.kl_ctrl.value))
        trainer.step = int(state["step"])
        trainer.ahead.pending = read_pending(
            latest, lambda idx, tag: trainer.items(idx, trainer.train, tag)
        )
        trainer.stream_state = state.get("stream")
        if trainer.stream is not None and trainer.stream_state is not None:
            trainer.stream.restore(trainer.stream_state)
        trainer.ahead.running = None
        print(f"resumed from {latest} at step {trainer.step}", flush=True)
        return True
