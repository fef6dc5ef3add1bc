"""The typed objects that travel between the driver and the workers.

    PromptItem  driver -> worker: one prompt to sample (token ids, its data record, an id)
    Sample      worker -> driver: one response (plain or multi-turn), scored on its rank,
                tagged with the weight version that generated it

A step's samples are prompt-major: prompt i's `n` samples are consecutive.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
from tensordict import TensorDict

from tephra.controller.data import PromptRecord
from tephra.engine_api.multimodal import MULTIMODAL, MultimodalInputs, multimodal_column


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


@dataclass
class Sample:
    """One response to a `PromptItem`, with its reward when the worker scored it."""

    prompt_ids: list[int]
    """The prompt's token ids."""
    response_ids: list[int]
    """Every token after the prompt (model and, in multi-turn, tool tokens)."""
    response_mask: list[int]
    """1 on tokens the model generated (trained), 0 on tokens a tool wrote."""
    log_probs: list[float] | None
    """The rollout engine's log-prob of each response token (0 on tool tokens)."""
    finish_reason: str
    """`stop`, `length`, (agent loop) `max_turns`, or `image_token` (a response with images
    ended before an image placeholder it sampled; `rl_worker.end_before_token`)."""
    text: str = ""
    """What the reward scored: the decoded response, or the last assistant message of a
    multi-turn trajectory (earlier turns are tool calls)."""
    score: float = 0.0
    """The reward (0 when the scorer failed; see `reward_error`)."""
    reward_error: str | None = None
    """The scorer's error for this sample, if it raised."""
    reward_clipped: bool = False
    """Whether `reward.clip` moved `score` into its range."""
    sample_id: str = ""
    """The prompt item's id."""
    num_turns: int = 1
    """Model turns."""
    tool_calls: int = 0
    """Tool calls answered."""
    tool_errors: int = 0
    """Tool calls that returned an error."""
    tool_rewards: dict[str, float] = field(default_factory=dict)
    """`Tool.calc_reward` of each tool used."""
    weight_version: int = 0
    """Version of the weights that generated it: the number of RL steps (weight syncs)
    those weights had been updated by; the driver sets it. The version lag of a trained
    sample is the trainer's version (the steps completed before the update) minus this."""
    multimodal: MultimodalInputs | None = None
    """The prompt's images, the very object of its `PromptItem` (generation and every
    training pass see the same pixels; not part of `sample_to_dict`)."""
    token_versions: list[int] | None = None
    """Weight version of each response token (`trainer.partial_rollout`: a sample interrupted
    by a weight update continues under the new version); None otherwise. `weight_version` is
    then its oldest entry."""


def samples_to_batch(
    samples: list[Sample], pad_token_id: int, n: int, multi_turn: bool
) -> TensorDict:
    """Prompt-major samples (`n` per prompt) as the padded batch of tephra.engine_api:
    `input_ids`, `attention_mask`, `position_ids`, `response_mask` (1 on model tokens only),
    `rollout_log_probs`, `prompt_index` [B]; multi-turn adds num_turns / tool_calls /
    tool_errors / tool_rewards [B]; samples with images add `multimodal` (`MULTIMODAL`)."""
    batch = _text_batch(samples, pad_token_id, n, multi_turn)
    if any(s.multimodal is not None for s in samples):
        batch[MULTIMODAL] = multimodal_column([s.multimodal for s in samples])
    return batch


def _text_batch(samples: list[Sample], pad_token_id: int, n: int, multi_turn: bool) -> TensorDict:
    from tephra.rollout.base import RolloutOutput

    if multi_turn:
        from tephra.episodes.agent import Trajectory, trajectories_to_batch

        batch = trajectories_to_batch(
            [
                Trajectory(
                    s.sample_id,
                    s.prompt_ids,
                    s.response_ids,
                    s.response_mask,
                    s.log_probs or [0.0] * len(s.response_ids),
                    s.num_turns,
                    s.tool_calls,
                    s.tool_errors,
                    s.finish_reason,
                    [],
                    tool_rewards=s.tool_rewards,
                )
                for s in samples
            ],
            pad_token_id,
        )
        batch["prompt_index"] = torch.arange(len(samples), dtype=torch.int64) // n
        return batch
    out = RolloutOutput(
        prompt_index=[i // n for i in range(len(samples))],
        prompt_ids=[s.prompt_ids for s in samples],
        response_ids=[s.response_ids for s in samples],
        log_probs=[s.log_probs for s in samples] if samples[0].log_probs is not None else None,
        finish_reasons=[s.finish_reason for s in samples],
    )
    return out.to_batch(pad_token_id)


def agent_metrics(samples: list[Sample]) -> dict[str, float]:
    """Per-step agent-loop statistics: turns, tool calls and tool errors per trajectory
    (means), and token counts: generated (response_mask 1, trained) and tool (mask 0)."""
    num = len(samples)
    generated = sum(sum(s.response_mask) for s in samples)
    total = sum(len(s.response_ids) for s in samples)
    return {
        "agent/turns_mean": sum(s.num_turns for s in samples) / num,
        "agent/tool_calls_mean": sum(s.tool_calls for s in samples) / num,
        "agent/tool_errors_mean": sum(s.tool_errors for s in samples) / num,
        "agent/generated_tokens": float(generated),
        "agent/tool_tokens": float(total - generated),
        "agent/finish_stop_frac": sum(s.finish_reason == "stop" for s in samples) / num,
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
