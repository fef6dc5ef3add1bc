"""Running many agent loops at once."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from tephra.episodes.agent.base import AgentLoop, AgentSample
from tephra.rollout.samples import Sample


async def run_agent_loops(
    loop: AgentLoop, samples: Sequence[AgentSample], max_in_flight: int | None = None
) -> list[Sample]:
    """Run `loop` on every sample concurrently (at most `max_in_flight` at once; None: all);
    samples come back in the order of `samples`."""
    limit = asyncio.Semaphore(max_in_flight or max(len(samples), 1))

    async def one(sample: AgentSample) -> Sample:
        async with limit:
            return await loop.run(sample)

    return list(await asyncio.gather(*(one(s) for s in samples)))
