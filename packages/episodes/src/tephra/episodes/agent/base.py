"""The agent-loop contract: a sample in, a token-level trajectory out.

`AgentLoop.run(sample)` drives the model (through a `Rollout`'s `agenerate`, many loops in
flight at once) and whatever environment it talks to (tools), and returns a `Trajectory`:

    prompt_ids          [P]  the first context
    response_ids        [R]  every token after it: model turns and tool turns, in order
    response_mask       [R]  1 on model-generated tokens (trained), 0 on tool/user tokens
    response_log_probs  [R]  rollout log-prob of each generated token, 0.0 on tool tokens

with `decode(prompt_ids + response_ids)` equal to the chat transcript (`messages`).
"""

from __future__ import annotations

import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tephra.engine_api.errors import ConfigError

if TYPE_CHECKING:
    from tephra.episodes.tools.base import Tool
    from tephra.rollout.base import Rollout, SamplingParams


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
    """Passed through to `Trajectory.extra_info` for the reward (data_source, ground truth)."""

    def __post_init__(self) -> None:
        if not self.messages and not self.prompt_ids:
            raise ConfigError("AgentSample: give `messages` (chat messages) or `prompt_ids`")


@dataclass
class Trajectory:
    """A finished rollout of one sample (see the module docstring for the token fields)."""

    sample_id: str
    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]
    response_log_probs: list[float]
    num_turns: int
    """Model turns (generate calls)."""
    tool_calls: int
    """Tool calls answered with a tool message (run, malformed or over the per-turn cap);
    calls in a last turn with no turn left to read them are not run and not counted."""
    tool_errors: int
    """Calls that returned an error (bad JSON, unknown tool, the tool's own error)."""
    finish_reason: str
    """'stop' (the model answered without a tool call), 'length' (token budget or model
    length reached) or 'max_turns' (the last allowed turn still called a tool)."""
    messages: list[dict[str, Any]]
    """The transcript: the sample's messages, then assistant and tool messages."""
    tool_rewards: dict[str, float] = field(default_factory=dict)
    """`Tool.calc_reward` of each tool the trajectory used."""
    extra_info: dict[str, Any] = field(default_factory=dict)
    """The sample's `extra_info` plus `tool_metrics` (summed per tool and metric)."""
    response_versions: list[int] | None = None
    """Weight version that produced each response token, when the backend tags them
    (`Generation.token_versions`, partial rollout): a turn interrupted by a weight update
    goes on under the new version, and later turns run under whatever the backend holds
    then. Tool tokens take the version of the model turn they answer. None when any turn
    was untagged."""

    def __post_init__(self) -> None:
        n = len(self.response_ids)
        if (
            len(self.response_mask) != n
            or len(self.response_log_probs) != n
            or (self.response_versions is not None and len(self.response_versions) != n)
        ):
            raise ValueError(
                f"trajectory {self.sample_id}: response_ids ({n}), response_mask "
                f"({len(self.response_mask)}), response_log_probs ({len(self.response_log_probs)}) "
                "and response_versions (when set) must have the same length"
            )

    @property
    def generated_tokens(self) -> int:
        return sum(self.response_mask)


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
    """Turns one sample into one trajectory. One loop object serves many samples concurrently:
    per-trajectory state lives in `run`, not on `self`."""

    def __init__(
        self,
        rollout: Rollout,
        tokenizer: Any,
        sampling: SamplingParams,
        config: AgentLoopConfig | None = None,
        tools: dict[str, Tool] | None = None,
    ) -> None:
        if sampling.n != 1:
            raise ConfigError(
                f"agent loop: sampling.n={sampling.n}; a loop makes one trajectory per run, so pass "
                "n=1 and submit each sample n times (with distinct sample_id)"
            )
        self.rollout = rollout
        self.tokenizer = tokenizer
        self.sampling = sampling
        self.config = config or AgentLoopConfig()
        self.tools = dict(tools or {})

    @abstractmethod
    async def run(self, sample: AgentSample) -> Trajectory:
        """Roll out `sample` to the end."""
