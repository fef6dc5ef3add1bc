"""The RL loop. Each stage is one call on the worker group; the driver only moves batches.

    for step in steps:
        batch   = generate(prompts)                       # rollout engine, n samples/prompt
        rewards = score(batch)                            # rule scorer by data_source
        ref     = wg.compute_ref_log_probs(batch)         # if a KL term is configured
        values  = wg.compute_values(batch)                # if the estimator needs a critic
        adv     = compute_advantages(estimator, ...)      # tephra.algos
        wg.update_critic(batch); wg.update_actor(batch)   # mini-batches x epochs
        wg.sync_weights()                                 # actor -> rollout engine

With `rollout.agent_loop` set, `generate` is `wg.generate_agent`: each prompt is sent n times
to the agent loop (multi-turn, tools between turns), and the batch's response_mask is 0 on the
tokens the tools wrote, so the loss trains only the model's own tokens.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDict

from tephra.apps.ppo.config import PPOConfig
from tephra.controller.checkpoints import CheckpointManager
from tephra.core.config import to_dict
from tephra.controller.data import PromptLoader, PromptRecord
from tephra.controller.rewarding import Scorer, accuracy_of
from tephra.controller.trackers import Trackers, plot_curves, read_jsonl
from tephra.controller.worker_group import WorkerGroup


@dataclass
class Prompts:
    ids: list[list[int]]
    records: list[PromptRecord]


@dataclass
class Round:
    """One round of generation in a step: its samples and scores (prompt-major, `n` samples
    per prompt) and which prompt groups the step trains on."""

    samples: list[dict]
    scores: list[float]
    errors: int
    n: int
    kept_groups: list[int] = field(default_factory=list)
    informative: int = 0
    """Groups whose samples did not all score the same (dynamic sampling)."""
    filler: int = 0
    """How many of the kept groups are flat ones added to fill the batch."""

    @property
    def n_groups(self) -> int:
        return len(self.samples) // self.n

    def keep(self, groups: list[int], filler: bool = False) -> None:
        self.kept_groups = sorted(set(self.kept_groups) | set(groups))
        self.filler += len(groups) if filler else 0

    def _rows(self) -> list[int]:
        return [g * self.n + k for g in self.kept_groups for k in range(self.n)]

    @property
    def kept(self) -> list[dict]:
        return [self.samples[i] for i in self._rows()]

    @property
    def kept_scores(self) -> list[float]:
        return [self.scores[i] for i in self._rows()]


def dynamic_sampling_metrics(rounds: list[Round]) -> dict[str, float]:
    """`dapo/*`: generation rounds, prompt groups generated, flat ones among them (all samples
    scored the same), and flat groups trained on to fill the batch (0 when enough came)."""
    generated = sum(r.n_groups for r in rounds)
    return {"dapo/gen_rounds": float(len(rounds)),
            "dapo/groups_generated": float(generated),
            "dapo/groups_flat": float(generated - sum(r.informative for r in rounds)),
            "dapo/groups_filled": float(sum(r.filler for r in rounds))}


def outcome_token_rewards(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """[B] scores -> [B, T] with the score on each sample's last response token."""
    mask = response_mask.long()
    last = (mask * torch.arange(mask.shape[1])).argmax(-1)
    out = torch.zeros(mask.shape, dtype=torch.float32)
    has = mask.sum(-1) > 0
    out[has, last[has]] = scores[has].float()
    return out


class Trainer:
    def __init__(self, cfg: PPOConfig, wg: WorkerGroup, tokenizer: Any, train: Prompts,
                 val: Prompts, run_dir: Path, n_params: int, peak_flops: float) -> None:
        from tephra.rollout.base import SamplingParams

        self.cfg, self.wg, self.tok, self.train, self.val = cfg, wg, tokenizer, train, val
        self.run_dir = run_dir
        self.scorer = Scorer(cfg.reward.custom_function_path, cfg.reward.custom_function_name)
        self.loader = PromptLoader(len(train.ids), cfg.batch.prompts_per_step, cfg.trainer.seed)
        self.ckpt = CheckpointManager(run_dir / "checkpoints", cfg.trainer.keep_checkpoints)
        self.n_params, self.peak_flops = n_params, peak_flops
        self.needs_critic = cfg.algorithm.adv_estimator == "gae"
        self.needs_ref = cfg.algorithm.kl_coef > 0
        stops = tuple(t for t in {tokenizer.eos_token_id} if t is not None)
        r = cfg.rollout
        self.sampling = SamplingParams(n=cfg.batch.samples_per_prompt, temperature=r.temperature,
                                       top_p=r.top_p, top_k=r.top_k, max_tokens=r.max_tokens,
                                       stop_token_ids=stops)
        self.greedy = SamplingParams(n=1, temperature=0.0, max_tokens=r.max_tokens,
                                     stop_token_ids=stops, logprobs=False)
        self.agent = cfg.rollout.uses_agent_loop
        self.step = 0

    # ----- stages ------------------------------------------------------------------------
    def generate(self, ids: list[list[int]], sampling, records: list[PromptRecord] | None = None,
                 tag: str = "") -> tuple[TensorDict, list[dict]]:
        """Samples of `ids` (prompt-major, `sampling.n` each) as a padded batch and per-sample
        dicts; through the agent loop when one is configured (`records` give its messages,
        `tag` makes its sample ids unique in the run)."""
        samples = self.sample(ids, sampling, records, tag)
        return self.to_batch(samples, sampling.n), samples

    def sample(self, ids: list[list[int]], sampling, records: list[PromptRecord] | None,
               tag: str) -> list[dict]:
        if not self.agent:
            return self.wg.generate(ids, sampling)
        n = sampling.n
        requests = [{"messages": rec.prompt, "prompt_ids": p, "sample_id": f"{tag}-{j}-{k}"}
                    for j, (p, rec) in enumerate(zip(ids, records, strict=True)) for k in range(n)]
        return self.wg.generate_agent(requests, sampling.replace(n=1))

    def to_batch(self, samples: list[dict], n: int) -> TensorDict:
        """Prompt-major samples (`n` per prompt) as the padded batch of tephra.engine_api."""
        from tephra.rollout.base import RolloutOutput

        if self.agent:
            return agent_batch(samples, self.tok.pad_token_id, n)
        out = RolloutOutput(
            prompt_index=[i // n for i in range(len(samples))],
            prompt_ids=[s["prompt_ids"] for s in samples],
            response_ids=[s["response_ids"] for s in samples],
            log_probs=[s["log_probs"] for s in samples] if samples[0]["log_probs"] is not None else None,
            finish_reasons=[s["finish_reason"] for s in samples])
        return out.to_batch(self.tok.pad_token_id)

    def score(self, samples: list[dict], records: list[PromptRecord]) -> tuple[list[float], int]:
        # Agent trajectories are scored on their final answer (the last assistant message,
        # decoded by the worker); tool outputs and earlier tool-call turns are not scored.
        texts = [s["answer"] if "answer" in s
                 else self.tok.decode(s["response_ids"], skip_special_tokens=True)
                 for s in samples]
        return self.scorer.score(texts, records)

    def evaluate(self) -> float:
        """Greedy accuracy on the held-out prompts (the same items every time)."""
        ws = self.wg.world_size
        ids = list(self.val.ids)
        pad = (-len(ids)) % ws  # the split needs equal shares; the padding is not scored
        records = list(self.val.records)
        _, samples = self.generate(ids + ids[:pad], self.greedy, records + records[:pad],
                                   tag=f"val{self.step}")
        scores, _ = self.score(samples[: len(ids)], self.val.records)
        return sum(accuracy_of(s) for s in scores) / len(scores)

    def advantages(self, batch: TensorDict, scores: torch.Tensor) -> None:
        from tephra.algos import AdvantageConfig, compute_advantages

        a = self.cfg.algorithm
        token_rewards = outcome_token_rewards(scores, batch["response_mask"])
        adv, ret = compute_advantages(
            a.adv_estimator, token_rewards=token_rewards, response_mask=batch["response_mask"],
            group_ids=batch["uid"], values=batch["values"] if self.needs_critic else None,
            config=AdvantageConfig(gamma=a.gamma, lam=a.lam, norm_by_std=a.norm_adv_by_std))
        batch["advantages"], batch["returns"] = adv.float(), ret.float()

    def collect(self) -> list[Round]:
        """This step's rounds of generation. Without dynamic sampling: one round of
        `batch.prompts_per_step` prompts. With `algorithm.dynamic_sampling` (DAPO): groups whose
        samples all got the same score (zero group-relative advantage) are dropped, and further
        rounds are generated until `prompts_per_step` groups are kept or
        `algorithm.max_gen_batches` rounds ran; a batch still short is filled with the dropped
        groups of the last rounds (they carry no advantage) so its size never changes."""
        from tephra.algos import filter_groups

        cfg, n = self.cfg, self.cfg.batch.samples_per_prompt
        want = cfg.batch.prompts_per_step
        rounds: list[Round] = []
        kept_groups = 0
        while True:
            r = len(rounds)
            idx = self.loader.next_indices()
            # round 0 keeps the seed of a run without dynamic sampling
            seed = cfg.trainer.seed * 1_000_003 + self.step + r * 100_003
            tag = f"step{self.step}" if r == 0 else f"step{self.step}r{r}"
            records = [self.train.records[i] for i in idx]
            samples = self.sample([self.train.ids[i] for i in idx],
                                  self.sampling.replace(seed=seed), records, tag)
            scores, errors = self.score(samples, [records[k // n] for k in range(len(samples))])
            rnd = Round(samples, scores, errors, n)
            rounds.append(rnd)
            if not cfg.algorithm.dynamic_sampling:
                rnd.keep(list(range(len(idx))))
                return rounds
            keep, _ = filter_groups(torch.tensor(scores, dtype=torch.float32),
                                    torch.arange(len(samples)) // n)
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

    def length_shaping(self, samples: list[dict]) -> torch.Tensor:
        """DAPO's soft overlong punishment added to each kept sample's score ([B]; zeros when
        `algorithm.overlong_buffer` is 0), from the full response length (tool tokens count)."""
        from tephra.algos import overlong_penalty

        a = self.cfg.algorithm
        if not a.overlong_buffer:
            return torch.zeros(len(samples))
        lengths = torch.tensor([len(s["response_ids"]) for s in samples])
        return overlong_penalty(lengths, self.cfg.rollout.response_budget, a.overlong_buffer,
                                a.overlong_penalty_factor)

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
        rounds = self.collect()
        samples = [s for r in rounds for s in r.kept]
        batch = self.to_batch(samples, n)
        lap("generate")
        raw = torch.tensor([x for r in rounds for x in r.kept_scores], dtype=torch.float32)
        shaping = self.length_shaping(samples)
        scores = raw + shaping
        batch["rewards"] = scores
        # one group id per prompt of the step (a prompt drawn twice forms two groups)
        batch["uid"] = torch.arange(len(samples), dtype=torch.int64) // n
        all_scores = [x for r in rounds for x in r.scores]
        errors = sum(r.errors for r in rounds)
        lap("reward")
        if self.needs_ref:
            batch["ref_log_probs"] = self.wg.compute_ref_log_probs(batch)["log_probs"]
            lap("ref")
        if self.needs_critic:
            batch["values"] = self.wg.compute_values(batch)["values"]
            lap("values")
        if cfg.batch.mini_batches > 1 or cfg.batch.epochs > 1:
            batch["old_log_probs"] = self.wg.compute_log_probs(batch)["log_probs"]
            lap("old_log_probs")
        self.advantages(batch, scores)
        lap("advantages")
        metrics: dict[str, float] = {}
        if self.needs_critic:
            metrics.update({f"critic/{k.split('/')[-1]}": v
                            for k, v in self.wg.update_critic(batch).items()})
            lap("critic")
        metrics.update({k if k.startswith("actor/") else f"actor/{k}": v
                        for k, v in self.wg.update_actor(batch).items()})
        lap("actor")
        self.wg.sync_weights()
        lap("sync")
        step_s = time.perf_counter() - t_step

        resp_len = batch["response_mask"].sum(-1).float()
        total_tokens = int(batch["attention_mask"].sum())
        trained = int(batch["response_mask"].sum())
        # Model FLOPs: 2 N per token forward (generation and scoring), 6 N per token trained.
        flops = 2 * self.n_params * total_tokens + 6 * self.n_params * total_tokens * cfg.batch.epochs
        metrics.update({
            "reward/mean": float(scores.mean()),
            "reward/errors": float(errors),
            # over every sample generated this step (dropped groups included): the policy's
            # accuracy, not the filtered batch's
            "accuracy/train": sum(accuracy_of(s) for s in all_scores) / len(all_scores),
            "response/length_mean": float(resp_len.mean()),
            "response/clip_frac": sum(s["finish_reason"] == "length" for s in samples) / len(samples),
            "perf/tokens_per_s": total_tokens / step_s,
            "perf/trained_tokens": float(trained),
            "perf/mfu": flops / step_s / self.peak_flops if self.peak_flops else 0.0,
            "time/step_s": step_s,
            **times,
        })
        if self.agent:
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
        folder = self.ckpt.step_dir(self.step)
        folder.mkdir(parents=True, exist_ok=True)
        self.wg.save_checkpoint(str(folder))
        self.ckpt.save_trainer_state(self.step, {"loader": self.loader.state_dict()})

    def maybe_resume(self) -> bool:
        latest = self.ckpt.latest() if self.cfg.trainer.resume else None
        if latest is None:
            return False
        state = self.ckpt.load_trainer_state(latest)
        self.wg.load_checkpoint(str(latest))
        self.loader.load_state_dict(state["loader"])
        self.step = int(state["step"])
        print(f"resumed from {latest} at step {self.step}", flush=True)
        return True

    # ----- the run ----------------------------------------------------------------------------
    def fit(self) -> dict[str, Any]:
        cfg, t0 = self.cfg.trainer, time.perf_counter()
        resumed = self.maybe_resume()
        trackers = Trackers(cfg.trackers, self.run_dir, cfg.project, self.run_dir.name,
                            to_dict(self.cfg))
        acc_before = None
        if cfg.val_before and not resumed:
            t = time.perf_counter()
            acc_before = self.evaluate()
            trackers.log({"accuracy/val": acc_before}, self.step)
            print(f"held-out greedy accuracy before training: {acc_before:.3f} "
                  f"({len(self.val.ids)} items, {time.perf_counter() - t:.0f} s)", flush=True)
        bar = None
        if cfg.progress_bar:
            from tqdm import tqdm

            bar = tqdm(total=cfg.steps, initial=self.step, desc="steps", dynamic_ncols=True)
        while self.step < cfg.steps:
            metrics = self.train_step()
            self.step += 1
            if cfg.val_every and self.step % cfg.val_every == 0 and self.step < cfg.steps:
                metrics["accuracy/val"] = self.evaluate()
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
            acc_after = self.evaluate()
            trackers.log({"accuracy/val": acc_after}, self.step)
            print(f"held-out greedy accuracy after training: {acc_after:.3f} "
                  f"({len(self.val.ids)} items, {time.perf_counter() - t:.0f} s)", flush=True)
        trackers.close()
        if cfg.export_hf:
            self.wg.export_hf(str(self.run_dir / "hf"))
        summary = {"accuracy_before": acc_before, "accuracy_after": acc_after,
                   "steps": self.step, "seconds": round(time.perf_counter() - t0, 1),
                   "run_dir": str(self.run_dir)}
        if "jsonl" in cfg.trackers:
            records = read_jsonl(self.run_dir / "metrics.jsonl")
            if records:
                plot_curves(records, self.run_dir / "curves.png")
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        return summary


def agent_batch(samples: list[dict], pad_token_id: int, n: int) -> TensorDict:
    """The worker's trajectory records (`tephra.controller.rl_worker.trajectory_record`,
    prompt-major, n per prompt) as the padded batch of `trajectories_to_batch`: response_mask
    1 on model tokens only, plus num_turns / tool_calls / tool_errors [B] and prompt_index [B]."""
    from tephra.rollout.agent import Trajectory, trajectories_to_batch

    trajectories = [
        Trajectory(s["sample_id"], s["prompt_ids"], s["response_ids"], s["response_mask"],
                   s["log_probs"], s["num_turns"], s["tool_calls"], s["tool_errors"],
                   s["finish_reason"], [], tool_rewards=s["tool_rewards"])
        for s in samples]
    batch = trajectories_to_batch(trajectories, pad_token_id)
    batch["prompt_index"] = torch.tensor([i // n for i in range(len(samples))], dtype=torch.int64)
    return batch


def agent_metrics(samples: list[dict]) -> dict[str, float]:
    """Per-step agent-loop statistics from the worker's trajectory records:
    turns, tool calls and tool errors per trajectory (means), and token counts: generated
    (response_mask 1, trained) and tool (response tokens the tools wrote, mask 0)."""
    num = len(samples)
    generated = sum(sum(s["response_mask"]) for s in samples)
    total = sum(len(s["response_ids"]) for s in samples)
    return {
        "agent/turns_mean": sum(s["num_turns"] for s in samples) / num,
        "agent/tool_calls_mean": sum(s["tool_calls"] for s in samples) / num,
        "agent/tool_errors_mean": sum(s["tool_errors"] for s in samples) / num,
        "agent/generated_tokens": float(generated),
        "agent/tool_tokens": float(total - generated),
        "agent/finish_stop_frac": sum(s["finish_reason"] == "stop" for s in samples) / num,
    }


def measure_peak_flops(seconds: float = 0.3) -> float:
    """A rough per-process peak: fp32 matmul throughput of this CPU (GPUs: use the spec)."""
    if torch.cuda.is_available():
        return 989e12  # H100 dense bf16
    a = torch.randn(512, 512)
    done, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a @ a
        done += 1
    return 2 * 512**3 * done / (time.perf_counter() - t0) if done else math.nan
