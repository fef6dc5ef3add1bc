"""SPIN (self-play fine-tuning, Chen et al. 2024) as a recipe: the step trains on pairs, each
prompt's reference answer (chosen) before the policy's own sample (rejected), with a DPO-style
loss against an opponent, the `spin_reference` engine, that becomes a copy of the actor every
`algorithm.spin.refresh_every` steps.

The reference answer is the data's `reward_model.ground_truth`, rendered as the response an
assistant would give: its tokens, then the end-of-sequence token. The two rows of a pair are
consecutive and share a `keep_together` id, so every split of the batch keeps them in one
micro-batch (`tephra.engine_api.batch.KEEP_TOGETHER`). The pair maths is
`tephra.algos.self_play`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from tensordict import TensorDict

from tephra.algos import SpinObjective, spin_pair_columns
from tephra.controller.recipes.base import RECIPES, EngineRole, LossFn, Recipe, StepState
from tephra.controller.samples import Sample, samples_to_batch
from tephra.core.errors import ConfigError
from tephra.episodes.prompt import Prompt

if TYPE_CHECKING:
    from tephra.controller.config.tree import PPOConfig

SOURCES_WITHOUT_ANSWERS = {
    "code_problems": "its ground truth is a list of tests, not an answer",
    "swe_tasks": "its reward comes from a repository's tests, not an answer",
}


def reference_response(tokenizer: Any, record: Prompt) -> list[int]:
    """The chosen response of a prompt: its reference answer's tokens, then end-of-sequence."""
    ids = tokenizer.encode(str(record.ground_truth), add_special_tokens=False)
    eos = tokenizer.eos_token_id
    return list(ids) + ([eos] if eos is not None else [])


def pair_samples(samples: list[Sample], records: list[Prompt], tokenizer: Any) -> list[Sample]:
    """[chosen_0, rejected_0, chosen_1, rejected_1, ...]: each generated sample (rejected)
    after its prompt's reference answer (chosen); `records[i]` is sample i's prompt.
    The chosen rows carry log-probs 0 (no rollout sampled them; SPIN reads none)."""
    out: list[Sample] = []
    for sample, record in zip(samples, records, strict=True):
        chosen = reference_response(tokenizer, record)
        out.append(
            Sample(
                prompt_ids=sample.prompt_ids,
                response_ids=chosen,
                log_probs=[0.0] * len(chosen),
                text=str(record.ground_truth),
                sample_id=sample.sample_id,
                weight_version=sample.weight_version,
                prompt_index=sample.prompt_index,
            )
        )
        out.append(sample)
    return out


def spin_batch(
    samples: list[Sample], records: list[Prompt], tokenizer: Any
) -> tuple[TensorDict, list[Sample]]:
    """The step's training batch of pairs (`pair_samples`, with `spin_pair_columns`) and the
    pairs; its advantages are 0 (SPIN's loss reads none)."""
    pairs = pair_samples(samples, records, tokenizer)
    batch = samples_to_batch(pairs, tokenizer.pad_token_id, 2, False)
    for key, column in spin_pair_columns(len(pairs)).items():
        batch[key] = column
    batch["advantages"] = torch.zeros_like(batch["response_mask"], dtype=torch.float32)
    return batch, pairs


def write_pairs(path: Path, pairs: list[Sample], tokenizer: Any) -> None:
    """One JSON line per row of the step's pairs: prompt and response ids and text, whether
    it is the chosen row, its pair index, and the reward of the policy's sample."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for i, s in enumerate(pairs):
            row = {
                "pair": i // 2,
                "chosen": i % 2 == 0,
                "prompt_ids": s.prompt_ids,
                "response_ids": s.response_ids,
                "prompt": tokenizer.decode(s.prompt_ids),
                "response": tokenizer.decode(s.response_ids),
                "score": None if i % 2 == 0 else s.reward.score,
            }
            f.write(json.dumps(row) + "\n")


@RECIPES.register("spin")
class Spin(Recipe):
    """`algorithm.spin`: pairs in the batch, the pair loss for the actor, the opponent
    refreshed from the actor after the update."""

    name = "spin"
    trains_on_rewards = False

    @classmethod
    def enabled(cls, cfg: PPOConfig) -> bool:
        return cfg.algorithm.spin.enabled

    @classmethod
    def check(cls, cfg: PPOConfig) -> None:
        """SPIN's options agree with the rest of the config (before Ray starts)."""
        a, b = cfg.algorithm, cfg.batch
        if not a.spin.enabled:
            return
        why = SOURCES_WITHOUT_ANSWERS.get(cfg.data.source or "")
        if why is not None or cfg.data.has_images:
            raise ConfigError(
                f"algorithm.spin needs a reference answer per prompt as the chosen response, "
                f"but data.source={cfg.data.source!r} has none ({why or 'image prompts'}); use "
                "reasoning_gym or parquet rows with reward_model.ground_truth"
            )
        clash = {
            "algorithm.prime.enabled": a.prime.enabled,
            "algorithm.distillation.teacher_path": a.distillation.enabled,
            "algorithm.dynamic_sampling": a.dynamic_sampling,
            "algorithm.kl_in_reward.enabled": a.kl_in_reward.enabled,
            "actor.objective.use_kl_loss": cfg.actor.objective.use_kl_loss,
            "actor.lora.enabled": cfg.actor.lora.enabled,
            "actor.moe.routing_replay=rollout": cfg.actor.moe.replays,
            "rollout.agent_loop": cfg.rollout.uses_agent_loop,
            "a critic (algorithm.adv_estimator needs values)": a.needs("values"),
            "resources.ref.ranks > 0": cfg.resources.ref.ranks > 0,
            "trainer.mode != sync": cfg.trainer.mode != "sync",
            "trainer.critic_warmup": bool(cfg.trainer.critic_warmup),
        }
        on = [name for name, value in clash.items() if value]
        if on:
            raise ConfigError(
                f"algorithm.spin replaces the reward-based update with its pair loss against a "
                f"reference it refreshes from the actor in place; it does not combine with "
                f"{', '.join(on)}: turn those off"
            )
        pairs = b.samples_per_step
        shares = cfg.data_parallel_size() * b.mini_batches
        if pairs % shares:
            raise ConfigError(
                f"algorithm.spin: the step's {pairs} pairs (batch.prompts_per_step x "
                f"samples_per_prompt) must split whole into {shares} data-parallel ranks x "
                f"batch.mini_batches, since a pair's two rows train in one micro-batch; choose "
                f"prompts_per_step x samples_per_prompt a multiple of {shares}"
            )

    @classmethod
    def check_data(cls, cfg: PPOConfig, records: list[Prompt], where: str) -> None:
        """Every training prompt has a reference answer (the chosen response), else refuse
        naming the first row without one."""
        for i, r in enumerate(records):
            if r.ground_truth is None or str(r.ground_truth).strip() == "":
                raise ConfigError(
                    f"row {i} of {where}: algorithm.spin needs its reward_model.ground_truth as "
                    "the chosen response, but it is empty; fill it in or drop the row"
                )

    def roles(self) -> tuple[EngineRole, ...]:
        # the opponent starts as the policy and is saved with the run (it is not the policy
        # after its first refresh)
        return (EngineRole("spin_reference", "actor", checkpoint="spin_reference"),)

    def actor_loss(self) -> LossFn:
        return SpinObjective(self.cfg.algorithm.spin.beta)

    def after_generation(self, state: StepState) -> None:
        n = self.cfg.batch.samples_per_prompt
        records = [r.items[g] for r in state.rounds for g in r.kept_groups for _ in range(n)]
        state.batch, pairs = spin_batch(state.samples, records, state.tokenizer)
        state.dump = lambda path: write_pairs(path, pairs, state.tokenizer)

    def forward_passes(self, state: StepState) -> None:
        state.batch["ref_log_probs"] = state.engines.log_probs("spin_reference", state.batch)
        state.forward_passes += 1
        state.lap("ref")

    def after_update(self, state: StepState) -> None:
        # the next iteration: the model trained so far becomes the opponent
        refresh = (state.step + 1) % self.cfg.algorithm.spin.refresh_every == 0
        if refresh:
            state.engines.refresh("spin_reference", state.run_dir / "spin_reference")
        state.metrics["spin/reference_refreshed"] = float(refresh)
