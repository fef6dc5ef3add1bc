"""The RL loop (`Trainer`): each stage is one call on the worker group; the driver only moves
batches. The stages' parts live in `tephra.controller.step` (rounds, scoring, mismatch,
advantages, batch order, dumps, metrics); the Trainer composes the parts beside it in `loop`:
`generate_ahead` (one_step_off), `run_checkpoints` (save and resume) and `recovery` (a worker
died).

    for step in steps:
        samples = wg.generate(prompts)                  # rollout engine, n samples/prompt;
                                                        # each rank starts scoring its own
        ref     = wg.compute_ref_log_probs(batch)       # KL loss or KL in the reward
        values  = wg.compute_values(batch)              # estimators that need a critic
        old     = wg.compute_log_probs(batch)           # several mini-batches or epochs, or
                                                        # rollout_correction=tis (bypass: the
                                                        # rollout's log-probs instead)
        scores  = wg.collect_scores()                   # scored while the passes above ran
        adv     = compute_advantages(estimator, ...)    # tephra.algos
        wg.update_critic(batch); wg.update_actor(batch) # mini-batches x epochs
        wg.sync_weights()                               # actor -> rollout engine

With `rollout.agent_loop` set, generation is multi-turn (tools between turns) and the batch's
response_mask is 0 on the tokens the tools wrote, so the loss trains only the model's tokens.
With `algorithm.dynamic_sampling` (DAPO) a step may generate several rounds of prompts.

`trainer.mode=one_step_off` moves generation one step ahead: step k trains on the batch
generated during step k-1 (before its update), and generates step k+1's batch before its own
update, in a worker thread that overlaps the passes and the update when it can
(`trainer.overlap_generation`). Every sample carries the version of the weights that
generated it (= RL steps completed then); `staleness/*` logs the lag. The generated-ahead
batch is saved with the checkpoint (`pending_batch.json`), so a resumed run trains on the
very samples the uninterrupted run would have. `algorithm.rollout_correction` (none / tis /
bypass, tephra.algos.rollout_correction) decides what the loss does about the lag.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
from tensordict import TensorDict
from tqdm import tqdm

from tephra.algos import filter_groups
from tephra.controller.cluster.stop import StopNow, StopSignal
from tephra.controller.cluster.worker_failures import WORKER_FAILURES
from tephra.controller.cluster.worker_group import WorkerGroup
from tephra.controller.config.tree import PPOConfig
from tephra.controller.data.prompts import PromptLoader, dataset_fingerprint
from tephra.controller.loop.async_stream import SampleStream, partial_rollout_metrics
from tephra.controller.loop.generate_ahead import GenerateAhead
from tephra.controller.loop.recovery import Recovery
from tephra.controller.loop.run_checkpoints import RunCheckpoints
from tephra.controller.recipes import StepState, enabled_recipes
from tephra.controller.run.evaluation import flat_metrics, summarise, write_jsonl
from tephra.controller.run.flops import ModelShape, step_flops
from tephra.controller.run.memory_metrics import memory_metrics, process_memory
from tephra.controller.run.object_store import object_store_metrics
from tephra.controller.run.trackers import Trackers, plot_curves, read_jsonl
from tephra.controller.samples import (
    Prompt,
    Sample,
    agent_metrics,
    group_ids,
    samples_to_batch,
)
from tephra.controller.step.advantages import (
    kl_controller,
    kl_reward,
    length_shaping,
    outcome_token_rewards,
    reward_components,
    set_advantages,
)
from tephra.controller.step.batch_order import BatchOrder
from tephra.controller.step.dumps import validation_rows, write_train_samples
from tephra.controller.step.metrics import (
    StepTimer,
    dynamic_sampling_metrics,
    format_time_share,
    staleness_metrics,
    step_summary,
    time_share,
)
from tephra.controller.step.mismatch import (
    apply_rejection,
    check_mismatch_alarm,
    correct_old_log_probs,
)
from tephra.controller.step.rounds import Prompts, Round, round_seed
from tephra.controller.step.scoring import check_advantages, check_not_all_failed, check_rewards
from tephra.controller.step.skip_flat import can_skip_flat, flat_groups
from tephra.core.config import to_dict
from tephra.rollout.base import SamplingParams

if TYPE_CHECKING:
    from tephra.controller.workers.rollout_replicas import RolloutReplicas


class RoleCalls:
    """The recipes' calls on their engines by role (`tephra.controller.recipes.RoleEngines`),
    on the worker group of each role's pool."""

    def __init__(
        self,
        on_ranks: Callable[..., Any],
        group_of: Callable[[str], WorkerGroup],
        pools: dict[str, str],
    ) -> None:
        self.on_ranks, self.group_of, self.pools = on_ranks, group_of, pools

    def log_probs(self, role: str, batch: TensorDict) -> torch.Tensor:
        out = self.on_ranks("compute_role_log_probs", batch, self.pools[role], name=role)
        return out["log_probs"]

    def update(self, role: str, batch: TensorDict) -> dict[str, float]:
        out: dict[str, float] = self.on_ranks("update_role", batch, self.pools[role], name=role)
        return out

    def refresh(self, role: str, folder: Path) -> None:
        self.group_of(self.pools[role]).refresh_role(role, str(folder))


class RunService(Protocol):
    """A server the run keeps up beside its workers (the environment server it started): each
    step waits until it is ready (a restart in progress done) and reports its metrics."""

    def wait_ready(self) -> None: ...

    def metrics(self) -> dict[str, float]: ...


class Trainer:
    """Runs `cfg.trainer.steps` RL steps on a worker group of `RLWorker`s."""

    def __init__(
        self,
        cfg: PPOConfig,
        wg: WorkerGroup,
        tokenizer: Any,
        train: Prompts,
        val: Prompts,
        run_dir: Path,
        model: ModelShape,
        peak_flops: float,
        make_group: Any = None,
        make_replicas: Any = None,
        make_role_groups: Any = None,
        role_groups: dict[str, WorkerGroup] | None = None,
        stop: StopSignal | None = None,
        services: list[RunService] | None = None,
    ) -> None:
        self.stop, self.services = stop or StopSignal(), list(services or [])
        """`stop`: set by SIGINT / SIGTERM (`tephra.controller.cluster.stop`), the loop stops
        after the step in progress; `services`: the run's servers each step waits for and
        reports (`RunService`)."""
        self.cfg, self.wg, self.tok, self.train, self.val = cfg, wg, tokenizer, train, val
        self.run_dir = run_dir
        self.data_fingerprint = dataset_fingerprint(train.ids)
        self.loader = PromptLoader(
            len(train.ids), cfg.batch.prompts_per_step, cfg.trainer.seed, self.data_fingerprint
        )
        self.checkpoints = RunCheckpoints(run_dir / "checkpoints", cfg.trainer.keep_checkpoints)
        """Saves the run's checkpoints and resumes from one (`run_checkpoints`)."""
        self.model, self.peak_flops = model, peak_flops
        self.peak_published = False
        """Whether `peak_flops` is the devices' published figure (else measured here)."""
        self.startup: dict[str, float] = {}
        """Seconds of each start-up phase (`tephra.controller.cluster.startup`), for the summary."""
        a = cfg.algorithm
        self.needs_critic, self.needs_ref = a.needs("values"), cfg.needs_reference
        self.kl_ctrl = kl_controller(cfg)
        stops = tuple(t for t in {tokenizer.eos_token_id} if t is not None)
        r = cfg.rollout
        self.sampling = SamplingParams(
            n=cfg.batch.samples_per_prompt,
            temperature=r.temperature,
            top_p=r.top_p,
            top_k=r.top_k,
            max_tokens=r.max_tokens,
            stop_token_ids=stops,
        )
        self.greedy = SamplingParams(
            n=1, temperature=0.0, max_tokens=r.max_tokens, stop_token_ids=stops, logprobs=False
        )
        self.multi_turn = r.uses_agent_loop
        self.step = 0
        self.make_group = make_group
        """Builds a fresh worker group (recovery after a worker died); None: no recovery."""
        self.recovery = Recovery(cfg.trainer.max_restarts, make_group is not None)
        """Rebuilds the groups after a dead worker (`recovery`)."""
        self.ahead = GenerateAhead(cfg, separate_replicas=make_replicas is not None)
        """The next step's batch, generated ahead by one_step_off (`generate_ahead`)."""
        self.skips_flat = can_skip_flat(cfg.actor.objective)
        """Whether the actor update leaves out zero-advantage rows (`skip_zero_advantage_rows`)."""
        self.recipes = enabled_recipes(cfg)
        """The recipes `cfg` turns on (`tephra.controller.recipes`), whose hooks the step runs."""
        self.trains_on_rewards = all(r.trains_on_rewards for r in self.recipes)
        """False when a recipe's actor loss reads no rewards (SPIN): no old log-probs, no
        advantages."""
        self.role_calls = RoleCalls(
            self.on_ranks,
            self.group_of,
            {role.name: role.pool for recipe in self.recipes for role in recipe.roles()},
        )
        self.batch_order = BatchOrder()
        """The step's row order for the actor's data-parallel ranks (`trainer.balance_batch`)."""
        self.make_role_groups = make_role_groups
        """Builds the reference / critic / reward groups of pools of their own
        (`resources.ref`, `resources.critic`, `resources.reward`): role -> `WorkerGroup`;
        None: all colocated with the actor."""
        self.role_groups: dict[str, WorkerGroup] = (
            role_groups
            if role_groups is not None
            else make_role_groups()
            if make_role_groups
            else {}
        )
        """The role groups, given built (before the actor's group, which sends its samples
        to the reward pool) or built here."""
        self.make_replicas = make_replicas
        """Builds the rollout replicas of a separate pool (`resources.rollout.replicas`)."""
        self.replicas: RolloutReplicas | None = None
        self.stream: SampleStream | None = None
        self.stream_state: dict[str, Any] | None = None
        """The async stream's saved state (prompts owed) from the checkpoint resumed from."""
        if make_replicas is not None:
            self.connect_replicas()

    def connect_replicas(self) -> None:
        """Start the replicas, give them the actor's weights, and (async) open the stream."""
        replicas = self.replicas = self.make_replicas()
        try:
            replicas.connect(self.wg, self.step)
        except BaseException:
            replicas.close()
            raise
        replicas.version = self.step
        t = self.cfg.trainer
        if t.mode == "async":
            stream = self.stream = SampleStream(
                replicas,
                self.loader,
                self.train,
                self.sampling,
                t.seed,
                self.cfg.batch.prompts_per_step,
                t.async_in_flight,
                t.async_window,
                t.async_groups_per_request,
            )
            if self.stream_state is not None:  # resumed before the stream existed
                stream.restore(self.stream_state)

    # ----- stages ------------------------------------------------------------------------
    def items(self, indices: list[int], prompts: Prompts, tag: str) -> list[Prompt]:
        return [prompts.item(i, f"{tag}-{j}") for j, i in enumerate(indices)]

    def generate(self, items: list[Prompt], sampling: Any) -> list[Sample]:
        """Samples of `items` (prompt-major, `sampling.n` each) with their scores."""
        if self.replicas is not None:
            return self.check_scores(self.replicas.generate(items, sampling))
        samples = self.wg.generate(items, sampling)
        return self.attach_scores(samples)

    def check_scores(self, samples: list[Sample]) -> list[Sample]:
        check_not_all_failed([s.reward.error for s in samples])
        return samples

    def attach_scores(self, samples: list[Sample]) -> list[Sample]:
        scores = self.wg.collect_scores()
        self.reward_seconds = scores.seconds
        for sample, reward in zip(samples, scores.rewards, strict=True):
            sample.reward = reward
        return self.check_scores(samples)

    def validate_and_log(self, trackers: Trackers, what: str, when: str) -> float:
        """Validation before or after training: logged, printed with its time, returned."""
        t = time.perf_counter()
        acc, val_metrics = self.evaluate()
        trackers.log({"accuracy/val": acc, **val_metrics}, self.step)
        print(
            f"held-out {what} {when} training: {acc:.3f} "
            f"({len(self.val.ids)} items, {time.perf_counter() - t:.0f} s)",
            flush=True,
        )
        return acc

    def evaluate(self) -> tuple[float, dict[str, float]]:
        """Validation on the held-out prompts (the same items every time): `trainer.val.n`
        samples each; returns acc@n and the `val/*` metrics (overall and per data source)."""
        v = self.cfg.trainer.val
        sampling = self.greedy.replace(
            n=v.n, temperature=v.temperature, top_p=v.top_p, seed=self.cfg.trainer.seed
        )
        indices = list(range(len(self.val.ids)))
        samples = self.generate(self.items(indices, self.val, f"val{self.step}"), sampling)
        rows = validation_rows(samples, self.tok, self.val.records, v.n)
        summary = summarise(rows, v.n, v.ks)
        if self.cfg.trainer.dump_generations:
            write_jsonl(rows, self.run_dir / "generations" / f"val_step{self.step}.jsonl")
        return summary["all"][f"acc@{v.n}"], flat_metrics(summary)

    def collect(self, step: int, scored: bool = False) -> list[Round]:
        """The rounds of generation of step `step` (0-based; it seeds the sampling), by the
        current weights. Without dynamic sampling: one round of `batch.prompts_per_step`
        prompts, whose scoring overlaps the log-prob passes (`scored`: collected now). With
        `algorithm.dynamic_sampling` (DAPO): groups whose samples all got the same score (zero
        group-relative advantage) are dropped, and further rounds are generated until
        `prompts_per_step` groups are kept or `algorithm.max_gen_batches` rounds ran; a batch
        still short is filled with the dropped groups of the last rounds (they carry no
        advantage) so its size never changes."""
        cfg, n = self.cfg, self.cfg.batch.samples_per_prompt
        want = cfg.batch.prompts_per_step
        rounds: list[Round] = []
        kept_groups = 0
        while True:
            r = len(rounds)
            idx = self.loader.next_indices()
            tag = f"step{step}" if r == 0 else f"step{step}r{r}"
            items = self.items(idx, self.train, tag)
            sampling = self.sampling.replace(seed=self.seed_of(step, r))
            if self.replicas is not None:  # scored and stamped by the replicas
                samples = self.check_scores(self.replicas.generate(items, sampling))
            else:
                samples = self.wg.generate(items, sampling)
                for s in samples:
                    s.weight_version = self.step
            rnd = Round(items, samples, n, indices=idx, tag=tag, scored=self.replicas is not None)
            rounds.append(rnd)
            if not cfg.algorithm.dynamic_sampling:
                rnd.keep(list(range(len(idx))))
                if scored and not rnd.scored:
                    self.attach_scores(samples)
                    rnd.scored = True
                return rounds  # else scores are collected after the log-prob passes
            if not rnd.scored:
                self.attach_scores(samples)
            rnd.scored = True
            keep, _ = filter_groups(
                torch.tensor(rnd.scores, dtype=torch.float32), torch.arange(len(samples)) // n
            )
            informative = [g for g in range(len(idx)) if bool(keep[g * n])]
            rnd.informative = len(informative)
            rnd.keep(informative[: want - kept_groups])
            kept_groups += len(rnd.kept_groups)
            if kept_groups == want or len(rounds) == cfg.algorithm.max_gen_batches:
                break
        for rnd in reversed(rounds):  # fill up with the latest flat groups
            unused = [g for g in range(rnd.n_groups) if g not in rnd.kept_groups]
            fill = unused[: want - kept_groups]
            rnd.keep(fill, filler=True)
            kept_groups += len(fill)
        return rounds

    def seed_of(self, step: int, r: int) -> int:
        """Sampling seed of round `r` of step `step` (`round_seed`; a batch generated ahead
        keeps the seed of its step)."""
        return round_seed(self.cfg.trainer.seed, step, r)

    # ----- this step's batch -----------------------------------------------------------------
    def take_batch(self) -> list[Round]:
        """This step's rounds: the batch generated ahead when there is one (`GenerateAhead`),
        else the async stream's, else generated now."""
        pending = self.ahead.take()
        if pending is not None:
            return pending
        if self.stream is not None:
            items, indices, samples = self.stream.next_batch(self.step)
            rnd = Round(
                items,
                self.check_scores(samples),
                self.cfg.batch.samples_per_prompt,
                indices=indices,
                tag=f"step{self.step}",
                scored=True,
            )
            rnd.keep(list(range(len(items))))
            return [rnd]
        return self.collect(self.step, scored=self.ahead.enabled)

    def greedy_baselines(self, rounds: list[Round]) -> torch.Tensor:
        """ReMax's baseline: the reward of the greedy response to each sample's prompt [B]."""
        n = self.cfg.batch.samples_per_prompt
        items = [
            replace(rnd.items[g], sample_id=f"{rnd.items[g].sample_id}-greedy")
            for rnd in rounds
            for g in rnd.kept_groups
        ]
        greedy = self.generate(items, self.greedy)
        return torch.tensor([g.reward.score for g in greedy for _ in range(n)], dtype=torch.float32)

    # ----- the data-parallel split -------------------------------------------------------
    def on_ranks(self, method: str, batch: TensorDict, role: str = "actor", **options: Any) -> Any:
        """A `DP_SPLIT` call of the training batch on the group holding `role`, in the order
        `batch_order` planned for the actor's group (`BatchOrder.call`)."""
        group = self.group_of(role)
        return self.batch_order.call(group, group is self.wg, method, batch, **options)

    def group_of(self, role: str) -> WorkerGroup:
        """The worker group holding `role` (`actor`, `ref`, `critic`): its pool's, else the
        actor's."""
        return self.role_groups.get(role, self.wg)

    def groups(self) -> list[WorkerGroup]:
        """Every training worker group: the actor's, then the role pools'."""
        return [self.wg, *self.role_groups.values()]

    # ----- one RL step ---------------------------------------------------------------------
    def train_step(self) -> dict[str, float]:
        """One RL step, its stages in order; the recipes' hooks run at the stages
        `tephra.controller.recipes.base` names."""
        timer = StepTimer()
        self.reward_seconds = 0.0  # set where this step's scores are collected
        rounds = self.take_batch()
        if self.ahead.wanted(self.step):  # before the update: this step's weights sample it
            self.ahead.start(self)
        samples = [s for r in rounds for s in r.kept]
        n = self.cfg.batch.samples_per_prompt
        batch = samples_to_batch(samples, self.tok.pad_token_id, n, self.multi_turn)
        # one group id per prompt of the step (a prompt drawn twice forms two groups)
        batch["uid"] = group_ids(samples, n)
        state = StepState(
            self.cfg,
            self.step,
            rounds,
            samples,
            batch,
            self.tok,
            self.run_dir,
            self.role_calls,
            timer.lap,
        )
        self.run_hooks("after_generation", state)
        timer.lap("generate")
        self.plan(state)
        self.forward_passes(state)
        if self.trains_on_rewards:
            self.old_log_probs(state)
        self.score(state, timer)
        self.run_hooks("after_scoring", state)
        if self.trains_on_rewards:
            self.advantages(state)
        self.dump(state)
        timer.lap("advantages")
        self.run_hooks("before_update", state)
        self.updates(state)
        self.run_hooks("after_update", state)
        if self.ahead.running is not None:
            self.ahead.finish(self)
            timer.lap("generate_wait")  # what the update did not hide of the next generation
        if self.replicas is not None:
            self.replicas.sync(self.wg, self.step + 1)
        else:
            self.wg.sync_weights()
        timer.lap("sync")
        return self.summary(state, timer)

    def run_hooks(self, stage: str, state: StepState) -> None:
        """Every enabled recipe's hook of `stage`, in the order of their names."""
        for recipe in self.recipes:
            getattr(recipe, stage)(state)

    def plan(self, state: StepState) -> None:
        """Staleness, the rows' order over the actor's ranks, the async stream's metrics."""
        cfg, metrics = self.cfg, state.metrics
        metrics.update(staleness_metrics(state.samples, self.step))
        metrics.update(
            self.batch_order.plan(
                state.batch, self.wg.dp_size, cfg.trainer.balance_batch, cfg.batch.mini_batches
            )
        )
        if self.stream is not None:
            metrics.update(self.stream.metrics())
            if cfg.trainer.partial_rollout:
                metrics.update(partial_rollout_metrics(state.samples))

    def forward_passes(self, state: StepState) -> None:
        """The reference's pass, the recipes' (`forward_passes`), the critic's values."""
        batch = state.batch
        if self.needs_ref:
            batch["ref_log_probs"] = self.on_ranks("compute_ref_log_probs", batch, "ref")[
                "log_probs"
            ]
            state.forward_passes += 1
            state.lap("ref")
        self.run_hooks("forward_passes", state)
        if self.needs_critic:
            batch["values"] = self.on_ranks("compute_values", batch, "critic")["values"]
            state.forward_passes += 1
            state.lap("values")

    def old_log_probs(self, state: StepState) -> None:
        """The trainer's log-probs of the samples where the loss reads them (several
        mini-batches or epochs, a correction of the rollout's), with the mismatch metrics."""
        cfg, batch = self.cfg, state.batch
        token_stats = cfg.algorithm.needs("token_stats")

        def trainer_log_probs(b: TensorDict) -> torch.Tensor:
            # the whole batch's pass also gives the optimal-token-baseline's sum pi^2
            # (not the mismatch probe's rows, another TensorDict)
            if token_stats and b is batch:
                out = self.on_ranks("compute_log_probs", b, sum_pi_squared=True)
                batch["sum_pi_squared"] = out["sum_pi_squared"]
                return out["log_probs"]
            return self.on_ranks("compute_log_probs", b)["log_probs"]

        corr_metrics, passes = correct_old_log_probs(
            batch,
            cfg.algorithm.correction,
            # the optimal-token-baseline estimators read pi_old and sum pi_old^2 of one pass
            cfg.batch.mini_batches > 1 or cfg.batch.epochs > 1 or token_stats,
            trainer_log_probs,
            probe_rows=cfg.algorithm.mismatch_probe_rows,
            dp_size=self.wg.dp_size,
            probe_seed=self.seed_of(self.step, 0),
        )
        state.metrics.update(corr_metrics)
        check_mismatch_alarm(corr_metrics, cfg.algorithm.mismatch_alarm_kl, self.step + 1)
        if token_stats and "sum_pi_squared" not in batch.keys():
            # a mode that replaces the old log-probs (bypass) ran no trainer pass: sum pi^2
            # comes from the trainer's weights, which are the sampling policy's on-policy
            batch["sum_pi_squared"] = self.on_ranks(
                "compute_log_probs", batch, sum_pi_squared=True
            )["sum_pi_squared"]
            passes += 1
        if passes:
            state.forward_passes += passes
            state.lap("old_log_probs")

    def score(self, state: StepState, timer: StepTimer) -> None:
        """The samples' scores (waited for where scoring overlapped the passes), checked, with
        the length shaping: `state.scores`."""
        if not all(r.scored for r in state.rounds):
            self.attach_scores(state.samples)
        timer.times["time/reward_s"] = self.reward_seconds
        state.lap("reward_wait")
        state.names = [name for r in state.rounds for name in r.kept_names()]
        # before float32: a float64 score of 1e308 would already be inf there
        check_rewards([s.reward.score for s in state.samples], state.names, self.cfg.reward.max_abs)
        raw = torch.tensor([s.reward.score for s in state.samples], dtype=torch.float32)
        shaping = length_shaping(self.cfg, state.samples)
        state.scores = raw + shaping
        if self.cfg.algorithm.overlong_buffer:
            state.metrics["reward/overlong_penalty_mean"] = float(shaping.mean())

    def advantages(self, state: StepState) -> None:
        """The step's advantages: a recipe's (`advantages`), else the estimator's from the
        token rewards; then the recipes' terms (`after_advantages`), checked."""
        batch, metrics = state.batch, state.metrics
        assert state.scores is not None  # `score` ran
        batch["rewards"] = state.scores
        if not any(recipe.advantages(state) for recipe in self.recipes):
            self.estimator_advantages(state, state.scores)
        self.run_hooks("after_advantages", state)
        check_advantages(batch["advantages"], batch["response_mask"], state.names)
        apply_rejection(batch)
        if self.skips_flat:  # the workers leave these groups out of the actor update
            metrics["actor/skipped_flat_groups"] = float(flat_groups(batch))

    def estimator_advantages(self, state: StepState, scores: torch.Tensor) -> None:
        """`algorithm.adv_estimator`'s advantages of the outcome token rewards (with the KL
        penalty in the reward, the greedy baselines where the estimator reads them)."""
        cfg, batch, samples = self.cfg, state.batch, state.samples
        token_rewards = outcome_token_rewards(scores, batch["response_mask"], samples)
        if cfg.algorithm.kl_in_reward.enabled:
            token_rewards, kl_metrics = kl_reward(cfg, batch, token_rewards, self.kl_ctrl)
            state.metrics.update(kl_metrics)
        baselines = None
        if cfg.algorithm.needs("baselines"):
            baselines = self.greedy_baselines(state.rounds)
            state.metrics["reward/greedy_baseline_mean"] = float(baselines.mean())
            state.lap("baselines")
        set_advantages(cfg, batch, token_rewards, baselines, reward_components(cfg, samples))

    def dump(self, state: StepState) -> None:
        """The step's training rows every `trainer.dump_generations` steps."""
        every = self.cfg.trainer.dump_generations
        if not every or (self.step + 1) % every:
            return
        path = self.run_dir / "generations" / f"train_step{self.step + 1}.jsonl"
        if state.dump is not None:
            state.dump(path)
        else:
            n = self.cfg.batch.samples_per_prompt
            write_train_samples(path, state.samples, state.batch, self.tok, n)

    def updates(self, state: StepState) -> None:
        """The critic's update, then the actor's (unless a recipe held it back)."""
        cfg, metrics = self.cfg, state.metrics
        if self.needs_critic:
            out = self.on_ranks("update_critic", state.batch, "critic")
            metrics.update({f"critic/{k.split('/')[-1]}": v for k, v in out.items()})
            state.trained_passes += cfg.batch.epochs
            state.lap("critic")
        if state.train_actor:
            out = self.on_ranks("update_actor", state.batch)
            metrics.update(
                {k if k.startswith("actor/") else f"actor/{k}": v for k, v in out.items()}
            )
            state.trained_passes += cfg.batch.epochs
            state.lap("actor")

    def summary(self, state: StepState, timer: StepTimer) -> dict[str, float]:
        """The step's metrics: the stages', the step summary (rewards, lengths, FLOPs, MFU)
        and the stage times."""
        cfg, metrics, batch = self.cfg, state.metrics, state.batch
        step_s = timer.total()
        flops = step_flops(self.model, batch, state.forward_passes, state.trained_passes)
        assert state.scores is not None  # `score` ran
        metrics.update(
            step_summary(
                state.rounds,
                state.samples,
                batch,
                state.scores,
                step_s,
                flops / step_s / self.peak_flops if self.peak_flops else 0.0,
                self.peak_published,
                float(flops),
            )
        )
        metrics.update(timer.times)
        ranks = [stats for group in self.groups() for stats in group.memory_stats()]
        metrics.update(memory_metrics(process_memory(), ranks))
        metrics.update(object_store_metrics())
        if self.multi_turn:
            metrics.update(agent_metrics(state.samples))
        for service in self.services:
            metrics.update(service.metrics())
        if cfg.algorithm.dynamic_sampling:
            metrics.update(dynamic_sampling_metrics(state.rounds))
        if "actor/kl_mean" in metrics:
            metrics["actor/kl"] = metrics["actor/kl_mean"]
        return metrics

    # ----- the worker groups -----------------------------------------------------------------
    def measure_peak_flops(self) -> float:
        """The MFU denominator: the summed peak of every training rank (published where every
        rank's device has a figure, else measured; `peak_published` says which)."""
        peaks = [peak for group in self.groups() for peak in group.peak_flops()]
        self.peak_published = all(published for _, published in peaks)
        return float(sum(flops for flops, _ in peaks))

    def close_group(self, grace_s: float = 10.0, at_once: bool = False) -> None:
        """Close the rollout replicas and the worker groups; `grace_s`: how long the ranks get
        to exit on their own before they are killed (0 for a group that has failed).
        `at_once` (a second stop signal): the ranks may be inside a stage, where a close call
        would wait behind it; they are killed (Ray's SIGTERM: their exit hooks stop their
        servers)."""
        try:
            if not at_once:
                if self.replicas is not None:
                    self.replicas.close()
                for group in self.groups():
                    group.close()
        except Exception:  # noqa: BLE001  (a dead group cannot close; shutdown still runs)
            pass
        finally:
            for group in self.groups():
                group.shutdown(0 if at_once else grace_s)

    def recover(self, exc: BaseException) -> None:
        """A worker died: tear the groups down, build them again and continue from the
        latest intact checkpoint (or from the start when there is none); `exc` is raised
        again when no restart is left (`Recovery`)."""
        self.recovery.allow(exc, self.step)
        self.close_group(grace_s=0)  # its live ranks may be stuck in a collective
        self.build_groups()
        self.peak_flops = self.measure_peak_flops()
        self.ahead.running = None  # a generation ahead died with the group
        if not self.checkpoints.resume(self, resume="auto"):
            self.step = 0
            self.ahead.pending = None
            self.loader = PromptLoader(
                len(self.train.ids),
                self.cfg.batch.prompts_per_step,
                self.cfg.trainer.seed,
                self.data_fingerprint,
            )
        if self.make_replicas is not None:
            self.connect_replicas()

    def build_groups(self) -> None:
        """A fresh actor group and role groups (recovery); the replicas and the stream are
        connected again by `connect_replicas`. The role groups first: the actor's group
        sends its samples to the reward pool's new ranks."""
        self.role_groups = self.make_role_groups() if self.make_role_groups else {}
        self.wg = self.make_group()
        self.replicas = self.stream = None  # closed with the group

    # ----- the run ----------------------------------------------------------------------------
    def fit(self) -> dict[str, Any]:  # noqa: C901, PLR0915 (older than the limit; to split)
        cfg, t0 = self.cfg.trainer, time.perf_counter()
        resumed = self.checkpoints.resume(self)
        trackers = Trackers(
            cfg.trackers, self.run_dir, cfg.project, self.run_dir.name, to_dict(self.cfg)
        )
        acc_before = None
        what = "greedy accuracy" if cfg.val.n == 1 else f"acc@{cfg.val.n}"
        bar = None
        saved_at = self.step if resumed else None
        try:
            if cfg.val_before and not resumed:
                acc_before = self.validate_and_log(trackers, what, "before")
            if cfg.progress_bar:
                bar = tqdm(total=cfg.steps, initial=self.step, desc="steps", dynamic_ncols=True)
            while self.step < cfg.steps and not self.stop.requested:
                profiling = self.step + 1 in cfg.profile_steps
                if profiling:
                    for group in self.groups():
                        group.set_profile(str(self.run_dir / "profile" / f"step{self.step + 1}"))
                self.wg.watchdog.step = self.step + 1  # quoted by a stage that fails
                for service in self.services:
                    service.wait_ready()
                try:
                    metrics = self.train_step()
                except WORKER_FAILURES as exc:
                    if self.stop.requested:  # no restart for a run that is stopping
                        raise
                    self.recover(exc)
                    continue
                if profiling:
                    for group in self.groups():
                        group.set_profile(None)
                self.step += 1
                if cfg.val_every and self.step % cfg.val_every == 0 and self.step < cfg.steps:
                    metrics["accuracy/val"], val_metrics = self.evaluate()
                    metrics.update(val_metrics)
                trackers.log(metrics, self.step)
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(reward=f"{metrics['reward/mean']:.2f}")
                if cfg.save_every and self.step % cfg.save_every == 0:
                    self.checkpoints.save(self)
                    saved_at = self.step
        except StopNow:
            pass  # a second signal: no checkpoint of a step that may be half done
        finally:
            if bar is not None:
                bar.close()
        if self.stop.requested:
            return self.stopped(trackers, saved_at, t0)
        if cfg.save_final and (not cfg.save_every or self.step % cfg.save_every):
            self.checkpoints.save(self)
        acc_after = None
        if cfg.val_after:
            acc_after = self.validate_and_log(trackers, what, "after")
        trackers.close()
        if cfg.export_hf:
            self.wg.export_hf(str(self.run_dir / "hf"))
        summary = {
            "status": "completed",
            "accuracy_before": acc_before,
            "accuracy_after": acc_after,
            "steps": self.step,
            "seconds": round(time.perf_counter() - t0, 1),
            "run_dir": str(self.run_dir),
            "startup": self.startup,
        }
        if "reward" in self.role_groups:  # how the reward pool's ranks shared the scoring
            summary["reward_pool_samples"] = self.role_groups["reward"].scored_count()
        if "jsonl" in cfg.trackers:
            records = read_jsonl(self.run_dir / "metrics.jsonl")
            if records:
                plot_curves(records, self.run_dir / "curves.png")
                share = time_share(records)
                summary["time_share"] = share
                print(format_time_share(share), flush=True)
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        return summary

    def stopped(self, trackers: Trackers, saved_at: int | None, t0: float) -> dict[str, Any]:
        """The end of a run a signal stopped: the last completed step checkpointed (when
        checkpoints are on and it is not saved yet; not after a second signal), the trackers
        closed, and a `stopped` summary. The held-out evaluation and the export are skipped."""
        cfg = self.cfg.trainer
        if (
            not self.stop.immediate
            and (cfg.save_every or cfg.save_final)
            and self.step > 0
            and saved_at != self.step
        ):
            try:
                self.checkpoints.save(self)
            except StopNow:  # a second signal while saving: the commit is atomic, none is made
                pass
        trackers.close()
        latest = self.checkpoints.manager.latest()
        summary = {
            **self.stop.summary(self.step, latest),
            "seconds": round(time.perf_counter() - t0, 1),
            "run_dir": str(self.run_dir),
            "startup": self.startup,
        }
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        print(
            f"stopped by {self.stop.name} after step {self.step} of {cfg.steps}"
            + (f"; resume from {latest} with trainer.resume=auto" if latest else ""),
            flush=True,
        )
        return summary
