"""Running many agent loops at once and packing their trajectories for the trainer."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import torch

from tephra.engine_api.batch import make_batch
from tephra.episodes.agent.base import AgentLoop, AgentSample, Trajectory


async def run_agent_loops(
    loop: AgentLoop, samples: Sequence[AgentSample], max_in_flight: int | None = None
) -> list[Trajectory]:
    """Run `loop` on every sample concurrently (at most `max_in_flight` at once; None: all);
    trajectories come back in the order of `samples`."""
    limit = asyncio.Semaphore(max_in_flight or max(len(samples), 1))

    async def one(sample: AgentSample) -> Trajectory:
        async with limit:
            return await loop.run(sample)

    return list(await asyncio.gather(*(one(s) for s in samples)))


def trajectories_to_batch(
    trajectories: Sequence[Trajectory], pad_token_id: int, uids: Sequence[int] | None = None
):
    """The padded layout of `tephra.engine_api.batch`, batch size [B]:

    input_ids          int64 [B, P + R]  prompt left-padded to P (longest prompt), then the
                                         response right-padded to R (longest response)
    attention_mask     int64 [B, P + R]  1 on prompt and response tokens (tool tokens too:
                                         the model reads them)
    response_mask      int64 [B, P + R]  1 on model-generated tokens only
    rollout_log_probs  float32 [B, P + R] the rollout log-prob at each generated token, 0 elsewhere
    num_turns, tool_calls, tool_errors   int64 [B]
    tool_rewards       float32 [B]       sum of the trajectory's `tool_rewards`
    uid                int64 [B]         group id of each sample (GRPO groups), when `uids` given
    """
    if not trajectories:
        raise ValueError("trajectories_to_batch: no trajectories")
    if uids is not None and len(uids) != len(trajectories):
        raise ValueError(
            f"trajectories_to_batch: {len(uids)} uids for {len(trajectories)} trajectories; "
            "give one group id per trajectory"
        )
    num = len(trajectories)
    p_len = max(len(t.prompt_ids) for t in trajectories)
    r_len = max(max(len(t.response_ids) for t in trajectories), 1)
    ids = torch.full((num, p_len + r_len), pad_token_id, dtype=torch.int64)
    attn = torch.zeros((num, p_len + r_len), dtype=torch.int64)
    resp = torch.zeros_like(attn)
    logp = torch.zeros((num, p_len + r_len), dtype=torch.float32)
    for i, t in enumerate(trajectories):
        p, r = len(t.prompt_ids), len(t.response_ids)
        ids[i, p_len - p : p_len] = torch.tensor(t.prompt_ids, dtype=torch.int64)
        attn[i, p_len - p : p_len + r] = 1
        if r:
            ids[i, p_len : p_len + r] = torch.tensor(t.response_ids, dtype=torch.int64)
            resp[i, p_len : p_len + r] = torch.tensor(t.response_mask, dtype=torch.int64)
            logp[i, p_len : p_len + r] = torch.tensor(t.response_log_probs, dtype=torch.float32)
    per_sample = {
        key: torch.tensor([getattr(t, key) for t in trajectories], dtype=torch.int64)
        for key in ("num_turns", "tool_calls", "tool_errors")
    }
    per_sample["tool_rewards"] = torch.tensor(
        [sum(t.tool_rewards.values()) for t in trajectories], dtype=torch.float32
    )
    if uids is not None:
        per_sample["uid"] = torch.tensor(list(uids), dtype=torch.int64)
    return make_batch(ids, attn, resp, rollout_log_probs=logp, **per_sample)
