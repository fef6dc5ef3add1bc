"""The one prompt type: a data row's prompt and what scores its responses, from the data loader
to the rollout (plain generation and every episode).

A `Prompt` is what the controller loads from a data set (verl's row format: `prompt`
messages, `data_source`, `reward_model.ground_truth`, `extra_info` with its agentic fields)
and, once tokenised and named (`prompt_ids`, `sample_id`, images), what it sends to the
workers; an episode (`tephra.episodes.episode`) runs on it as it is.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tephra.core.errors import ConfigError

if TYPE_CHECKING:
    from tephra.rollout.multimodal import MultimodalInputs

__all__ = ["Prompt"]


@dataclass
class Prompt:
    """One prompt: its messages, what its reward needs, and (once tokenised) its token ids."""

    messages: list[dict[str, Any]]
    """Chat messages (`role`, `content`) rendered with the tokenizer's chat template (verl's
    `prompt` column); with `prompt_ids` set, only the start of an episode's transcript."""
    data_source: str = ""
    """Name of the data set the prompt came from; picks the reward scorer (e.g. `gsm8k`,
    `reasoning_gym/basic_arithmetic`)."""
    ground_truth: Any = None
    """The answer the scorer compares with (verl's `reward_model.ground_truth`)."""
    extra_info: dict[str, Any] = field(default_factory=dict)
    """The row's `extra_info`: anything else the scorer reads (the reasoning-gym scorer its
    entry), and what an episode's agent may read (the `openai_agent` episode's function gets
    the prompt)."""
    tool_kwargs: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Per tool name, the keyword arguments of its `Tool.create` for this prompt (verl's
    `extra_info.tools_kwargs[tool].create_kwargs`, e.g. a checker's ground truth)."""
    interaction_kwargs: dict[str, Any] = field(default_factory=dict)
    """The arguments of the episode's environment for this prompt (verl's
    `extra_info.interaction_kwargs`: e.g. the scripted user's ground truth)."""
    agent_name: str | None = None
    """The episode that runs this prompt (verl's `agent_name` column, a name in `EPISODES`);
    None runs the configured one."""
    origin: str = ""
    """Where the prompt comes from (`row 17 of train.parquet`), for error messages; empty:
    they name `sample_id` alone."""
    sample_id: str = field(default_factory=lambda: uuid.uuid4().hex, compare=False)
    """Names the prompt's trajectories (tool instances, the rollout session, an episode's turn
    seeds); unique in a run (the trainer names each prompt of a step, e.g. `step3-5`). A
    random one by default; not compared: the same row loaded twice gives equal prompts."""
    prompt_ids: list[int] | None = None
    """The prompt rendered with the chat template, as token ids (None: not tokenised yet; an
    episode then renders `messages` itself)."""
    multimodal: MultimodalInputs | None = None
    """The prompt's images (pixel values and grids; `prompt_ids` holds each one expanded to
    its image tokens), None for a text prompt. Needs `prompt_ids`."""
    tools: list[str] | None = None
    """Names of the episode's tools offered to this prompt; None offers all of them."""

    def __post_init__(self) -> None:
        if not self.messages and not self.prompt_ids:
            raise ConfigError(
                f"Prompt {self.origin or self.sample_id!r}: give `messages` (chat messages) "
                "or `prompt_ids` (token ids)"
            )
        if self.multimodal is not None and not self.prompt_ids:
            raise ConfigError(
                f"Prompt {self.origin or self.sample_id!r}: `multimodal` (the prompt's images) "
                "needs `prompt_ids` with each image expanded "
                "(tephra.rollout.multimodal.VisionProcessor)"
            )
