"""The typed objects that travel between the driver and the workers.

    PromptItem   driver -> worker: one prompt to sample (token ids, its data record, an id)
    Sample       worker -> driver: one response (plain or multi-turn), scored on its rank,
                 tagged with the weight version that generated it (`tephra.rollout.Sample`,
                 the one per-sample type from the backend to the batch)
    ScoreResult  worker -> driver: one sample's reward (`collect_scores`)

A step's samples are prompt-major: prompt i's `n` samples are consecutive.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
from tensordict import TensorDict

from tephra.controller.data.prompts import PromptRecord
from tephra.engine_api.multimodal import MULTIMODAL, MultimodalInputs
from tephra.episodes.agent.environment_guard import ENVIRONMENT_ERROR
from tephra.episodes.agent.loops import TIMEOUTS
from tephra.rollout.samples import Sample, to_batch

__all__ = [
    "MULTIMODAL",
    "PromptItem",
    "Sample",
    "ScoreResult",
    "set_score",
    "agent_metrics",
    "group_ids",
    "record_payload",
    "sample_from_dict",
    "sample_to_dict",
    "samples_to_batch",
]


@dataclass
class PromptItem:
    """One prompt as the workers receive it."""

    prompt_ids: list[int]
    """The prompt rendered with the chat template, as token ids."""
    record: PromptRecord
    """Its data row: chat messages (the agent loop's input), data_source, ground truth."""
    sample_id: str = ""
    """Unique in the run (names the tool instances of an agent trajectory)."""
    multimodal: MultimodalInputs | None = None
    """The prompt's images (pixel values and grids), None for a text prompt."""


@dataclass(frozen=True)
class ScoreResult:
    """One sample's reward as a worker hands it back (`collect_scores`)."""

    score: float
    """The reward (0 when the scorer failed)."""
    error: str | None
    """The scorer's error for this sample, if it raised."""
    seconds: float
    """Seconds the worker's rank spent scoring its whole share (the same on each of them)."""
    clipped: bool
    """Whether `reward.clip` moved the score into its range."""
    extras: dict[str, float] = field(default_factory=dict)
    """The reward function's numeric dict entries beside "score" (e.g. {"format": 1.0,
    "accuracy": 0.0}); `algorithm.advantage.gdpo_reward_keys` picks GDPO's components here."""


def set_score(sample: Sample, result: ScoreResult) -> None:
    """Set `sample`'s reward fields from its `collect_scores` entry."""
    sample.score, sample.reward_error = float(result.score), result.error
    sample.reward_clipped = result.clipped
    sample.reward_extras = dict(result.extras)


def samples_to_batch(
    samples: list[Sample], pad_token_id: int, n: int, multi_turn: bool
) -> TensorDict:
    """Prompt-major samples (`n` per prompt) as the padded batch of tephra.engine_api
    (`tephra.rollout.to_batch`): `prompt_index` [B] is each sample's place // n (its group);
    multi-turn adds num_turns / tool_calls / tool_errors / tool_rewards [B]; samples with
    images add `multimodal` (`MULTIMODAL`)."""
    return to_batch(
        samples,
        pad_token_id,
        agent_stats=multi_turn,
        prompt_index=[i // n for i in range(len(samples))],
    )


def group_ids(samples: list[Sample], n: int) -> torch.Tensor:
    """The GRPO group of each prompt-major sample [B]: its place // n, except that a sample
    dropped by a deadline (`Sample.dropped`) is a group of its own, so its group's baseline
    and scale come from the other samples."""
    ids = [i // n for i in range(len(samples))]
    fresh = len(samples) // n + 1
    for i, sample in enumerate(samples):
        if sample.dropped:
            ids[i], fresh = fresh, fresh + 1
    return torch.tensor(ids, dtype=torch.int64)


def agent_metrics(samples: list[Sample]) -> dict[str, float]:
    """Per-step agent-loop statistics: turns, tool calls and tool errors per trajectory
    (means), token counts: generated (response_mask 1, trained) and tool (mask 0), and
    trajectories cut by a deadline (`agent/timeouts`, of which `agent/dropped` left their
    group), trajectories dropped because their environment raised (`agent/environment_errors`,
    also among `agent/dropped`) and observations cut to `rollout.agent.max_observation_chars`
    (`agent/observations_truncated`)."""
    num = len(samples)
    generated = sum(s.generated_tokens for s in samples)
    total = sum(len(s.response_ids) for s in samples)
    return {
        "agent/turns_mean": sum(s.num_turns for s in samples) / num,
        "agent/tool_calls_mean": sum(s.tool_calls for s in samples) / num,
        "agent/tool_errors_mean": sum(s.tool_errors for s in samples) / num,
        "agent/generated_tokens": float(generated),
        "agent/tool_tokens": float(total - generated),
        "agent/finish_stop_frac": sum(s.finish_reason == "stop" for s in samples) / num,
        "agent/timeouts": float(sum(s.finish_reason in TIMEOUTS for s in samples)),
        "agent/dropped": float(sum(s.dropped for s in samples)),
        "agent/environment_errors": float(
            sum(s.finish_reason == ENVIRONMENT_ERROR for s in samples)
        ),
        "agent/observations_truncated": float(
            sum(s.extra_info.get("observations_truncated", 0) for s in samples)
        ),
    }


def record_payload(record: PromptRecord) -> dict[str, Any]:
    """The parts of a record a worker's scorer reads (plain data, cheap to ship)."""
    return {
        "data_source": record.data_source,
        "ground_truth": record.ground_truth,
        "extra_info": record.extra_info,
    }


def sample_to_dict(sample: Sample) -> dict[str, Any]:
    """A sample as plain JSON data (floats survive a JSON round trip exactly); its images
    are left out (they come back from the prompt set)."""
    data = asdict(replace(sample, multimodal=None))
    del data["multimodal"]
    return data


def sample_from_dict(data: dict[str, Any]) -> Sample:
    return Sample(**data)
