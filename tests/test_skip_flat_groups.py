"""Leaving zero-advantage rows (flat GRPO groups) out of the actor update keeps the gradient.

Reference: the same engine, same weights, same batch, trained on every row with the plain
`ActorObjective`. The skipped step must give the same gradients
(fp32, 1e-6) and report how many rows and groups it left out; with every group flat, the
same weights after AdamW.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor

from tephra.algos import ActorObjective
from tephra.algos.config import ActorObjectiveConfig
from tephra.controller.rl_worker import skip_zero_advantage_rows
from tephra.engine_api.testing.batches import random_batch
from tephra.engine_fsdp import FSDPEngine
from tephra.engine_fsdp.testing import tiny_engine_config

GROUP = 4


def grpo_batch(scores: list[float], seed: int = 0):
    """A padded batch with GRPO advantages computed here, independently of tephra.algos:
    (s - mean_group) / (std_group + 1e-6), std unbiased, broadcast over response tokens."""
    engine = FSDPEngine.build(tiny_engine_config())
    vocab = engine.config.model.hf_config["vocab_size"]
    batch = random_batch(vocab, num_sequences=len(scores), prompt_lengths=(2, 9),
                         response_lengths=(1, 9), seed=seed)
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


def grads(engine) -> list[torch.Tensor]:
    out = []
    for p in engine.scorer.parameters():
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        out.append((g.full_tensor() if isinstance(g, DTensor) else g).detach().clone())
    return out


def params(engine) -> list[torch.Tensor]:
    return [(p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for p in engine.scorer.parameters()]


def step(batch, loss_fn, skip: bool, micro_tokens: int):
    engine = FSDPEngine.build(tiny_engine_config(**{
        "micro_batch.max_tokens_per_microbatch": micro_tokens, "optimizer.lr": 1e-2}))
    metrics = {}
    with engine.train_mode():
        part, fn = batch, loss_fn
        if skip:
            part, fn, metrics = skip_zero_advantage_rows(batch, loss_fn)
        engine.forward_backward(part, fn)
        g = grads(engine)
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
    assert metrics == {"actor/skipped_rows": 8.0, "actor/skipped_flat_groups": 2.0}
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
    assert metrics == {"actor/skipped_rows": 7.0, "actor/skipped_flat_groups": 1.0}
    for a, b in zip(g_full, g_skip, strict=True):
        assert float(b.abs().max()) == 0.0 and float(a.abs().max()) == 0.0
    for a, b in zip(w_full, w_skip, strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6)


def test_no_flat_group_leaves_the_batch_alone():
    batch = grpo_batch([1, 0, 0, 0, 0, 1, 1, 0])
    loss = ActorObjective()
    part, fn, metrics = skip_zero_advantage_rows(batch, loss)
    assert part is batch and fn is loss
    assert metrics == {"actor/skipped_rows": 0.0, "actor/skipped_flat_groups": 0.0}
