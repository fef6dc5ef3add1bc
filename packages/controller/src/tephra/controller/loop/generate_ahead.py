"""Generation one step ahead (`trainer.mode=one_step_off`): step k's weights generate step
k+1's batch before step k's update, in a worker thread when that can overlap the update, and
step k+1 trains on it."""

from __future__ import annotations

from typing import Any, Protocol

import ray

from tephra.controller.cluster.worker_group import WorkerGroup
from tephra.controller.config.tree import PPOConfig
from tephra.controller.data.prompts import PromptLoader
from tephra.controller.samples import Prompt, Sample
from tephra.controller.step.rounds import Prompts, Round
from tephra.rollout.base import SamplingParams


class Collector(Protocol):
    """What generating ahead uses of the loop (the `Trainer` is one): its step, prompts,
    sampling, the groups that generate, and the calls that collect and score a batch."""

    step: int
    loader: PromptLoader
    train: Prompts
    sampling: SamplingParams
    replicas: Any
    wg: WorkerGroup

    def collect(self, step: int, scored: bool = False) -> list[Round]: ...
    def items(self, indices: list[int], prompts: Prompts, tag: str) -> list[Prompt]: ...
    def seed_of(self, step: int, r: int) -> int: ...
    def check_scores(self, samples: list[Sample]) -> list[Sample]: ...
    def attach_scores(self, samples: list[Sample]) -> list[Sample]: ...


class GenerateAhead:
    """The `Trainer`'s part that generates the next step's batch ahead and hands it over."""

    def __init__(self, cfg: PPOConfig, separate_replicas: bool) -> None:
        t, a = cfg.trainer, cfg.algorithm
        self.cfg = cfg
        self.enabled = t.mode == "one_step_off"
        # a worker thread generates ahead only when one plain `generate` makes the batch;
        # separate rollout replicas generate in parallel with the update by nature
        self.overlap = (
            self.enabled
            and (t.overlap_generation or separate_replicas)
            and not a.dynamic_sampling
            and not a.needs("baselines")
        )
        self.pending: list[Round] | None = None
        """The next step's batch, generated ahead and scored."""
        self.running: Round | None = None
        """The round a worker thread is generating (overlap), until `finish`."""
        self.ref: Any = None
        """The replicas' result of `running` (a Ray object ref), when they generate it."""

    def take(self) -> list[Round] | None:
        """The batch generated ahead for this step, or None (the first step, or a run resumed
        from a checkpoint without one)."""
        rounds, self.pending = self.pending, None
        return rounds

    def wanted(self, step: int) -> bool:
        """Whether step `step` (0-based) generates the next one's batch: one_step_off, and the
        next step runs (or a checkpoint after this last step keeps the batch for a longer
        rerun)."""
        t = self.cfg.trainer
        if not self.enabled:
            return False
        last = step + 1 >= t.steps
        return not last or t.save_final or bool(t.save_every and t.steps % t.save_every == 0)

    def start(self, trainer: Collector) -> None:
        """Generate step `trainer.step + 1`'s batch with the current weights: in a worker
        thread (`overlap`; `finish` takes it) or right now."""
        step = trainer.step + 1
        # two torch.profiler sessions cannot run at once: a profiled step (1-based `step`)
        # generates serially
        if not self.overlap or step in self.cfg.trainer.profile_steps:
            self.pending = trainer.collect(step, scored=True)
            return
        idx = trainer.loader.next_indices()
        tag = f"step{step}"
        items = trainer.items(idx, trainer.train, tag)
        sampling = trainer.sampling.replace(seed=trainer.seed_of(step, 0))
        self.running = Round(items, [], self.cfg.batch.samples_per_prompt, indices=idx, tag=tag)
        if trainer.replicas is not None:  # the replicas generate while the training ranks update
            self.ref = trainer.replicas.submit_split(items, sampling)
        else:
            trainer.wg.generate_ahead(items, sampling)

    def finish(self, trainer: Collector) -> None:
        """Wait for the worker thread's samples, score them, keep them as `pending`."""
        if self.running is None:
            return
        rnd, self.running = self.running, None
        if trainer.replicas is not None:
            rnd.samples = trainer.check_scores(ray.get(self.ref))
        else:
            rnd.samples = trainer.attach_scores(trainer.wg.generated())
            for s in rnd.samples:
                s.weight_version = trainer.step  # launched before this step's update
        rnd.keep(list(range(len(rnd.items))))
        rnd.scored = True
        self.pending = [rnd]
