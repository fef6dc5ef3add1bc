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

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tephra.core.errors import ConfigError
from tephra.episodes.agent.environment_guard import ENVIRONMENT_ERROR_POLICIES, OVERSIZE_POLICIES
from tephra.episodes.gateway.config import GatewayConfig
from tephra.episodes.prompt import Prompt

if TYPE_CHECKING:
    from tephra.episodes.tools.base import Tool
    from tephra.rollout.base import Rollout, SamplingParams
    from tephra.rollout.multimodal import VisionProcessor
    from tephra.rollout.samples import Sample


TIMEOUT_REWARDS = ("zero", "drop")
"""Policies for a trajectory cut by a deadline (`AgentLoopConfig.timeout_reward`)."""


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
    """Parser of tool calls in generated text (registry `TOOL_CALL_PARSERS`): `hermes`
    (Qwen2.5 / Qwen3 / Hermes), `qwen3_coder` (Qwen3-Coder's XML), `llama3_json` (Llama 3.1 /
    3.2 JSON), `mistral` (`[TOOL_CALLS]`)."""
    environment: str = ""
    """The environment of the `environment` episode: a name in `ENVIRONMENTS` (`tool`,
    `answer_check`, `colour_squares`, `openenv`: an OpenEnv server, its settings in
    `environment_kwargs`; `remote`: a tephra environment served over HTTP by
    `python -m tephra.episodes.environments.serve`, `environment_kwargs.environment` naming it
    and `environment_kwargs.url` the server, or none for a server the run starts) or
    `path/to/file.py:ClassName` (a user's `Environment` subclass). Unused by the other
    episodes."""
    environment_kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the environment's constructor (the same for every item; per-item
    ones come from `Prompt.interaction_kwargs`)."""
    openai_agent: str = ""
    """The agent of the `openai_agent` episode: `path/to/agent.py:function`, called as
    `function(gateway, item)` where `gateway` (`tephra.episodes.gateway.GatewayAccess`) holds
    the gateway's URLs for OpenAI and Anthropic clients and the trajectory's API key. Unused
    by the other episodes."""
    verifiers_environment: str = ""
    """The environment of the `verifiers` episode (a `verifiers` 0.4 environment, its
    tasks' rubric the reward): the id of an installed verifiers taskset, or
    `path/to/taskset.py` (a module whose `__all__` exports a `vf.Taskset`, and optionally
    its `vf.Env`); `environment_kwargs` are verifiers' `EnvConfig` fields. Needs the
    `tephra-episodes[verifiers]` extra. Unused by the other episodes."""
    gateway: GatewayConfig = field(default_factory=GatewayConfig)
    """Where the gateway of the `openai_agent` and `verifiers` episodes listens (host, port)."""
    tool_timeout_s: float | None = None
    """Deadline of one tool call in seconds; on expiry the trajectory ends with finish
    reason `tool_timeout`. None: no deadline (the tool's own limits apply)."""
    turn_timeout_s: float | None = None
    """Deadline of one turn in seconds (the model's generation and the environment's answer
    to it); on expiry the trajectory ends with `turn_timeout`. None: no deadline."""
    trajectory_timeout_s: float | None = None
    """Deadline of a whole trajectory in seconds, from its first token request to its reward;
    on expiry it ends with `trajectory_timeout`. None: no deadline."""
    timeout_reward: str = "zero"
    """What a trajectory cut by a deadline scores: `zero` (reward 0, trained as usual) or
    `drop` (trains nothing and leaves its prompt's group, whose baseline and scale then come
    from the other samples)."""

    environment_errors: str = "stop"
    """What an exception raised by the environment's `reset` or `step` does: `stop` (the run
    stops with one line naming the environment, the item's data row and the turn) or `drop`
    (the trajectory trains nothing and leaves its prompt's group, finish reason
    `environment_error`, counted in the trainer's `agent/environment_errors`). Default stop:
    an environment that raises is a bug to fix, not noise to train around, until the user
    says otherwise."""
    max_observation_chars: int | None = 65536
    """Most characters of text in one observation (the messages one `step` returns, tool
    results included), counted before it is tokenised. Default 65536: far above what a
    trajectory's token budget can hold (`max_response_tokens`, 128-1024 in the presets, a few
    characters per token), while an environment answering megabytes per turn costs
    milliseconds instead of minutes of tokenising and gigabytes of memory. null: no limit."""
    oversize_observation: str = "truncate"
    """An observation beyond `max_observation_chars`: `truncate` (keep its head, with a note
    of the cut; counted in the trainer's `agent/observations_truncated`) or `refuse` (an
    environment error: `environment_errors` then stops the run or drops the trajectory)."""

    def __post_init__(self) -> None:
        if self.environment_errors not in ENVIRONMENT_ERROR_POLICIES:
            raise ConfigError(
                f"rollout.agent.environment_errors={self.environment_errors!r} is not allowed; "
                f"choose one of {list(ENVIRONMENT_ERROR_POLICIES)}"
            )
        if self.oversize_observation not in OVERSIZE_POLICIES:
            raise ConfigError(
                f"rollout.agent.oversize_observation={self.oversize_observation!r} is not "
                f"allowed; choose one of {list(OVERSIZE_POLICIES)}"
            )
        if self.max_observation_chars is not None and self.max_observation_chars < 1:
            raise ConfigError(
                f"rollout.agent.max_observation_chars={self.max_observation_chars!r} must be "
                ">= 1 (characters), or null for no limit"
            )
        for name in ("tool_timeout_s", "turn_timeout_s", "trajectory_timeout_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ConfigError(
                    f"agent_loop.{name}={value!r} must be a number of seconds > 0, or null for "
                    "no deadline"
                )
        if self.timeout_reward not in TIMEOUT_REWARDS:
            raise ConfigError(
                f"agent_loop.timeout_reward={self.timeout_reward!r} is not allowed; choose one "
                f"of {list(TIMEOUT_REWARDS)}"
            )
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
        processor: VisionProcessor | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.config = config or AgentLoopConfig()
        self.tools = dict(tools or {})
        self.processor = processor
        """A vision-language model's processor: expands the images environments show (None:
        a turn with images is refused)."""

    @abstractmethod
    async def run(self, rollout: Rollout, sample: Prompt, sampling: SamplingParams) -> Sample:
        """Roll out `sample` to the end on `rollout` (`sampling.n` must be 1)."""

    async def __call__(
        self, rollout: Rollout, item: Prompt, sampling: SamplingParams
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
