"""The environment contract: what an episode's model talks to between its turns, and what
scores it.

An environment serves one trajectory (a fresh object per item, built by its factory as
`factory(tools, config, **environment_kwargs)`):

    observation = await env.reset(item)          # the first context's chat messages
    result = await env.step(action)              # action: the model's decoded turn
    result.observation, result.reward, result.done, result.info
    await env.close()                            # always called, also after a deadline

Observations are chat messages (`role` `tool` or `user`), appended to the token context as
the chat template's delta (token-in-token-out: earlier tokens are never re-tokenised); an
observation may show images (`StepResult.images`, marked `<image>` in its text).
Rewards are the environment's own, per turn (each `step`) or at the end (the last step's
reward): with `owns_reward` the episode's sample takes their sum as its score
(`Sample.env_reward`) and the reward scorer is not called; without it (the tool agent)
the scorer judges the final answer as for a single turn.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tephra.episodes.agent.base import AgentLoopConfig
    from tephra.episodes.prompt import Prompt
    from tephra.episodes.tools.base import Tool


@dataclass
class StepResult:
    """What the environment answers to one model turn."""

    observation: list[dict[str, Any]] = field(default_factory=list)
    """Chat messages appended after the model's turn (e.g. tool results, a user's reply);
    empty when `done`."""
    reward: float = 0.0
    """This turn's reward (an end-of-episode reward is the last step's)."""
    done: bool = False
    """The episode ends after this turn."""
    images: list[Any] = field(default_factory=list)
    """PIL images the observation shows (vision-language models), in the order of the
    `<image>` markers in its messages' text: one marker per image. The episode expands each
    with the model's processor and checks the turn's image-token count against it."""
    info: dict[str, Any] = field(default_factory=dict)
    """Anything else. Keys the episode reads: `finish_reason` (str: why it ended; default
    `done`), `tool_calls` / `tool_errors` (ints, summed into the sample's counts),
    `metrics` ({name: {metric: value}}, summed into `extra_info["tool_metrics"]`)."""


class Environment(ABC):
    """One trajectory's environment (module docstring). Subclasses implement `step` and
    usually `reset`; `self.tools` and `self.config` are the episode's tools and budgets,
    `self.kwargs` the environment's keyword arguments."""

    owns_reward: bool = True
    """Whether the rewards of `step` are the sample's score (True) or the reward scorer
    scores the final answer (False)."""

    def __init__(
        self,
        tools: dict[str, Tool] | None = None,
        config: AgentLoopConfig | None = None,
        **kwargs: Any,
    ) -> None:
        self.tools = dict(tools or {})
        self.config = config
        self.kwargs = kwargs

    async def reset(self, item: Prompt) -> list[dict[str, Any]]:
        """Start the episode of `item`; returns the first observation (the chat messages the
        model answers first). The default: the item's own messages."""
        return list(item.messages)

    @abstractmethod
    async def step(self, action: str) -> StepResult:
        """Answer the model's turn `action` (its decoded text, without the stop token)."""

    def tool_schemas(self) -> list[dict[str, Any]] | None:
        """OpenAI function schemas the chat template lists for the model (None: none)."""
        return None

    async def tool_rewards(self) -> dict[str, float]:
        """Per tool, `Tool.calc_reward` of this trajectory (read after the last step)."""
        return {}

    async def close(self) -> None:
        """Free what `reset` took (tool instances, a user simulator); called once, always.
        The default holds nothing to free."""
        return None


EnvironmentFactory = Callable[..., Environment]
"""`factory(tools, config, **environment_kwargs)` -> a fresh environment (what
`ENVIRONMENTS` holds; an `Environment` subclass is one)."""
