"""The typed objects that travel between the driver and the workers.

    Prompt   driver -> worker: one prompt to sample (`tephra.episodes.prompt.Prompt`: its
             messages, token ids, id, images, and what its reward needs); the plain and the
             agent path take it as it is
    Sample   worker -> driver: one response (plain or multi-turn), tagged with the weight
             version that generated it (`tephra.rollout.Sample`, the one per-sample type from
             the backend to the batch); `Sample.reward` is its score
    Scores   worker -> driver: each sample's `RewardResult` (the one score type, what the
             scorer made) and the seconds scoring took (`collect_scores`)

A step's samples are prompt-major: prompt i's `n` samples are consecutive.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
from tensordict import TensorDict

from tephra.engine_api.multimodal import MULTIMODAL
from tephra.episodes.agent.environment_guard import ENVIRONMENT_ERROR
from tephra.episodes.agent.loops import TIMEOUTS
from tephra.episodes.prompt import Prompt
from tephra.rollout.samples import RewardResult, Sample, to_batch

__all__ = [
    "MULTIMODAL",
    "Prompt",
    "RewardResult",
    "Sample",
    "Scores",
    "agent_metrics",
    "group_ids",
    "sample_from_dict",
    "sample_to_dict",
    "samples_to_batch",
]


@dataclass
class Scores:
    """What `collect_scores` hands back: the reward of each sample of the last `generate`, in
    order, and how long scoring them took (a timing, logged as `time/reward_s`)."""

    rewards: list[RewardResult]
    """One per sample, as the scorer (or the episode's environment) made it."""
    seconds: float
    """Seconds the rank spent scoring its share; merged over ranks, the slowest's."""

    @classmethod
    def merge(cls, parts: list[Scores]) -> Scores:
        """The ranks' scores in rank order (`tephra.controller.cluster.dispatch.collect`); the
        seconds of the slowest rank that scored any sample (0.0 when none did)."""
        return cls(
            [r for part in parts for r in part.rewards],
            max((part.seconds for part in parts if part.rewards), default=0.0),
        )


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


def sample_to_dict(sample: Sample) -> dict[str, Any]:
    """A sample as plain JSON data (floats survive a JSON round trip exactly); its images
    are left out (they come back from the prompt set)."""
    data = asdict(replace(sample, multimodal=None))
    del data["multimodal"]
    return data


LEGACY_REWARD_KEYS = {
    "score": "score",
    "reward_error": "error",
    "reward_clipped": "clipped",
    "reward_extras": "extras",
}
"""The flat reward fields of a sample in checkpoints of tephra-controller 0.3.0 (before
`Sample.reward`), by their `RewardResult` names: such a checkpoint still loads."""


def sample_from_dict(data: dict[str, Any]) -> Sample:
    """The inverse of `sample_to_dict` (also of its 0.3.0 form, `LEGACY_REWARD_KEYS`)."""
    data = dict(data)
    reward = data.pop("reward", None)
    legacy = {new: data.pop(old) for old, new in LEGACY_REWARD_KEYS.items() if old in data}
    reward = RewardResult(**(reward if reward is not None else {"score": 0.0, **legacy}))
    return Sample(**data, reward=reward)
