"""The agent-loop contract: a prompt item in, one token-level `Sample` out.

`AgentLoop.run(sample)` drives the model (through a `Rollout`'s `agenerate`, many loops in
flight at once) and whatever environment it talks to (tools), and returns a
`tephra.rollout.Sample`:

    prompt_ids      [P]  the first context
    response_ids    [R]  every token after it: model turns and tool turns, in order
    response_mask   [R]  1 on model-generated tokens (trained), 0 on tool/user tokens
    log_probs       [R]  rollout log-prob of each generated token, 0.0 on tool tokens
    token_versions  [R]  the weight version of each token (None: untagged)

with `decode(prompt_ids + response_ids)` equal to the chat transcript (`messages`).
"""

from __future__ import annotations

import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tephra.core.errors import ConfigError

if TYPE_CHECKING:
    from tephra.episodes.tools.base import Tool
    from tephra.rollout.base import Rollout, SamplingParams
    from tephra.rollout.samples import Sample


@dataclass
class AgentSample:
    """One prompt for an agent loop."""

    messages: list[dict[str, Any]]
    """Chat messages (`role`, `content`) rendered with the tokenizer's chat template."""
    sample_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    """Names the trajectory (tool instances, the rollout session); unique per run."""
    prompt_ids: list[int] | None = None
    """Token ids of the prompt when already tokenised (then `messages` is only the transcript)."""
    tools: list[str] | None = None
    """Names of the loop's tools offered to this sample; None offers all of them."""
    tool_kwargs: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Per tool name, keyword arguments for `Tool.create` (e.g. a checker's ground truth)."""
    extra_info: dict[str, Any] = field(default_factory=dict)
    """Passed through to `Sample.extra_info` for the reward (data_source, ground truth)."""

    def __post_init__(self) -> None:
        if not self.messages and not self.prompt_ids:
            raise ConfigError("AgentSample: give `messages` (chat messages) or `prompt_ids`")


@dataclass
class AgentLoopConfig:
    """Budgets of one trajectory."""

    max_turns: int = 4
    """Most model turns per trajectory (1 = single turn; tool turns do not count)."""
    max_response_tokens: int = 1024
    """Most tokens after the prompt, model and tool tokens together (the trainer's response
    length). A tool turn that would pass it is cut and the trajectory ends with 'length'."""
    max_tool_calls_per_turn: int = 4
    """Calls of one model turn that are run; further ones get an error message."""
    max_tool_response_chars: int = 2000
    """A tool's text is cut to this many characters (its head) before it is tokenised."""
    render_tool_schemas: bool = True
    """Pass the tools' schemas to the chat template (`tools=`), which lists them in the system
    turn. False when the system prompt already describes the tools (a model fine-tuned on
    transcripts rendered without schemas)."""
    tool_call_format: str = "hermes"
    """Parser of tool calls in generated text (registry `TOOL_CALL_PARSERS`)."""

    def __post_init__(self) -> None:
        for name in (
            "max_turns",
            "max_response_tokens",
            "max_tool_calls_per_turn",
            "max_tool_response_chars",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"agent_loop.{name}={getattr(self, name)!r} must be >= 1")


class AgentLoop(ABC):
    """An episode over a chat: turns one prompt item into one sample. One loop object serves
    many items concurrently, on any rollout and sampling settings (per-item state lives in
    `run`, not on `self`); calling it is the episode contract (`tephra.episodes.episode`)."""

    def __init__(
        self,
        tokenizer: Any,
        config: AgentLoopConfig | None = None,
        tools: dict[str, Tool] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.config = config or AgentLoopConfig()
        self.tools = dict(tools or {})

    @abstractmethod
    async def run(self, rollout: Rollout, sample: AgentSample, sampling: SamplingParams) -> Sample:
        """Roll out `sample` to the end on `rollout` (`sampling.n` must be 1)."""

    async def __call__(
        self, rollout: Rollout, item: AgentSample, sampling: SamplingParams
    ) -> list[Sample]:
        """The episode: the item's one sample."""
        return [await self.run(rollout, item, sampling)]


def check_one_sample(sampling: SamplingParams) -> None:
    """Refuse `sampling.n` > 1: an episode makes one sample per run."""
    if sampling.n != 1:
        raise ConfigError(
            f"agent loop: sampling.n={sampling.n}; a loop makes one trajectory per run, so pass "
            "n=1 and submit each sample n times (with distinct sample_id)"
        )
