"""SPIN's step parts: the chosen / rejected pairs of a step's batch, the checks that its data
and options allow it, and its dumped pairs.

Each sample the policy generated is the rejected response of one pair; its prompt's reference
answer (the data's `reward_model.ground_truth`, rendered as the response an assistant would
give: its tokens, then the end-of-sequence token) is the chosen one. The two rows of a pair
are consecutive and share a `keep_together` id, so every split of the batch keeps them in one
micro-batch (`tephra.engine_api.batch.KEEP_TOGETHER`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from tensordict import TensorDict

from tephra.algos import SPIN_CHOSEN
from tephra.controller.data import PromptRecord
from tephra.controller.samples import Sample, samples_to_batch
from tephra.core.errors import ConfigError
from tephra.engine_api.batch import KEEP_TOGETHER

if TYPE_CHECKING:
    from tephra.controller.rl_config import PPOConfig

SOURCES_WITHOUT_ANSWERS = {
    "code_problems": "its ground truth is a list of tests, not an answer",
}


def reference_response(tokenizer: Any, record: PromptRecord) -> list[int]:
    """The chosen response of a prompt: its reference answer's tokens, then end-of-sequence."""
    ids = tokenizer.encode(str(record.ground_truth), add_special_tokens=False)
    eos = tokenizer.eos_token_id
    return list(ids) + ([eos] if eos is not None else [])


def pair_samples(
    samples: list[Sample], records: list[PromptRecord], tokenizer: Any
) -> list[Sample]:
    """[chosen_0, rejected_0, chosen_1, rejected_1, ...]: each generated sample (rejected)
    after its prompt's reference answer (chosen); `records[i]` is sample i's prompt record.
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
    samples: list[Sample], records: list[PromptRecord], tokenizer: Any
) -> tuple[TensorDict, list[Sample]]:
    """The step's training batch of pairs (`pair_samples`): `keep_together` = the pair's
    index, `spin_chosen` 1.0 on the chosen row, `uid` = the pair's index; and the pairs."""
    pairs = pair_samples(samples, records, tokenizer)
    batch = samples_to_batch(pairs, tokenizer.pad_token_id, 2, False)
    index = torch.arange(len(pairs), dtype=torch.int64) // 2
    batch[KEEP_TOGETHER] = index
    batch["uid"] = index
    batch[SPIN_CHOSEN] = (torch.arange(len(pairs)) % 2 == 0).to(torch.float32)
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
                "score": None if i % 2 == 0 else s.score,
            }
            f.write(json.dumps(row) + "\n")


def check_spin(cfg: PPOConfig) -> None:
    """SPIN's options agree with the rest of the config (before Ray starts)."""
    a, b = cfg.algorithm, cfg.batch
    if not a.spin.enabled:
        return
    why = SOURCES_WITHOUT_ANSWERS.get(cfg.data.source)
    if why is not None or cfg.data.has_images:
        raise ConfigError(
            f"algorithm.spin needs a reference answer per prompt as the chosen response, but "
            f"data.source={cfg.data.source!r} has none ({why or 'image prompts'}); use "
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


def check_reference_answers(cfg: PPOConfig, records: list[PromptRecord], where: str) -> None:
    """Every training prompt has a reference answer (SPIN's chosen response), else refuse
    naming the first row without one."""
    if not cfg.algorithm.spin.enabled:
        return
    for i, r in enumerate(records):
        if r.ground_truth is None or str(r.ground_truth).strip() == "":
            raise ConfigError(
                f"row {i} of {where}: algorithm.spin needs its reward_model.ground_truth as the "
                "chosen response, but it is empty; fill it in or drop the row"
            )
