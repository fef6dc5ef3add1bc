"""Leaving zero-advantage rows (flat GRPO groups) out of the actor update keeps the gradient,
at any data-parallel size.

Reference: the same engine, same weights, same batch, trained on every row with the plain
`ActorObjective` in one process. The skipped step must give the same gradients (fp32, 1e-6)
and report how many rows and groups it left out; with every group flat, the same weights
after AdamW. On 2 gloo ranks, one rank's share all flat (it keeps one row and runs filler
micro-batches to match the other's count), the gradient is still the full batch's.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor

from tephra.algos import ActorObjective
from tephra.algos.config import ActorObjectiveConfig
from tephra.controller.step.skip_flat import flat_groups, skip_zero_advantage_rows
from tephra.engine_api.testing import run_distributed
from tephra.engine_api.testing.batches import random_batch
from tephra.engine_fsdp import FSDPEngine
from tephra.engine_fsdp.testing import full_gradients, share_gradients, tiny_engine_config

GROUP = 4


def grpo_batch(scores: list[float], seed: int = 0):
    """A padded batch with GRPO advantages computed here, independently of tephra.algos:
    (s - mean_group) / (std_group + 1e-6), std unbiased, broadcast over response tokens."""
    engine = FSDPEngine.build(tiny_engine_config())
    vocab = engine.config.model.hf_config["vocab_size"]
    batch = random_batch(
        vocab, num_sequences=len(scores), prompt_lengths=(2, 9), response_lengths=(1, 9), seed=seed
    )
    s = torch.tensor(scores, dtype=torch.float32).view(-1, GROUP)
    adv = ((s - s.mean(1, keepdim=True)) / (s.std(1, keepdim=True) + 1e-6)).view(-1)
    mask = batch["response_mask"]
    batch["advantages"] = adv[:, None] * mask.float()
    batch["uid"] = torch.arange(len(scores)) // GROUP
    with engine.eval_mode():
        old = engine.forward(batch)["log_probs"]
    # the sampling policy differed a little, so ratios move off 1 and clipping takes part
    g = torch.Generator().manual_seed(seed + 1)
    batch["old_log_probs"] = old + 0.3 * torch.randn(old.shape, generator=g) * mask
    return batch


def params(engine) -> list[torch.Tensor]:
    return [
        (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for p in engine.scorer.parameters()
    ]


def step(batch, loss_fn, skip: bool, micro_tokens: int):
    engine = FSDPEngine.build(
        tiny_engine_config(
            **{"micro_batch.max_tokens_per_microbatch": micro_tokens, "optimizer.lr": 1e-2}
        )
    )
    metrics = {}
    with engine.train_mode():
        part = batch
        if skip:
            part, left_out = skip_zero_advantage_rows(batch)
            metrics = {"skipped_rows": left_out, "flat_groups": flat_groups(batch)}
        engine.forward_backward(part, loss_fn)
        g = full_gradients(engine)
        engine.optimizer_step()
    return g, params(engine), metrics, part.batch_size[0]


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("policy_loss", ["vanilla", "gspo"])
def test_skipping_flat_groups_keeps_the_gradient(agg, policy_loss):
    # group 0 all right, group 2 all wrong: flat; groups 1 and 3 mixed
    scores = [1, 1, 1, 1, 0, 1, 0, 0, 0, 0, 0, 0, 1, 0, 1, 1]
    batch = grpo_batch(scores)
    loss = ActorObjective(ActorObjectiveConfig(loss_agg_mode=agg, policy_loss=policy_loss))
    # a small token budget: several micro-batches, whose normalisers must be the full batch's
    g_full, _, _, rows_full = step(batch.clone(), loss, skip=False, micro_tokens=48)
    g_skip, _, metrics, rows_skip = step(batch.clone(), loss, skip=True, micro_tokens=48)
    assert rows_full == 16 and rows_skip == 8
    assert metrics == {"skipped_rows": 8, "flat_groups": 2}
    assert max(float(a.abs().max()) for a in g_full) > 1e-4  # the gradient is not trivially 0
    # (weights are not compared here: AdamW's first step, lr * g / (|g| + eps), turns fp32
    # summation-order noise on near-zero gradient entries into lr-sized differences)
    for a, b in zip(g_full, g_skip, strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6)


def test_all_flat_keeps_one_row_and_the_same_adamw_step():
    batch = grpo_batch([1, 1, 1, 1, 0, 0, 0, 0])
    loss = ActorObjective(ActorObjectiveConfig(loss_agg_mode="seq-mean-token-mean"))
    g_full, w_full, _, _ = step(batch.clone(), loss, skip=False, micro_tokens=4096)
    g_skip, w_skip, metrics, rows = step(batch.clone(), loss, skip=True, micro_tokens=4096)
    assert rows == 1  # one row keeps every parameter's (zero) gradient, so AdamW steps alike
    assert metrics == {"skipped_rows": 7, "flat_groups": 2}
    for a, b in zip(g_full, g_skip, strict=True):
        assert float(b.abs().max()) == 0.0 and float(a.abs().max()) == 0.0
    for a, b in zip(w_full, w_skip, strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6)


def test_no_flat_group_leaves_the_batch_alone():
    batch = grpo_batch([1, 0, 0, 0, 0, 1, 1, 0])
    part, left_out = skip_zero_advantage_rows(batch)
    assert part is batch and left_out == 0 and flat_groups(batch) == 0


@pytest.mark.multiproc
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_skipping_on_two_data_parallel_ranks_keeps_the_gradient(agg):
    # rank 0's share (groups 0, 1) is all flat: it keeps one row; rank 1 keeps group 2
    scores = [1, 1, 1, 1, 0, 0, 0, 0, 0, 1, 0, 0, 1, 1, 1, 1]
    batch = grpo_batch(scores)
    loss = ActorObjective(ActorObjectiveConfig(loss_agg_mode=agg))
    micro = {"micro_batch.max_tokens_per_microbatch": 48, "optimizer.lr": 1e-2}
    reference, _, _, _ = step(batch.clone(), loss, skip=False, micro_tokens=48)
    halves = [batch[:8], batch[8:]]
    kept = [skip_zero_advantage_rows(h.clone())[0] for h in halves]
    assert [k.batch_size[0] for k in kept] == [1, 4]
    plain = run_distributed(share_gradients, 2, (halves, loss, micro))[0]
    skipped = run_distributed(share_gradients, 2, (kept, loss, micro))[0]
    assert max(float(a.abs().max()) for a in reference) > 1e-4
    for ref, a, b in zip(reference, plain, skipped, strict=True):
        torch.testing.assert_close(a, ref, rtol=0, atol=1e-6)
        torch.testing.assert_close(b, ref, rtol=0, atol=1e-6)
