"""Helpers for tephra.kernels' own tests that must be importable by spawned processes
(a test module imported with --import-mode=importlib cannot be unpickled in a child)."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from tephra.kernels.head_transform import HeadTransform
from tephra.kernels.reference import naive_logprob_entropy
from tephra.kernels.vocab_parallel import vocab_parallel_logprob_entropy

TOKENS, HIDDEN, VOCAB = 23, 16, 70


def transformed_head_reference(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: float,
    head: HeadTransform,
    ignore_index: int = -100,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log_probs, entropy) [tokens] through the model's head as transformers writes it, in
    plain autograd: scale the hidden state, nn.functional.linear with the bias, scale the
    logits, cap * tanh(logits / cap), cut the vocabulary, divide by the temperature."""
    dtype = torch.promote_types(hidden.dtype, torch.float32)  # float64 stays float64
    h = hidden.to(dtype) * head.hidden_scale
    bias = head.bias.to(dtype) if head.bias is not None else None
    logits = torch.nn.functional.linear(h, weight.to(dtype), bias) * head.logit_scale
    if head.softcap is not None:
        logits = head.softcap * torch.tanh(logits / head.softcap)
    if head.vocab_size is not None:
        logits = logits[..., : head.vocab_size]
    log_p = torch.log_softmax(logits / temperature, dim=-1)
    valid = labels != ignore_index
    picked = log_p.gather(-1, torch.where(valid, labels, 0).unsqueeze(-1)).squeeze(-1)
    return torch.where(valid, picked, 0.0), -(log_p.exp() * log_p).sum(-1)


def vocab_parallel_problem() -> tuple[torch.Tensor, ...]:
    """Fixed random inputs: hidden [23, 16], weight [70, 16], labels (some ignored), grads."""
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(TOKENS, HIDDEN, generator=gen)
    w = torch.randn(VOCAB, HIDDEN, generator=gen) * 0.5
    y = torch.randint(0, VOCAB, (TOKENS,), generator=gen)
    y[::5] = -100
    y[1], y[2] = 0, VOCAB - 1  # labels at both ends of the vocabulary
    return h, w, y, torch.randn(TOKENS, generator=gen), torch.randn(TOKENS, generator=gen)


def _unsharded(temperature: float, compute_entropy: bool = True) -> tuple[torch.Tensor, ...]:
    h, w, y, g1, g2 = vocab_parallel_problem()
    h.requires_grad_(), w.requires_grad_()
    lp, ent, *_ = naive_logprob_entropy(h, w, y, temperature)
    assert ent is not None  # compute_entropy defaults to True
    loss = lp * g1 + ent * g2 if compute_entropy else lp * g1
    gh, gw = torch.autograd.grad(loss.sum(), [h, w])
    return lp.detach(), ent.detach(), gh, gw


def vocab_parallel_worker(rank: int, world: int, port: int, queue: Any) -> None:
    """One gloo rank: run the sharded function for three cases and put the max abs errors
    (logp, entropy, grad hidden, this rank's rows of grad weight) vs the unsharded naive."""
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        h, w, y, g1, g2 = vocab_parallel_problem()
        errors = {}
        # equal shards (vocab_start from the rank), uneven ones (explicit vocab_start), and
        # log-probs only (entropy neither computed nor differentiated)
        cases = [
            ("even", [0, 35, 70], 0.7, 6, True),
            ("uneven", [0, 52, 70], 1.4, None, True),
            ("no_entropy", [0, 35, 70], 1.2, 4, False),
        ]
        for case, bounds, temp, chunk, with_entropy in cases:
            lo, hi = bounds[rank], bounds[rank + 1]
            hs = h.clone().requires_grad_()
            ws = w[lo:hi].clone().requires_grad_()
            kwargs: dict[str, Any] = {"vocab_start": lo} if case == "uneven" else {}
            lp, ent, *_ = vocab_parallel_logprob_entropy(
                hs, ws, y, None, temp, chunk_size=chunk, compute_entropy=with_entropy, **kwargs
            )
            assert (ent is None) == (not with_entropy)
            loss = lp * g1 + ent * g2 if ent is not None else lp * g1  # with_entropy
            gh, gw = torch.autograd.grad(loss.sum(), [hs, ws])
            ref_lp, ref_ent, ref_gh, ref_gw = _unsharded(temp, with_entropy)
            errors[case] = [
                (lp - ref_lp).abs().max().item(),
                (ent - ref_ent).abs().max().item() if ent is not None else 0.0,
                (gh - ref_gh).abs().max().item(),
                (gw - ref_gw[lo:hi]).abs().max().item(),
            ]
        # a transformed head (scales, soft-cap, the shard's bias) against plain autograd
        lo, hi = [0, 52, 70][rank], [0, 52, 70][rank + 1]
        bias = torch.randn(VOCAB, generator=torch.Generator().manual_seed(1))
        hs, ws = h.clone().requires_grad_(), w[lo:hi].clone().requires_grad_()
        bs = bias[lo:hi].clone().requires_grad_()
        shard = HeadTransform(hidden_scale=0.5, logit_scale=1.5, softcap=2.5, bias=bs)
        lp, ent, *_ = vocab_parallel_logprob_entropy(
            hs, ws, y, None, 0.9, vocab_start=lo, chunk_size=5, head=shard
        )
        assert ent is not None
        gh, gw, gb = torch.autograd.grad((lp * g1 + ent * g2).sum(), [hs, ws, bs])
        rh, rw = h.clone().requires_grad_(), w.clone().requires_grad_()
        rb = bias.clone().requires_grad_()
        ref = HeadTransform(hidden_scale=0.5, logit_scale=1.5, softcap=2.5, bias=rb)
        ref_lp, ref_ent = transformed_head_reference(rh, rw, y, 0.9, ref)
        ref_gh, ref_gw, ref_gb = torch.autograd.grad(
            (ref_lp * g1 + ref_ent * g2).sum(), [rh, rw, rb]
        )
        errors["head"] = [
            (lp - ref_lp).abs().max().item(),
            (ent - ref_ent).abs().max().item(),
            (gh - ref_gh).abs().max().item(),
            (gw - ref_gw[lo:hi]).abs().max().item(),
            (gb - ref_gb[lo:hi]).abs().max().item(),
        ]
        # sum_pi_squared rides on the forward's all-reduce: against a float64 softmax
        lo, hi = [0, 52, 70][rank], [0, 52, 70][rank + 1]
        _, _, *extra = vocab_parallel_logprob_entropy(
            h, w[lo:hi], y, None, 0.8, vocab_start=lo, compute_sum_pi_squared=True
        )
        q = extra[0]
        ref_q = torch.softmax((h.double() @ w.double().T) / 0.8, -1).pow(2).sum(-1)
        errors["sum_pi_squared"] = [(q.double() - ref_q).abs().max().item()]
        queue.put((rank, errors))
    finally:
        dist.destroy_process_group()
