"""The episode contract: one async function turns one prompt item into its training samples.

An episode is called as `await episode(rollout, item, sampling)` and returns the item's
`tephra.rollout.Sample`s (one for the built-ins). It drives the model through the rollout's
`agenerate` (so many episodes run at once and the backend batches their requests) and
whatever it talks to between turns (tools). `EPISODES` (`tephra.episodes.registry`) builds
one by name from a tokenizer, an `AgentLoopConfig` and the tools:

    episode = EPISODES.get("tool_agent")(tokenizer, AgentLoopConfig(), tools)
    samples = await run_episodes(episode, rollout, items, sampling)
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from tephra.episodes.agent.base import AgentLoopConfig
from tephra.episodes.prompt import Prompt
from tephra.episodes.tools.base import Tool
from tephra.rollout.base import Rollout, SamplingParams
from tephra.rollout.samples import Sample

Episode = Callable[[Rollout, Prompt, SamplingParams], Awaitable[list[Sample]]]
"""`episode(rollout, item, sampling)` -> the item's samples (`sampling.n` is 1: an item
submitted n times makes n episodes)."""

T = TypeVar("T")

EpisodeFactory = Callable[[Any, AgentLoopConfig, "dict[str, Tool]"], Episode]
"""`factory(tokenizer, config, tools)` -> an episode (what `EPISODES` holds)."""


async def run_episodes(
    episode: Episode,
    rollout: Rollout,
    items: Sequence[Prompt],
    sampling: SamplingParams,
    max_in_flight: int | None = None,
) -> list[Sample]:
    """Run `episode` on every item concurrently (at most `max_in_flight` at once; None: all);
    the samples come back in the order of `items`. With `sampling.seed` set, item k samples
    with seed `sampling.seed + k`, as sample k of a `generate` call does: one seed for all
    would make the samples of a prompt group identical (no group-relative signal)."""
    limit = asyncio.Semaphore(max_in_flight or max(len(items), 1))

    async def one(k: int, item: Prompt) -> list[Sample]:
        own = sampling if sampling.seed is None else sampling.replace(seed=sampling.seed + k)
        async with limit:
            return await episode(rollout, item, own)

    gathered = await asyncio.gather(*(one(k, i) for k, i in enumerate(items)))
    return [s for samples in gathered for s in samples]


def by_agent_name(default: str, build: Callable[[str], Episode]) -> Episode:
    """An episode that runs each item with the episode its `agent_name` names (verl's per-row
    `agent_name`), or `default` when it names none; `build(name)` makes each once."""
    built: dict[str, Episode] = {}

    async def episode(rollout: Rollout, item: Prompt, sampling: SamplingParams) -> list[Sample]:
        name = item.agent_name or default
        if name not in built:
            built[name] = build(name)
        return await built[name](rollout, item, sampling)

    return episode


def run_to_completion(coro: Awaitable[T]) -> T:
    """`asyncio.run(coro)`, except that threads still busy at the end are not waited for: a
    tool or a synchronous agent blocking a thread past its deadline (Python cannot interrupt
    it) has had its trajectory ended already, and must not hold the caller (`asyncio.run`
    joins the default executor's threads, however long they take). Tasks left are
    cancelled, as `asyncio.run` does."""
    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(coro)
    finally:
        try:
            loop.run_until_complete(_cancel_the_rest())
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            loop.close()  # shuts the default executor down without joining its threads


async def _cancel_the_rest() -> None:
    """Cancel every task of the running loop but this one, and wait for them to end."""
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
