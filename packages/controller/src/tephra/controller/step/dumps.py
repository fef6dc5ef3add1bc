"""The JSONL records of what a run generated (`trainer.dump_generations`): validation rows, and
the trained samples with their tokens, rewards, advantages and weight versions."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from tensordict import TensorDict

from tephra.controller.run.evaluation import EvalRow
from tephra.controller.samples import Sample
from tephra.episodes.prompt import Prompt


def validation_rows(
    samples: list[Sample], tokenizer: Any, records: list[Prompt], n: int
) -> list[EvalRow]:
    """The validation samples (prompt-major, `n` per prompt of `records`) as EvalRows."""
    return [
        EvalRow(
            prompt=tokenizer.decode(s.prompt_ids, skip_special_tokens=True),
            response=s.text,
            score=s.reward.score,
            ground_truth=records[k // n].ground_truth,
            data_source=records[k // n].data_source,
            answer=s.text.strip(),
            prompt_index=k // n,
        )
        for k, s in enumerate(samples)
    ]


def write_train_samples(
    path: Path, samples: list[Sample], batch: TensorDict, tokenizer: Any, n: int
) -> None:
    """A step's trained samples with their tokens, rewards and advantages, as JSONL."""
    mask = batch["response_mask"].bool()
    advantages = [
        float(batch["advantages"][i][mask[i]].mean()) if mask[i].any() else 0.0
        for i in range(len(samples))
    ]
    rows = [
        EvalRow(
            prompt=tokenizer.decode(s.prompt_ids, skip_special_tokens=True),
            response=s.text,
            score=s.reward.score,
            ground_truth=None,
            data_source="",
            answer=s.text.strip(),
            prompt_index=k // n,
            advantage=a,
        )
        for k, (s, a) in enumerate(zip(samples, advantages))
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:  # EvalRow plus the tokens and the generating weights' version(s)
        for row, s in zip(rows, samples):
            versions = {} if s.token_versions is None else {"token_versions": s.token_versions}
            tokens = {
                "prompt_ids": s.prompt_ids,
                "response_ids": s.response_ids,
                "response_mask": s.response_mask,
                "finish_reason": s.finish_reason,
                # the rollout's own log-prob of each response token (None where it gives none)
                "rollout_log_probs": s.log_probs,
            }
            f.write(
                json.dumps(
                    {**asdict(row), **tokens, "weight_version": s.weight_version, **versions},
                    default=str,
                )
                + "\n"
            )
