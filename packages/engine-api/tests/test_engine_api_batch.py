"""Batch convention: validation messages, packing round trip, token-budget splitting."""

from __future__ import annotations

import pytest
import torch

from tephra.engine_api import batch as B
from tephra.engine_api.errors import BatchError
from tephra.engine_api.testing import random_batch


def small_batch():
    ids = torch.tensor([[0, 0, 5, 6, 7, 0], [3, 4, 5, 6, 7, 8]])
    attn = torch.tensor([[0, 0, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]])
    resp = torch.tensor([[0, 0, 0, 1, 1, 0], [0, 0, 0, 1, 1, 1]])
    return B.make_batch(
        ids, attn, resp, advantages=torch.arange(12.0).view(2, 6), uid=torch.tensor([7, 9])
    )


def test_positions_restart_over_real_tokens():
    b = small_batch()
    assert b[B.POSITION_IDS].tolist() == [[0, 0, 0, 1, 2, 2], [0, 1, 2, 3, 4, 5]]


def test_pack_unpack_round_trip_by_hand():
    b = small_batch()
    p = B.pack(b)
    assert p[B.CU_SEQLENS].tolist() == [0, 3, 9]
    assert p[B.INPUT_IDS].tolist() == [5, 6, 7, 3, 4, 5, 6, 7, 8]
    assert p[B.POSITION_IDS].tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 5]
    assert p["per_sample.uid"].tolist() == [7, 9]
    back = B.unpack(p["advantages"], b[B.ATTENTION_MASK])
    assert torch.equal(back, b["advantages"] * b[B.ATTENTION_MASK])


def test_split_by_token_budget_keeps_order_and_budget():
    b = random_batch(100, num_sequences=16, seed=4)
    lengths = B.sequence_lengths(b).tolist()
    for packed in (True, False):
        mbs = B.split_by_token_budget(b, max(lengths) + 3, packed)
        ids = torch.cat([mb[B.INPUT_IDS][mb[B.ATTENTION_MASK].bool()] for mb in mbs])
        assert torch.equal(ids, b[B.INPUT_IDS][b[B.ATTENTION_MASK].bool()])
        for mb in mbs:
            cost = B.microbatch_cost(B.sequence_lengths(mb).tolist(), packed)
            assert cost <= max(lengths) + 3
            assert mb[B.ATTENTION_MASK].any(0).all()  # padding-only columns trimmed


def test_split_never_cuts_a_keep_together_unit():
    b = random_batch(100, num_sequences=16, seed=4)
    b[B.KEEP_TOGETHER] = torch.arange(16) // 2  # pairs of consecutive rows
    lengths = B.sequence_lengths(b).tolist()
    pair_cost = max(lengths[i] + lengths[i + 1] for i in range(0, 16, 2))
    for packed in (True, False):
        budget = pair_cost if packed else 2 * max(lengths)
        mbs = B.split_by_token_budget(b, budget, packed)
        assert len(mbs) > 1
        # the naive reference: every micro-batch starts at a pair's first row
        starts, row = [], 0
        for mb in mbs:
            starts.append(row)
            row += mb.batch_size[0]
        assert row == 16 and all(s % 2 == 0 for s in starts)
        for mb in mbs:
            assert B.microbatch_cost(B.sequence_lengths(mb).tolist(), packed) <= budget
    # halving cuts at the pair boundary nearest the middle; one pair cannot be halved
    first, second = B.halve(b[:6])
    assert (first.batch_size[0], second.batch_size[0]) == (2, 4)
    assert B.halve(b[:2]) is None
    with pytest.raises(BatchError, match=r"rows \d+..\d+ must share a micro-batch \(keep_together"):
        B.split_by_token_budget(b, max(lengths), packed=True)


def test_split_refuses_a_sequence_longer_than_the_budget():
    with pytest.raises(BatchError, match=r"sequence 1 has 6 tokens.*max_tokens_per_microbatch=5"):
        B.split_by_token_budget(small_batch(), 5, packed=True)


def test_global_normalisers_count_tokens_and_sequences():
    mbs = B.split_by_token_budget(small_batch(), 6, packed=True)
    assert B.set_global_normalisers(mbs) == (5.0, 2.0)
    assert all(float(mb[B.GLOBAL_TOKEN_COUNT][0]) == 5.0 for mb in mbs)
    # rows left out by the caller still count: 7 tokens in 3 sequences, noted on one row
    batch = small_batch()
    batch[B.LEFT_OUT_TOKENS] = torch.tensor([7.0, 0.0])
    batch[B.LEFT_OUT_SEQS] = torch.tensor([3.0, 0.0])
    mbs = B.split_by_token_budget(batch, 6, packed=True)
    assert len(mbs) == 2 and B.set_global_normalisers(mbs) == (12.0, 5.0)
    assert all(float(mb[B.GLOBAL_SEQ_COUNT][0]) == 5.0 for mb in mbs)


@pytest.mark.parametrize(
    "mutate, needle",
    [
        (lambda b: b.exclude(B.RESPONSE_MASK), "response_mask"),
        (lambda b: b.set(B.INPUT_IDS, b[B.INPUT_IDS].float()), "integer token ids"),
        (lambda b: b.set(B.RESPONSE_MASK, torch.ones_like(b[B.RESPONSE_MASK])), "padding position"),
        (
            lambda b: b.set(B.ATTENTION_MASK, torch.zeros_like(b[B.ATTENTION_MASK])).set(
                B.RESPONSE_MASK, torch.zeros_like(b[B.RESPONSE_MASK])
            ),
            "all 0",
        ),
    ],
)
def test_validation_names_the_problem(mutate, needle):
    with pytest.raises(BatchError, match=needle):
        B.validate_batch(mutate(small_batch().clone()))


def test_validation_refuses_a_trained_first_token():
    b = small_batch()
    b[B.RESPONSE_MASK][1, 0] = 1
    with pytest.raises(BatchError, match="row 1: response_mask is 1 on the sequence's first token"):
        B.validate_batch(b)


def test_label_positions_and_alignment_are_inverse_shifts():
    mask = torch.tensor([[0, 0, 1, 1]])
    assert B.label_positions(mask).tolist() == [[0, 1, 1, 0]]
    assert B.align_to_tokens(torch.tensor([[1.0, 2.0, 3.0, 4.0]])).tolist() == [[0, 1, 2, 3]]
