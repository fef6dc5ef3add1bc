"""The RL loop. Each stage is one call on the worker group; the driver only moves batches.

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

import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDict

from tephra.algos import ROLLOUT_CORRECTIONS, apply_rollout_correction, rollout_mismatch_metrics
from tephra.controller.balance import balanced_order, max_over_min
from tephra.controller.checkpoints import CheckpointManager
from tephra.controller.data import PromptLoader, PromptRecord, dataset_fingerprint
from tephra.controller.flops import ModelShape, step_flops
from tephra.controller.rewarding import (
    accuracy_of,
    check_advantages,
    check_not_all_failed,
    check_rewards,
)
from tephra.controller.rl_config import PPOConfig
from tephra.controller.rl_worker import can_skip_flat, flat_groups
from tephra.controller.samples import (
    PromptItem,
    Sample,
    agent_metrics,
    group_ids,
    sample_from_dict,
    sample_to_dict,
    samples_to_batch,
    set_score,
)
from tephra.controller.trackers import Trackers, plot_curves, read_jsonl
from tephra.controller.worker_group import WorkerGroup
from tephra.core.config import to_dict
from tephra.core.errors import ConfigError, TephraError
from tephra.engine_api.multimodal import MultimodalInputs
from tephra.episodes.rewards import is_timeout


@dataclass
class Prompts:
    """Tokenised prompts and their records (same order)."""

    ids: list[list[int]]
    records: list[PromptRecord]
    multimodal: list[MultimodalInputs | None] | None = None
    """Each prompt's images (pixel values and grids), or None for text prompts."""


@dataclass
class Round:
    """One round of generation in a step: its samples (prompt-major, `n` per prompt, scored)
    and which prompt groups the step trains on."""

    items: list[PromptItem]
    samples: list[Sample]
    n: int
    kept_groups: list[int] = field(default_factory=list)
    informative: int = 0
    """Groups whose samples did not all score the same (dynamic sampling)."""
    filler: int = 0
    """How many of the kept groups are flat ones added to fill the batch."""
    indices: list[int] = field(default_factory=list)
    """The prompts' indices in the training set (the items are rebuilt from them)."""
    tag: str = ""
    """Prefix of the items' sample ids."""
    scored: bool = False
    """Whether the samples' scores were collected from the workers."""

    @property
    def scores(self) -> list[float]:
        return [s.score for s in self.samples]

    @property
    def errors(self) -> int:
        return sum(s.reward_error is not None for s in self.samples)

    @property
    def timeouts(self) -> int:
        """Samples whose scorer did not return within `reward.timeout_s` (among `errors`)."""
        return sum(is_timeout(s.reward_error) for s in self.samples)

    @property
    def clipped(self) -> int:
        """Samples whose score `reward.clip` moved into its range."""
        return sum(s.reward_clipped for s in self.samples)

    def kept_names(self) -> list[str]:
        """Each kept sample as an error message names it: prompt id, dataset row, data_source."""
        names = []
        for g in self.kept_groups:
            item = self.items[g]
            row = f", dataset row {self.indices[g]}" if self.indices else ""
            names += [
                f"prompt {item.sample_id!r}{row}, data_source {item.record.data_source!r}"
            ] * self.n
        return names

    @property
    def n_groups(self) -> int:
        return len(self.samples) // self.n

    def keep(self, groups: list[int], filler: bool = False) -> None:
        self.kept_groups = sorted(set(self.kept_groups) | set(groups))
        self.filler += len(groups) if filler else 0

    @property
    def kept(self) -> list[Sample]:
        return [self.samples[g * self.n + k] for g in self.kept_groups for k in range(self.n)]


PENDING_FILE = "pending_batch.json"
"""The batch generated ahead (trainer.mode=one_step_off), in a checkpoint folder."""


def round_to_dict(rnd: Round) -> dict[str, Any]:
    """A round as JSON data; its items are rebuilt from `indices` and `tag` on load."""
    return {
        "indices": rnd.indices,
        "tag": rnd.tag,
        "n": rnd.n,
        "kept_groups": rnd.kept_groups,
        "informative": rnd.informative,
        "filler": rnd.filler,
        "scored": rnd.scored,
        "samples": [sample_to_dict(s) for s in rnd.samples],
    }


def round_from_dict(data: dict[str, Any], items: list[PromptItem]) -> Round:
    """The inverse of `round_to_dict`, given the items rebuilt from its `indices`."""
    samples = [sample_from_dict(s) for s in data["samples"]]
    for k, s in enumerate(samples):  # images are not in the JSON: they come from the prompts
        s.multimodal = items[k // data["n"]].multimodal
    return Round(
        items,
        samples,
        data["n"],
        kept_groups=list(data["kept_groups"]),
        informative=data["informative"],
        filler=data["filler"],
        indices=list(data["indices"]),
        tag=data["tag"],
        scored=data["scored"],
    )


def staleness_metrics(samples: list[Sample], version: int) -> dict[str, float]:
    """`staleness/*`: version lag (`version`, the trainer's weights before the update, minus
    each sample's `weight_version`) mean and max, and the samples' versions min and max."""
    versions = [s.weight_version for s in samples]
    lags = [version - v for v in versions]
    return {
        "staleness/mean": sum(lags) / len(lags),
        "staleness/max": float(max(lags)),
        "staleness/weight_version_min": float(min(versions)),
        "staleness/weight_version_max": float(max(versions)),
    }


def correct_old_log_probs(
    batch: TensorDict,
    correction: Any,
    recompute: bool,
    compute_log_probs: Callable[[TensorDict], torch.Tensor],
    *,
    probe_rows: int = 0,
    dp_size: int = 1,
    probe_seed: int = 0,
) -> tuple[dict[str, float], int]:
    """Set batch["old_log_probs"] (and ["rollout_is_weights"], and ["rejection_keep"] when
    rejection sampling is on) as `correction` (a tephra.algos.RolloutCorrectionConfig) says;
    returns (`rollout_corr/*` metrics, forward passes run). The trainer's log-probs are
    computed when the mode or rejection needs them or when `recompute` (several mini-batches
    / epochs), unless the mode replaces them (bypass); without them, one mini-batch and epoch
    use the current log-probs (in the worker). The mismatch metrics come whenever the
    trainer's log-probs were computed; otherwise from a probe of `probe_rows` random rows
    (`mismatch_probe`), so every step logs them."""
    meta = ROLLOUT_CORRECTIONS.meta(correction.mode)
    needs_train = meta["needs_train_log_probs"] or bool(correction.rejection)
    passes = 0
    if not meta.get("replaces_old_log_probs") and (recompute or needs_train):
        batch["old_log_probs"] = compute_log_probs(batch)
        passes = 1
    train = batch["old_log_probs"] if passes else None
    if "rollout_log_probs" not in batch.keys():
        if correction.mode != "none" or correction.rejection:
            raise ConfigError(
                f"algorithm.rollout_correction={correction.mode!r} (and "
                "algorithm.rollout_rejection) need the rollout's per-token "
                "log-probs, which this rollout did not return"
            )
        return {}, passes
    if correction.mode == "none" and train is None:
        return mismatch_probe(batch, probe_rows, dp_size, probe_seed, compute_log_probs), passes
    out = apply_rollout_correction(
        correction, batch["rollout_log_probs"], batch["response_mask"], train
    )
    batch["old_log_probs"] = out.old_log_probs
    if out.weights is not None:
        batch["rollout_is_weights"] = out.weights.to(batch["rollout_log_probs"].dtype)
    if out.keep is not None:
        batch["rejection_keep"] = out.keep
    return out.metrics, passes


def round_seed(run_seed: int, step: int, r: int) -> int:
    """The sampling seed of round `r` of step `step`: a 62-bit hash of the three, so that
    rounds' seed ranges never meet (sample j of the batch's prompt i samples from seed +
    i * n + j, `SamplingParams.seed`; consecutive seeds per step would replay one step's
    random stream in the next)."""
    digest = hashlib.blake2b(f"{run_seed}/{step}/{r}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2


def mismatch_probe(
    batch: TensorDict,
    rows: int,
    dp_size: int,
    seed: int,
    compute_log_probs: Callable[[TensorDict], torch.Tensor],
) -> dict[str, float]:
    """`rollout_corr/*` mismatch metrics (tephra.algos.rollout_mismatch_metrics) on `rows`
    random rows (rounded to the data-parallel size, at least one per rank), whose trainer
    log-probs are computed for it; {} when `rows` is 0. `rollout_corr/probe_rows` says how
    many. The rows come from `seed`, so a resumed run probes the same ones."""
    n = batch.batch_size[0]
    if rows <= 0 or n == 0:
        return {}
    k = min(n, max(dp_size, rows - rows % dp_size))
    idx = torch.randperm(n, generator=torch.Generator().manual_seed(seed))[:k].sort().values
    sub = batch[idx]
    metrics = rollout_mismatch_metrics(
        compute_log_probs(sub), sub["rollout_log_probs"], sub["response_mask"]
    )
    metrics["rollout_corr/probe_rows"] = float(k)
    return metrics


def apply_rejection(batch: TensorDict) -> None:
    """Drop the tokens rejection sampling rejected from batch["response_mask"], after the
    advantages (a rejected sequence's score still counts in its group, as in verl) and before
    the updates."""
    if "rejection_keep" in batch.keys():
        batch["response_mask"] = batch["response_mask"] * batch["rejection_keep"]
        del batch["rejection_keep"]


def check_mismatch_alarm(metrics: dict[str, float], threshold: float | None, step: int) -> None:
    """Raise a MismatchAlarm when `rollout_corr/kl_k3` is over `threshold`."""
    kl = metrics.get("rollout_corr/kl_k3")
    if threshold is None or kl is None or kl <= threshold:
        return
    raise MismatchAlarm(
        f"step {step}: the rollout's log-probs differ from the trainer's by KL {kl:.3g} "
        f"(rollout_corr/kl_k3, mean |gap| {metrics['rollout_corr/log_prob_abs_gap_mean']:.3g} "
        f"nats), over algorithm.mismatch_alarm_kl={threshold}. Likely causes: the rollout "
        f"computes in another dtype than the trainer (rollout.dtype, actor.precision), another "
        f"backend's kernels (rollout.backend), or another chat template or tokenizer than the "
        f"trainer's. Raise the threshold, or correct for it with algorithm.rollout_correction="
        f"tis or algorithm.rollout_rejection"
    )


class MismatchAlarm(TephraError, RuntimeError):
    """The train/rollout mismatch went over `algorithm.mismatch_alarm_kl`."""


def dynamic_sampling_metrics(rounds: list[Round]) -> dict[str, float]:
    """`dapo/*`: generation rounds, prompt groups generated, flat ones among them (all samples
    scored the same), and flat groups trained on to fill the batch (0 when enough came)."""
    generated = sum(r.n_groups for r in rounds)
    return {
        "dapo/gen_rounds": float(len(rounds)),
        "dapo/groups_generated": float(generated),
        "dapo/groups_flat": float(generated - sum(r.informative for r in rounds)),
        "dapo/groups_filled": float(sum(r.filler for r in rounds)),
    }


def outcome_token_rewards(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """[B] scores -> [B, T] with the score on each sample's last response token."""
    mask = response_mask.long()
    last = (mask * torch.arange(mask.shape[1])).argmax(-1)
    out = torch.zeros(mask.shape, dtype=torch.float32)
    has = mask.sum(-1) > 0
    out[has, last[has]] = scores[has].float()
    return out


def time_share(records: list[dict[str, Any]]) -> dict[str, float]:
    """Each stage's share of the total step time over a run's metric records (`time/<stage>_s`
    summed over steps, divided by the summed `time/step_s`)."""
    total = sum(r.get("time/step_s", 0.0) for r in records)
    stages: dict[str, float] = {}
    for r in records:
        for key, value in r.items():
            if key.startswith("time/") and key not in ("time/step_s", "time/reward_s"):
                stage = key[len("time/") : -len("_s")]
                stages[stage] = stages.get(stage, 0.0) + value
    return {k: v / total for k, v in sorted(stages.items(), key=lambda kv: -kv[1])} if total else {}


def format_time_share(share: dict[str, float]) -> str:
    """One line: `time per stage: generate 31%, actor 60%, ...`."""
    return "time per stage: " + ", ".join(f"{k} {100 * v:.0f}%" for k, v in share.items())


def _worker_failures() -> tuple[type[BaseException], ...]:
    from ray.exceptions import ActorDiedError, RayActorError

    from tephra.rollout.base import ServerDiedError

    # Ray re-raises a worker's exception as a subclass of its cause, so a rollout server that
    # died inside a worker method is caught here like a dead worker
    return (RayActorError, ActorDiedError, ServerDiedError)


WORKER_FAILURES = _worker_failures()
"""What a dead worker process (SIGKILL, out of memory) or a dead rollout server raises in the
driver."""


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
    ) -> None:
        from tephra.algos import AdaptiveKLController, FixedKLController
        from tephra.rollout.base import SamplingParams

        self.cfg, self.wg, self.tok, self.train, self.val = cfg, wg, tokenizer, train, val
        self.run_dir = run_dir
        self.data_fingerprint = dataset_fingerprint(train.ids)
        self.loader = PromptLoader(
            len(train.ids), cfg.batch.prompts_per_step, cfg.trainer.seed, self.data_fingerprint
        )
        self.ckpt = CheckpointManager(run_dir / "checkpoints", cfg.trainer.keep_checkpoints)
        self.model, self.peak_flops = model, peak_flops
        self.peak_published = False
        self.startup: dict[str, float] = {}
        """Seconds of each start-up phase (`tephra.controller.startup`), for the summary."""
        """Whether `peak_flops` is the devices' published figure (else measured here)."""
        a = cfg.algorithm
        self.needs_critic, self.needs_ref = a.needs("values"), cfg.needs_reference
        kl = a.kl_in_reward
        self.kl_ctrl = (
            AdaptiveKLController(kl.coef, kl.target_kl, kl.horizon)
            if kl.controller == "adaptive"
            else FixedKLController(kl.coef)
        )
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
        self.restarts = 0
        self.one_step_off = cfg.trainer.mode == "one_step_off"
        # a worker thread generates ahead only when one plain `generate` makes the batch
        self.overlap = (
            self.one_step_off
            and cfg.trainer.overlap_generation
            and not a.dynamic_sampling
            and not a.needs("baselines")
        )
        self.pending: list[Round] | None = None
        """The next step's batch, generated ahead (one_step_off) and scored."""
        self.skips_flat = can_skip_flat(cfg.actor.objective)
        """Whether the actor update leaves out zero-advantage rows (`skip_zero_advantage_rows`)."""
        self.order = self.inverse = None
        """The step's row order for the data-parallel ranks and its inverse (`balance`)."""
        self.ahead: Round | None = None
        """The round a worker thread is generating (overlap), until `finish_ahead`."""
        self.make_role_groups = make_role_groups
        """Builds the reference / critic groups of pools of their own (`resources.ref`,
        `resources.critic`): role -> `WorkerGroup`; None: both colocated with the actor."""
        self.role_groups: dict[str, WorkerGroup] = make_role_groups() if make_role_groups else {}
        self.make_replicas = make_replicas
        """Builds the rollout replicas of a separate pool (`resources.rollout.replicas`)."""
        self.replicas = self.stream = None
        if make_replicas is not None:
            self.connect_replicas()
            # separate replicas generate ahead in parallel with the update by nature
            self.overlap = self.one_step_off and not a.dynamic_sampling and not a.needs("baselines")

    def connect_replicas(self) -> None:
        """Start the replicas, give them the actor's weights, and (async) open the stream."""
        from tephra.controller.async_stream import SampleStream

        self.replicas = self.make_replicas()
        try:
            self.replicas.connect(self.wg)
        except BaseException:
            self.replicas.close()
            raise
        self.replicas.version = self.step
        t = self.cfg.trainer
        if t.mode == "async":
            self.stream = SampleStream(
                self.replicas,
                self.loader,
                self.train,
                self.sampling,
                t.seed,
                self.cfg.batch.prompts_per_step,
                t.async_in_flight,
                t.max_staleness,
                t.async_groups_per_request,
            )

    # ----- stages ------------------------------------------------------------------------
    def items(self, indices: list[int], prompts: Prompts, tag: str) -> list[PromptItem]:
        mm = prompts.multimodal
        return [
            PromptItem(
                prompts.ids[i], prompts.records[i], f"{tag}-{j}", mm[i] if mm is not None else None
            )
            for j, i in enumerate(indices)
        ]

    def generate(self, items: list[PromptItem], sampling: Any) -> list[Sample]:
        """Samples of `items` (prompt-major, `sampling.n` each) with their scores."""
        if self.replicas is not None:
            return self.check_scores(self.replicas.generate(items, sampling))
        samples = self.wg.generate(items, sampling)
        return self.attach_scores(samples)

    def check_scores(self, samples: list[Sample]) -> list[Sample]:
        check_not_all_failed([s.reward_error for s in samples])
        return samples

    def attach_scores(self, samples: list[Sample]) -> list[Sample]:
        results = self.wg.collect_scores()
        self.reward_seconds = max((r.seconds for r in results), default=0.0)
        for sample, result in zip(samples, results, strict=True):
            set_score(sample, result)
        check_not_all_failed([s.reward_error for s in samples])
        return samples

    def evaluate(self) -> tuple[float, dict[str, float]]:
        """Validation on the held-out prompts (the same items every time): `trainer.val.n`
        samples each; returns acc@n and the `val/*` metrics (overall and per data source)."""
        from tephra.controller.evaluation import EvalRow, flat_metrics, summarise, write_jsonl

        v = self.cfg.trainer.val
        sampling = self.greedy.replace(
            n=v.n, temperature=v.temperature, top_p=v.top_p, seed=self.cfg.trainer.seed
        )
        indices = list(range(len(self.val.ids)))
        samples = self.generate(self.items(indices, self.val, f"val{self.step}"), sampling)
        rows = [
            EvalRow(
                prompt=self.tok.decode(s.prompt_ids, skip_special_tokens=True),
                response=s.text,
                score=s.score,
                ground_truth=self.val.records[k // v.n].ground_truth,
                data_source=self.val.records[k // v.n].data_source,
                answer=s.text.strip(),
                prompt_index=k // v.n,
            )
            for k, s in enumerate(samples)
        ]
        summary = summarise(rows, v.n, v.ks)
        if self.cfg.trainer.dump_generations:
            write_jsonl(rows, self.run_dir / "generations" / f"val_step{self.step}.jsonl")
        return summary["all"][f"acc@{v.n}"], flat_metrics(summary)

    def dump_train(self, samples: list[Sample], batch: TensorDict) -> None:
        """The step's trained samples with their tokens, rewards and advantages, as JSONL."""
        from tephra.controller.evaluation import EvalRow

        mask = batch["response_mask"].bool()
        advantages = [
            float(batch["advantages"][i][mask[i]].mean()) if mask[i].any() else 0.0
            for i in range(len(samples))
        ]
        n = self.cfg.batch.samples_per_prompt
        rows = [
            EvalRow(
                prompt=self.tok.decode(s.prompt_ids, skip_special_tokens=True),
                response=s.text,
                score=s.score,
                ground_truth=None,
                data_source="",
                answer=s.text.strip(),
                prompt_index=k // n,
                advantage=a,
            )
            for k, (s, a) in enumerate(zip(samples, advantages))
        ]
        path = self.run_dir / "generations" / f"train_step{self.step + 1}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w") as f:  # EvalRow plus the tokens and the generating weights' version(s)
            for row, s in zip(rows, samples):
                versions = {} if s.token_versions is None else {"token_versions": s.token_versions}
                tokens = {
                    "prompt_ids": s.prompt_ids,
                    "response_ids": s.response_ids,
                    "response_mask": s.response_mask,
                    "finish_reason": s.finish_reason,
                }
                f.write(
                    json.dumps(
                        {**asdict(row), **tokens, "weight_version": s.weight_version, **versions},
                        default=str,
                    )
                    + "\n"
                )

    def collect(self, step: int, scored: bool = False) -> list[Round]:
        """The rounds of generation of step `step` (0-based; it seeds the sampling), by the
        current weights. Without dynamic sampling: one round of `batch.prompts_per_step`
        prompts, whose scoring overlaps the log-prob passes (`scored`: collected now). With
        `algorithm.dynamic_sampling` (DAPO): groups whose samples all got the same score (zero
        group-relative advantage) are dropped, and further rounds are generated until
        `prompts_per_step` groups are kept or `algorithm.max_gen_batches` rounds ran; a batch
        still short is filled with the dropped groups of the last rounds (they carry no
        advantage) so its size never changes."""
        from tephra.algos import filter_groups

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

    # ----- generation ahead (trainer.mode=one_step_off) --------------------------------------
    def take_batch(self) -> list[Round]:
        """This step's rounds: the batch generated ahead when there is one, else generated
        now (the first step, or a run resumed from a checkpoint without one)."""
        if self.pending is not None:
            rounds, self.pending = self.pending, None
            return rounds
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
        return self.collect(self.step, scored=self.one_step_off)

    def wants_ahead(self) -> bool:
        """Whether this step generates the next one's batch: one_step_off, and the next step
        runs (or a checkpoint after this last step keeps the batch for a longer rerun)."""
        t = self.cfg.trainer
        if not self.one_step_off:
            return False
        last = self.step + 1 >= t.steps
        return not last or t.save_final or bool(t.save_every and t.steps % t.save_every == 0)

    def start_ahead(self) -> None:
        """Generate step `self.step + 1`'s batch with the current weights: in a worker thread
        (`overlap`; `finish_ahead` takes it) or right now."""
        step = self.step + 1
        # two torch.profiler sessions cannot run at once: a profiled step (1-based `step`)
        # generates serially
        if not self.overlap or step in self.cfg.trainer.profile_steps:
            self.pending = self.collect(step, scored=True)
            return
        idx = self.loader.next_indices()
        tag = f"step{step}"
        items = self.items(idx, self.train, tag)
        sampling = self.sampling.replace(seed=self.seed_of(step, 0))
        self.ahead = Round(items, [], self.cfg.batch.samples_per_prompt, indices=idx, tag=tag)
        if self.replicas is not None:  # the replicas generate while the training ranks update
            self.ahead_ref = self.replicas.submit_split(items, sampling)
        else:
            self.wg.generate_ahead(items, sampling)

    def finish_ahead(self) -> None:
        """Wait for the worker thread's samples, score them, keep them as `pending`."""
        if self.ahead is None:
            return
        rnd, self.ahead = self.ahead, None
        if self.replicas is not None:
            import ray

            rnd.samples = self.check_scores(ray.get(self.ahead_ref))
        else:
            rnd.samples = self.attach_scores(self.wg.generated())
            for s in rnd.samples:
                s.weight_version = self.step  # launched before this step's update
        rnd.keep(list(range(len(rnd.items))))
        rnd.scored = True
        self.pending = [rnd]

    def greedy_baselines(self, rounds: list[Round]) -> torch.Tensor:
        """ReMax's baseline: the reward of the greedy response to each sample's prompt [B]."""
        n = self.cfg.batch.samples_per_prompt
        items = [
            PromptItem(
                rnd.items[g].prompt_ids, rnd.items[g].record, f"{rnd.items[g].sample_id}-greedy"
            )
            for rnd in rounds
            for g in rnd.kept_groups
        ]
        greedy = self.generate(items, self.greedy)
        return torch.tensor([g.score for g in greedy for _ in range(n)], dtype=torch.float32)

    def length_shaping(self, samples: list[Sample]) -> torch.Tensor:
        """DAPO's soft overlong punishment added to each kept sample's score ([B]; zeros when
        `algorithm.overlong_buffer` is 0), from the full response length (tool tokens count)."""
        from tephra.algos import overlong_penalty

        a = self.cfg.algorithm
        if not a.overlong_buffer:
            return torch.zeros(len(samples))
        lengths = torch.tensor([len(s.response_ids) for s in samples])
        return overlong_penalty(
            lengths, self.cfg.rollout.response_budget, a.overlong_buffer, a.overlong_penalty_factor
        )

    def reward_components(self, samples: list[Sample]) -> torch.Tensor | None:
        """GDPO's reward components [B, K]: each sample's reward dict entries named by
        `algorithm.advantage.gdpo_reward_keys` ("score": the score), 0 for a sample whose
        scorer failed; None without keys (GDPO then takes the score alone)."""
        keys = self.cfg.algorithm.advantage.gdpo_reward_keys
        if keys is None or not self.cfg.algorithm.reads("reward_components"):
            return None
        rows = []
        for i, s in enumerate(samples):
            values = {**s.reward_extras, "score": s.score}
            missing = [k for k in keys if k not in values]
            if missing and s.reward_error is None:
                raise ConfigError(
                    f"algorithm.advantage.gdpo_reward_keys={keys} but the reward of sample {i} "
                    f"has no {missing} (its reward dict held {sorted(values)}); return those "
                    "keys from the reward function, or list the keys it returns"
                )
            rows.append([float(values.get(k, 0.0)) for k in keys])
        return torch.tensor(rows, dtype=torch.float32)

    def advantages(
        self,
        batch: TensorDict,
        token_rewards: torch.Tensor,
        baselines: torch.Tensor | None,
        components: torch.Tensor | None = None,
    ) -> None:
        from tephra.algos import compute_advantages

        a = self.cfg.algorithm
        stats = {}
        if a.needs("token_stats"):
            stats = {
                "old_log_probs": batch["old_log_probs"],
                "sum_pi_squared": batch.pop("sum_pi_squared"),  # read here only
                # verl scales OTB's W by the rollout IS weights squared when they exist
                "rollout_is_weights": batch.get("rollout_is_weights", None),
            }
        adv, ret = compute_advantages(
            a.adv_estimator,
            token_rewards=token_rewards,
            response_mask=batch["response_mask"],
            group_ids=batch["uid"],
            values=batch["values"] if self.needs_critic else None,
            config=a.advantage,
            baselines=baselines,
            reward_components=components,
            **stats,
        )
        batch["advantages"], batch["returns"] = adv.float(), ret.float()

    def kl_reward(
        self, batch: TensorDict, token_rewards: torch.Tensor
    ) -> tuple[torch.Tensor, dict]:
        """KL to the reference as a per-token reward penalty (algorithm.kl_in_reward)."""
        from tephra.algos import apply_kl_penalty, kl_penalty

        kl = kl_penalty(
            batch["rollout_log_probs"]
            if "old_log_probs" not in batch.keys()
            else batch["old_log_probs"],
            batch["ref_log_probs"],
            self.cfg.algorithm.kl_in_reward.estimator,
        )
        rewards, metrics = apply_kl_penalty(
            token_rewards, batch["response_mask"], kl, self.kl_ctrl.value
        )
        self.kl_ctrl.update(metrics["kl_penalty/kl"], batch.batch_size[0])
        return rewards, metrics

    # ----- the data-parallel split -------------------------------------------------------
    def balance(self, batch: TensorDict) -> dict[str, float]:
        """Choose the order in which this step's training batch goes to the data-parallel
        ranks (`trainer.balance_batch`: token-balanced, `tephra.controller.balance`); returns
        the `balance/*` metrics (several data-parallel ranks only)."""
        self.order = self.inverse = None
        dp = self.wg.dp_size
        if dp == 1:
            return {}
        tokens = batch["attention_mask"].sum(-1).tolist()
        before = max_over_min(tokens, None, dp)
        if self.cfg.trainer.balance_batch:
            order = balanced_order(tokens, dp, self.cfg.batch.mini_batches)
            self.order = torch.tensor(order)
            self.inverse = torch.argsort(self.order)
        return {
            "balance/max_over_min_tokens_before": before,
            "balance/max_over_min_tokens_after": max_over_min(
                tokens, self.order.tolist() if self.order is not None else None, dp
            ),
        }

    def on_ranks(self, method: str, batch: TensorDict, role: str = "actor", **options: Any) -> Any:
        """A `DP_SPLIT` call of the training batch on the group holding `role`, in the order
        `balance` chose for the actor's group; per-row results come back in the batch's own
        order. Another batch (the mismatch probe's rows) goes as it is. `options` (scalars:
        every rank gets them whole) go to the method as keywords."""
        group = self.role_groups.get(role, self.wg)
        if self.order is None or group is not self.wg or batch.batch_size[0] != len(self.order):
            return group.call(method, batch, **options)
        out = group.call(method, batch[self.order], **options)
        return out[self.inverse] if isinstance(out, TensorDict) else out

    def groups(self) -> list[WorkerGroup]:
        """Every training worker group: the actor's, then the role pools'."""
        return [self.wg, *self.role_groups.values()]

    # ----- one RL step ---------------------------------------------------------------------
    def train_step(self) -> dict[str, float]:
        cfg, times = self.cfg, {}
        t_step = tick = time.perf_counter()

        def lap(name: str) -> None:
            nonlocal tick
            now = time.perf_counter()
            times[f"time/{name}_s"] = now - tick
            tick = now

        n = cfg.batch.samples_per_prompt
        self.reward_seconds = 0.0
        rounds = self.take_batch()
        if self.wants_ahead():  # before the update: this step's weights sample the next batch
            self.start_ahead()
        samples = [s for r in rounds for s in r.kept]
        batch = samples_to_batch(samples, self.tok.pad_token_id, n, self.multi_turn)
        # one group id per prompt of the step (a prompt drawn twice forms two groups)
        batch["uid"] = group_ids(samples, n)
        lap("generate")
        metrics: dict[str, float] = staleness_metrics(samples, self.step)
        metrics.update(self.balance(batch))
        if self.stream is not None:
            from tephra.controller.async_stream import partial_rollout_metrics

            metrics.update(self.stream.metrics())
            if cfg.trainer.partial_rollout:
                metrics.update(partial_rollout_metrics(samples))
        forward_passes = 0
        if self.needs_ref:
            batch["ref_log_probs"] = self.on_ranks("compute_ref_log_probs", batch, "ref")[
                "log_probs"
            ]
            forward_passes += 1
            lap("ref")
        if self.needs_critic:
            batch["values"] = self.on_ranks("compute_values", batch, "critic")["values"]
            forward_passes += 1
            lap("values")
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
        metrics.update(corr_metrics)
        check_mismatch_alarm(corr_metrics, cfg.algorithm.mismatch_alarm_kl, self.step + 1)
        if token_stats and "sum_pi_squared" not in batch.keys():
            # a mode that replaces the old log-probs (bypass) ran no trainer pass: sum pi^2
            # comes from the trainer's weights, which are the sampling policy's on-policy
            batch["sum_pi_squared"] = self.on_ranks(
                "compute_log_probs", batch, sum_pi_squared=True
            )["sum_pi_squared"]
            passes += 1
        if passes:
            forward_passes += passes
            lap("old_log_probs")
        if not all(r.scored for r in rounds):
            self.attach_scores(samples)
        times["time/reward_s"] = self.reward_seconds
        lap("reward_wait")
        names = [name for r in rounds for name in r.kept_names()]
        # before float32: a float64 score of 1e308 would already be inf there
        check_rewards([s.score for s in samples], names, cfg.reward.max_abs)
        raw = torch.tensor([s.score for s in samples], dtype=torch.float32)
        shaping = self.length_shaping(samples)
        scores = raw + shaping
        batch["rewards"] = scores
        token_rewards = outcome_token_rewards(scores, batch["response_mask"])
        if cfg.algorithm.kl_in_reward.enabled:
            token_rewards, kl_metrics = self.kl_reward(batch, token_rewards)
            metrics.update(kl_metrics)
        baselines = None
        if cfg.algorithm.needs("baselines"):
            baselines = self.greedy_baselines(rounds)
            metrics["reward/greedy_baseline_mean"] = float(baselines.mean())
            lap("baselines")
        self.advantages(batch, token_rewards, baselines, self.reward_components(samples))
        check_advantages(batch["advantages"], batch["response_mask"], names)
        apply_rejection(batch)
        if self.skips_flat:  # the workers leave these groups out of the actor update
            metrics["actor/skipped_flat_groups"] = float(flat_groups(batch))
        every = cfg.trainer.dump_generations
        if every and (self.step + 1) % every == 0:
            self.dump_train(samples, batch)
        lap("advantages")
        trained_passes = 0
        if self.needs_critic:
            metrics.update(
                {
                    f"critic/{k.split('/')[-1]}": v
                    for k, v in self.on_ranks("update_critic", batch, "critic").items()
                }
            )
            trained_passes += cfg.batch.epochs
            lap("critic")
        metrics.update(
            {
                k if k.startswith("actor/") else f"actor/{k}": v
                for k, v in self.on_ranks("update_actor", batch).items()
            }
        )
        trained_passes += cfg.batch.epochs
        lap("actor")
        if self.ahead is not None:
            self.finish_ahead()
            lap("generate_wait")  # what the update did not hide of the next generation
        if self.replicas is not None:
            self.replicas.sync(self.wg, self.step + 1)
        else:
            self.wg.sync_weights()
        lap("sync")
        step_s = time.perf_counter() - t_step

        all_samples = [s for r in rounds for s in r.samples]
        resp_len = batch["response_mask"].sum(-1).float()
        total_tokens = int(batch["attention_mask"].sum())
        flops = step_flops(self.model, batch, forward_passes, trained_passes)
        metrics.update(
            {
                "reward/mean": float(scores.mean()),
                "reward/errors": float(sum(r.errors for r in rounds)),
                "reward/timeouts": float(sum(r.timeouts for r in rounds)),
                "reward/clipped": float(sum(r.clipped for r in rounds)),
                # over every sample generated this step (dropped groups included): the policy's
                # accuracy, not the filtered batch's
                "accuracy/train": sum(accuracy_of(s.score) for s in all_samples) / len(all_samples),
                "response/length_mean": float(resp_len.mean()),
                "response/clip_frac": sum(s.finish_reason == "length" for s in samples)
                / len(samples),
                "perf/tokens_per_s": total_tokens / step_s,
                "perf/trained_tokens": float(batch["response_mask"].sum()),
                "perf/flops": float(flops),
                ("perf/mfu" if self.peak_published else "perf/mfu_measured_peak"): (
                    flops / step_s / self.peak_flops if self.peak_flops else 0.0
                ),
                "time/step_s": step_s,
                **times,
            }
        )
        if self.multi_turn:
            metrics.update(agent_metrics(samples))
        if cfg.algorithm.overlong_buffer:
            metrics["reward/overlong_penalty_mean"] = float(shaping.mean())
        if cfg.algorithm.dynamic_sampling:
            metrics.update(dynamic_sampling_metrics(rounds))
        if "actor/kl_mean" in metrics:
            metrics["actor/kl"] = metrics["actor/kl_mean"]
        return metrics

    # ----- checkpoints -----------------------------------------------------------------------
    def save(self) -> None:
        def write(folder: Path) -> None:
            for group in self.groups():
                group.save_checkpoint(str(folder))
            if self.pending is not None:  # the samples themselves: resuming needs no old weights
                (folder / PENDING_FILE).write_text(
                    json.dumps([round_to_dict(r) for r in self.pending])
                )

        self.ckpt.save(
            self.step, write, {"loader": self.loader.state_dict(), "kl_coef": self.kl_ctrl.value}
        )

    def maybe_resume(self, resume: str | None = None) -> bool:
        t = self.cfg.trainer
        latest = (
            self.ckpt.resolve(resume)
            if resume is not None
            else self.ckpt.resolve(t.resume, t.resume_from)
        )
        if latest is None:
            return False
        state = self.ckpt.load_trainer_state(latest)
        for group in self.groups():
            group.load_checkpoint(str(latest))
        if self.replicas is not None:
            self.replicas.sync(self.wg, int(state["step"]))
        self.loader.load_state_dict(state["loader"])
        self.kl_ctrl.value = float(state.get("kl_coef", self.kl_ctrl.value))
        self.step = int(state["step"])
        pending = latest / PENDING_FILE
        self.pending = (
            [
                round_from_dict(r, self.items(r["indices"], self.train, r["tag"]))
                for r in json.loads(pending.read_text())
            ]
            if pending.exists()
            else None
        )
        self.ahead = None
        print(f"resumed from {latest} at step {self.step}", flush=True)
        return True

    def measure_peak_flops(self) -> float:
        """The MFU denominator: the summed peak of every training rank (published where every
        rank's device has a figure, else measured; `peak_published` says which)."""
        peaks = [peak for group in self.groups() for peak in group.peak_flops()]
        self.peak_published = all(published for _, published in peaks)
        return float(sum(flops for flops, _ in peaks))

    # ----- recovery ---------------------------------------------------------------------------
    def close_group(self, grace_s: float = 10.0) -> None:
        """Close the rollout replicas and the worker groups; `grace_s`: how long the ranks get
        to exit on their own before they are killed (0 for a group that has failed)."""
        try:
            if self.replicas is not None:
                self.replicas.close()
            for group in self.groups():
                group.close()
        except Exception:  # noqa: BLE001  (a dead group cannot close; shutdown still runs)
            pass
        finally:
            for group in self.groups():
                group.shutdown(grace_s)

    def recover(self, exc: BaseException) -> None:
        """A worker died: tear the group down, build it again and continue from the latest
        intact checkpoint (or from the start when there is none), at most
        `trainer.max_restarts` times."""
        self.restarts += 1
        if self.make_group is None or self.restarts > self.cfg.trainer.max_restarts:
            raise exc
        origin = getattr(exc, "cause", None) or exc  # a worker's own exception inside Ray's
        cause = str(origin).strip().splitlines()[0] if str(origin).strip() else ""
        print(
            f"worker group failed at step {self.step + 1} ({type(origin).__name__}: {cause}); "
            f"restart {self.restarts} of {self.cfg.trainer.max_restarts}",
            flush=True,
        )
        self.close_group(grace_s=0)  # its live ranks may be stuck in a collective
        self.wg = self.make_group()
        self.role_groups = self.make_role_groups() if self.make_role_groups else {}
        self.replicas = None  # closed with the group; connected again below
        self.peak_flops = self.measure_peak_flops()
        self.ahead = None  # a generation ahead died with the group
        if not self.maybe_resume(resume="auto"):
            self.step = 0
            self.pending = None
            self.loader = PromptLoader(
                len(self.train.ids),
                self.cfg.batch.prompts_per_step,
                self.cfg.trainer.seed,
                self.data_fingerprint,
            )
        if self.make_replicas is not None:
            self.connect_replicas()

    # ----- the run ----------------------------------------------------------------------------
    def fit(self) -> dict[str, Any]:
        cfg, t0 = self.cfg.trainer, time.perf_counter()
        resumed = self.maybe_resume()
        trackers = Trackers(
            cfg.trackers, self.run_dir, cfg.project, self.run_dir.name, to_dict(self.cfg)
        )
        acc_before = None
        what = "greedy accuracy" if cfg.val.n == 1 else f"acc@{cfg.val.n}"
        if cfg.val_before and not resumed:
            t = time.perf_counter()
            acc_before, val_metrics = self.evaluate()
            trackers.log({"accuracy/val": acc_before, **val_metrics}, self.step)
            print(
                f"held-out {what} before training: {acc_before:.3f} "
                f"({len(self.val.ids)} items, {time.perf_counter() - t:.0f} s)",
                flush=True,
            )
        bar = None
        if cfg.progress_bar:
            from tqdm import tqdm

            bar = tqdm(total=cfg.steps, initial=self.step, desc="steps", dynamic_ncols=True)
        while self.step < cfg.steps:
            profiling = self.step + 1 in cfg.profile_steps
            if profiling:
                for group in self.groups():
                    group.set_profile(str(self.run_dir / "profile" / f"step{self.step + 1}"))
            try:
                metrics = self.train_step()
            except WORKER_FAILURES as exc:
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
                self.save()
        if bar is not None:
            bar.close()
        if cfg.save_final and (not cfg.save_every or self.step % cfg.save_every):
            self.save()
        acc_after = None
        if cfg.val_after:
            t = time.perf_counter()
            acc_after, val_metrics = self.evaluate()
            trackers.log({"accuracy/val": acc_after, **val_metrics}, self.step)
            print(
                f"held-out {what} after training: {acc_after:.3f} "
                f"({len(self.val.ids)} items, {time.perf_counter() - t:.0f} s)",
                flush=True,
            )
        trackers.close()
        if cfg.export_hf:
            self.wg.export_hf(str(self.run_dir / "hf"))
        summary = {
            "accuracy_before": acc_before,
            "accuracy_after": acc_after,
            "steps": self.step,
            "seconds": round(time.perf_counter() - t0, 1),
            "run_dir": str(self.run_dir),
            "startup": self.startup,
        }
        if "jsonl" in cfg.trackers:
            records = read_jsonl(self.run_dir / "metrics.jsonl")
            if records:
                plot_curves(records, self.run_dir / "curves.png")
                summary["time_share"] = time_share(records)
                print(format_time_share(summary["time_share"]), flush=True)
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        return summary
