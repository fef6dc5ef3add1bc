"""Interactions: a user (scripted, or played by a model) answers each model turn, as verl's
multi-turn "interaction" does; here an interaction is an environment whose observations are
`user` messages."""

from __future__ import annotations

from abc import abstractmethod
from typing import Any

from tephra.episodes.environments.base import Environment, StepResult
from tephra.episodes.prompt import Prompt
from tephra.episodes.rewards.extraction import extract_last_number


class Interaction(Environment):
    """A user who reads the transcript and replies. Subclasses implement `respond`; the
    item's `interaction_kwargs` (verl's per-row field) are in `self.item_kwargs`."""

    async def reset(self, item: Prompt) -> list[dict[str, Any]]:
        self.messages = list(item.messages)
        self.item_kwargs = dict(item.interaction_kwargs)
        return list(item.messages)

    async def step(self, action: str) -> StepResult:
        self.messages.append({"role": "assistant", "content": action})
        done, reply, reward = await self.respond(self.messages)
        if done:
            return StepResult(reward=reward, done=True, info={"finish_reason": "done"})
        message = {"role": "user", "content": reply}
        self.messages.append(message)
        return StepResult([message], reward=reward)

    @abstractmethod
    async def respond(self, messages: list[dict[str, Any]]) -> tuple[bool, str, float]:
        """(done, the user's reply, this turn's reward) after the assistant's last message."""


class AnswerCheckInteraction(Interaction):
    """A scripted user with the answer (`interaction_kwargs["ground_truth"]`): the last number
    of each model turn is compared with it as a number; right: reward `correct_reward` and the
    episode ends; wrong: reward `wrong_reward` and the user asks again (`retry_message`), until
    the turn budget ends it."""

    def __init__(
        self,
        tools: Any = None,
        config: Any = None,
        correct_reward: float = 1.0,
        wrong_reward: float = 0.0,
        retry_message: str = "That is not right. Check your work and try again.",
    ) -> None:
        super().__init__(tools, config)
        self.correct_reward, self.wrong_reward = correct_reward, wrong_reward
        self.retry_message = retry_message

    async def reset(self, item: Prompt) -> list[dict[str, Any]]:
        if "ground_truth" not in item.interaction_kwargs:
            raise KeyError(
                f"sample {item.sample_id}: the answer_check interaction needs "
                "interaction_kwargs['ground_truth'] (verl's extra_info.interaction_kwargs)"
            )
        return await super().reset(item)

    async def respond(self, messages: list[dict[str, Any]]) -> tuple[bool, str, float]:
        answer = extract_last_number(messages[-1]["content"])
        truth = str(self.item_kwargs["ground_truth"])
        try:
            right = answer is not None and float(answer) == float(truth.replace(",", ""))
        except ValueError:
            right = answer == truth.strip()
        if right:
            return True, "", self.correct_reward
        return False, self.retry_message, self.wrong_reward
