"""Token-balanced data-parallel split (`tephra.controller.step.balance`).

A long-tail batch (most responses a few tokens, a few near 60) split by row counts leaves one
rank with most of the tokens; the Karmarkar-Karp order brings the ratio of the busiest
rank's tokens to the idlest's under 1.1 with equal row counts. The update is the same: the
gradients of 2 gloo ranks on the balanced order equal those on the plain order and those of
one process on the whole batch (fp32, 1e-6), with a sequence-mean loss whose normalisers
are the step's global counts.
"""

from __future__ import annotations

import pytest
import torch

from tephra.algos import ActorObjective
from tephra.algos.config import ActorObjectiveConfig
from tephra.controller.step.balance import balanced_order, karmarkar_karp, max_over_min
from tephra.controller.step.batch_order import BatchOrder
from tephra.engine_api import batch as B
from tephra.engine_api.testing import run_distributed
from tephra.engine_fsdp import FSDPEngine
from tephra.engine_fsdp.testing import (
    TINY_VOCAB,
    full_gradients,
    share_gradients,
    tiny_engine_config,
)

ROWS = 32
LOSS = ActorObjective(ActorObjectiveConfig(loss_agg_mode="seq-mean-token-mean"))
MICRO = {"micro_batch.max_tokens_per_microbatch": 160}


LONG = (3, 7, 11, 14, 20)
"""The long responses: four in the first half (one prompt's group ran long), one after."""


def long_tail_lengths(n: int = ROWS, seed: int = 0) -> list[int]:
    """Response lengths: 1-6 tokens for most rows, 40-60 for the `LONG` ones."""
    g = torch.Generator().manual_seed(seed)
    return [
        int(torch.randint(40, 61, (1,), generator=g))
        if i in LONG
        else int(torch.randint(1, 7, (1,), generator=g))
        for i in range(n)
    ]


def skewed_batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    responses = long_tail_lengths(seed=seed)
    prompts = [int(torch.randint(2, 7, (1,), generator=g)) for _ in responses]
    width_p, width_r = max(prompts), max(responses)
    ids = torch.zeros(len(responses), width_p + width_r, dtype=torch.int64)
    attn, resp = torch.zeros_like(ids), torch.zeros_like(ids)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        ids[i, width_p - p : width_p + r] = torch.randint(1, TINY_VOCAB, (p + r,), generator=g)
        attn[i, width_p - p : width_p + r] = 1
        resp[i, width_p : width_p + r] = 1
    batch = B.make_batch(ids, attn, resp)
    batch["advantages"] = torch.randn(len(responses), 1, generator=g) * resp
    engine = FSDPEngine.build(tiny_engine_config())
    with engine.eval_mode():
        old = engine.forward(batch)["log_probs"]
    batch["old_log_probs"] = old + 0.3 * torch.randn(old.shape, generator=g) * resp
    return batch


def test_karmarkar_karp_balances_a_long_tail_with_equal_counts():
    tokens = skewed_batch()["attention_mask"].sum(-1).tolist()
    before = max_over_min(tokens, None, 2)
    order = balanced_order(tokens, 2)
    after = max_over_min(tokens, order, 2)
    assert sorted(order) == list(range(ROWS))
    assert before > 1.5 and after <= 1.1, (before, after)
    for parts in (2, 4):
        sets = karmarkar_karp(tokens, parts)
        assert sorted(i for s in sets for i in s) == list(range(ROWS))
        assert {len(s) for s in sets} == {ROWS // parts}
    # mini-batches: rank d's share lists its rows of mini-batch 0, then of mini-batch 1, and
    # each rank's half of a mini-batch comes from that mini-batch's rows
    order = balanced_order(tokens, 2, chunks=2)
    for d in range(2):
        share = order[d * 16 : (d + 1) * 16]
        assert all(r < 16 for r in share[:8]) and all(r >= 16 for r in share[8:])
    with pytest.raises(ValueError, match="do not split into 3 equal parts"):
        karmarkar_karp([1, 2], 3)


@pytest.mark.multiproc
def test_balance_moves_whole_keep_together_pairs():
    # a long-tail batch of 16 pairs (SPIN's chosen / rejected rows) on 2 ranks x 2 mini-batches
    lengths = long_tail_lengths()
    attn = torch.zeros(ROWS, max(lengths), dtype=torch.int64)
    for i, n in enumerate(lengths):
        attn[i, :n] = 1
    batch = B.make_batch(attn.clone(), attn, attn * (torch.arange(attn.shape[1]) > 0))
    batch[B.KEEP_TOGETHER] = torch.arange(ROWS) // 2
    order = BatchOrder()
    metrics = order.plan(batch, dp=2, balance=True, mini_batches=2)
    rows = order.order.tolist()
    assert sorted(rows) == list(range(ROWS))
    # every rank's mini-batch (8 rows: the contiguous split) holds 4 whole pairs
    for k in range(0, ROWS, 2):
        assert rows[k] // 2 == rows[k + 1] // 2 and rows[k] % 2 == 0
    assert (
        metrics["balance/max_over_min_tokens_after"] < metrics["balance/max_over_min_tokens_before"]
    )
    # pairs that do not split whole into ranks x mini-batches are refused
    with pytest.raises(ValueError, match=r"16 units of rows .* do not split whole into 6"):
        order.plan(batch, dp=2, balance=True, mini_batches=3)


def test_balanced_update_equals_the_plain_split_and_one_process():
    batch = skewed_batch()
    tokens = batch["attention_mask"].sum(-1).tolist()
    engine = FSDPEngine.build(tiny_engine_config(**MICRO))
    with engine.train_mode():
        engine.forward_backward(batch, LOSS)
    reference = full_gradients(engine)
    assert max(float(g.abs().max()) for g in reference) > 1e-4
    balanced = batch[torch.tensor(balanced_order(tokens, 2))]
    plain = run_distributed(share_gradients, 2, ([batch[:16], batch[16:]], LOSS, MICRO))[0]
    balanced = run_distributed(share_gradients, 2, ([balanced[:16], balanced[16:]], LOSS, MICRO))[0]
    for ref, a, b in zip(reference, plain, balanced, strict=True):
        torch.testing.assert_close(a, ref, rtol=0, atol=1e-6)
        torch.testing.assert_close(b, ref, rtol=0, atol=1e-6)
