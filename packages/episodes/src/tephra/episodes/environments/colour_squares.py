"""`colour_squares`: a multi-turn image environment that shows a new coloured square after each
answer and asks its colour (vision-language models; the synthetic task's multi-turn form).

The item's prompt shows the first square (its colour is the item's ground truth); each
`step` scores the answer with the task's scorer (`tephra.episodes.rewards.colours`) and,
until `turns` answers are in, shows the next square, drawn by a generator seeded from `seed`
and the first colour (the same item sees the same squares). The episode's reward is the
mean of its turns' scores.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any

from tephra.core.errors import ConfigError
from tephra.episodes.environments.base import Environment, StepResult
from tephra.episodes.rewards.colours import COLOURS, colour_score

if TYPE_CHECKING:
    from tephra.episodes.agent.base import AgentLoopConfig
    from tephra.episodes.prompt import Prompt
    from tephra.episodes.tools.base import Tool

NEXT_QUESTION = "<image>And this square? Answer with one word."
"""The observation after each answer but the last."""


def colour_square(rng: random.Random, image_size: int = 112) -> tuple[str, Any]:
    """(colour name, RGB PIL image): a square of a colour drawn from `rng`, at a random place
    and size on a grey background."""
    # PIL only here: text-only episodes never draw images
    from PIL import Image, ImageDraw

    name = rng.choice(sorted(COLOURS))
    image = Image.new("RGB", (image_size, image_size), (128, 128, 128))
    side = rng.randint(image_size // 4, image_size // 2)
    x, y = rng.randint(0, image_size - side), rng.randint(0, image_size - side)
    ImageDraw.Draw(image).rectangle([x, y, x + side - 1, y + side - 1], fill=COLOURS[name])
    return name, image


class ColourSquaresEnvironment(Environment):
    """See the module docstring. Keyword arguments (`rollout.agent.environment_kwargs`):
    `turns` (answers per episode, >= 1; default 2), `seed` (default 0), `image_size`
    (pixels; default 112). The first colour is the item's `interaction_kwargs["ground_truth"]`
    (verl's per-row `extra_info.interaction_kwargs`)."""

    def __init__(
        self,
        tools: dict[str, Tool] | None = None,
        config: AgentLoopConfig | None = None,
        turns: int = 2,
        seed: int = 0,
        image_size: int = 112,
    ) -> None:
        super().__init__(tools, config, turns=turns, seed=seed, image_size=image_size)
        if not isinstance(turns, int) or turns < 1:
            raise ConfigError(
                f"rollout.agent.environment_kwargs.turns={turns!r}: the colour_squares "
                "environment needs an integer >= 1 (answers per episode)"
            )
        self.turns, self.seed, self.image_size = turns, seed, image_size
        self.truth = ""
        self.answers = 0
        self.rng = random.Random()

    async def reset(self, item: Prompt) -> list[dict[str, Any]]:
        truth = item.interaction_kwargs.get("ground_truth")
        if truth not in COLOURS:
            raise ConfigError(
                f"colour_squares environment: the item's interaction_kwargs['ground_truth'] "
                f"is {truth!r}; give the first square's colour, one of {sorted(COLOURS)}"
            )
        self.truth, self.answers = str(truth), 0
        self.rng = random.Random(f"{self.seed}:{truth}")
        return list(item.messages)

    async def step(self, action: str) -> StepResult:
        score = colour_score("colour_squares", action, self.truth)
        self.answers += 1
        info = {"metrics": {"colour_squares": {"correct": score["acc"]}}}
        if self.answers >= self.turns:
            return StepResult(reward=score["score"] / self.turns, done=True, info=info)
        self.truth, image = colour_square(self.rng, self.image_size)
        return StepResult(
            observation=[{"role": "user", "content": NEXT_QUESTION}],
            images=[image],
            reward=score["score"] / self.turns,
            info=info,
        )
