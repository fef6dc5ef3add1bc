"""Per-sequence attention without dense masks: the plan against a naive mask, the torch
kernel against a naive GQA softmax, packed micro-batches against the padded run (with no
`[S, S]` tensor built), and the kernel choice and its refusals."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tephra.engine_api import BatchError, ConfigError, apply_overrides
from tephra.engine_api.testing import nll_loss_fn, random_batch
from tephra.engine_megatron import testing as T
from tephra.engine_megatron.core_attention import (
    _ring_blocks,
    _torch_blocks,
    attention_plan,
    choose_kernel,
    cp_chunk_index,
)
from tephra.engine_megatron.engine import MegatronEngine

SMALL = {**T.TINY_DENSE, "num_hidden_layers": 2}


def _naive_mask(segments: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """[rows, s_local, S]: local query i (natural position p) may see key k iff k <= p and k
    lies in the same run of equal sequence ids as p (padding runs included)."""
    rows, s = segments.shape
    mask = torch.zeros(rows, len(local), s, dtype=torch.bool)
    for r in range(rows):
        for i, p in enumerate(local.tolist()):
            k = p
            while k >= 0 and segments[r, k] == segments[r, p]:
                mask[r, i, k] = True
                k -= 1
    return mask


def _mask_from_plan(plan: torch.Tensor, rows: int, s_local: int, s: int) -> torch.Tensor:
    mask = torch.zeros(rows, s_local, s, dtype=torch.bool)
    for row, q0, q1, k0, k1 in plan.tolist():
        lq, lk = q1 - q0, k1 - k0
        mask[row, q0:q1, k0:k1] = torch.ones(lq, lk, dtype=torch.bool).tril(lk - lq)
    return mask


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_plan_equals_the_naive_block_causal_mask(cp):
    """Packed and padded rows (left and right padding), with the load-balanced CP layout."""
    segments = torch.tensor(
        [
            [0] * 5 + [1] * 9 + [2] * 7 + [-1] * 3,  # packed, padded at the end
            [-1] * 4 + [3] * 14 + [-1] * 6,  # a padded row
        ]
    )
    s = segments.shape[1]
    for rank in range(cp):
        local = cp_chunk_index(rank, cp, s) if cp > 1 else torch.arange(s)
        plan = attention_plan(segments, local if cp > 1 else None)
        got = _mask_from_plan(plan, 2, len(local), s)
        assert torch.equal(got, _naive_mask(segments, local))
        # every local position is the query of exactly one block
        covered = torch.zeros(2, len(local), dtype=torch.long)
        for row, q0, q1, *_ in plan.tolist():
            covered[row, q0:q1] += 1
        assert (covered == 1).all()


@pytest.mark.parametrize("window", [None, 3, 4])
def test_torch_kernel_equals_a_naive_gqa_softmax(window):
    """Grouped heads (4 query heads on 2 key/value heads) through SDPA's own GQA, square and
    bottom-right blocks, against softmax(q k^T * scale + mask) v with k/v repeated by hand;
    gradients too. With a sliding window (sequences of 5, 7 and 9 tokens: query tiles, the
    last one short), query position p sees keys p - window < k <= p."""
    g = torch.Generator().manual_seed(0)
    s, b, heads, groups, d = 12, 2, 4, 2, 8
    q = torch.randn(s, b, heads, d, generator=g, requires_grad=True)
    k = torch.randn(s, b, groups, d, generator=g, requires_grad=True)
    v = torch.randn(s, b, groups, d, generator=g, requires_grad=True)
    segments = torch.tensor([[0] * 5 + [1] * 7, [-1] * 3 + [2] * 9])
    local = cp_chunk_index(0, 2, s)  # queries from two chunks: bottom-right blocks appear
    plan = attention_plan(segments, local)
    out = _torch_blocks(q[local], k, v, plan.tolist(), 0.3, 0.0, window)
    mask = _naive_mask(segments, local)  # [b, sq, sk]
    if window is not None:
        mask &= torch.arange(s)[None, None, :] > local[None, :, None] - window
    kr, vr = k.repeat_interleave(2, dim=2), v.repeat_interleave(2, dim=2)
    scores = torch.einsum("qbhd,kbhd->bhqk", q[local], kr) * 0.3
    scores = scores.masked_fill(~mask[:, None], float("-inf"))
    want = torch.einsum("bhqk,kbhd->qbhd", scores.softmax(-1), vr)
    assert (out - want).abs().max() < 1e-6
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    want_grads = torch.autograd.grad(want.square().sum(), (q, k, v))
    for got, ref in zip(grads, want_grads):
        assert (got - ref).abs().max() < 1e-5


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_merge_equals_a_naive_softmax_over_all_keys(cp):
    """The ring's per-chunk partial attention merged by log-sum-exp, chunks arriving in ring
    order (this rank's first), on every CP rank: equal to a naive softmax over all keys of
    the sequence (queries of this rank's two chunks), and so are the gradients."""
    g = torch.Generator().manual_seed(1)
    s, b, heads, groups, d = 16, 2, 4, 2, 8
    q = torch.randn(s, b, heads, d, generator=g, requires_grad=True)
    k = torch.randn(s, b, groups, d, generator=g, requires_grad=True)
    v = torch.randn(s, b, groups, d, generator=g, requires_grad=True)
    segments = torch.tensor([[0] * 3 + [1] * 9 + [2] * 2 + [-1] * 2, [-1] * 5 + [3] * 11])
    kr, vr = k.repeat_interleave(2, dim=2), v.repeat_interleave(2, dim=2)
    for rank in range(cp):
        local = cp_chunk_index(rank, cp, s)
        plan = attention_plan(segments, local)
        order = [(rank - step) % cp for step in range(cp)]
        chunks = [
            (src, k[cp_chunk_index(src, cp, s)], v[cp_chunk_index(src, cp, s)]) for src in order
        ]
        out = _ring_blocks(q[local], iter(chunks), plan.tolist(), local, s, 0.3)
        mask = _naive_mask(segments, local)
        scores = torch.einsum("qbhd,kbhd->bhqk", q[local], kr) * 0.3
        scores = scores.masked_fill(~mask[:, None], float("-inf"))
        want = torch.einsum("bhqk,kbhd->qbhd", scores.softmax(-1), vr)
        assert (out - want).abs().max() < 1e-6
        grads = torch.autograd.grad(out.square().sum(), (q, k, v))
        want_grads = torch.autograd.grad(want.square().sum(), (q, k, v))
        for got, ref in zip(grads, want_grads):
            assert (got - ref).abs().max() < 1e-5


class _Shapes(TorchDispatchMode):
    """Records the shape of every tensor any aten op returns (forward and backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for o in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(o, torch.Tensor):
                self.shapes.append(tuple(o.shape))
        return out


def test_packed_micro_batches_equal_the_padded_run_without_a_dense_mask():
    """Packed (THD) micro-batches: forward log-probs equal transformers (1e-5), and loss
    (1e-5) and grad norm (1e-4) equal the padded run. No op of either run returns a tensor
    whose last two dims are the packed length (or the padded row length) twice: no
    `[b, 1, S, S]` or `[S, S]` mask, no `[S, S]` scores."""
    batch = random_batch(SMALL["vocab_size"], num_sequences=6, seed=11)
    ids = batch["input_ids"]
    logp = torch.log_softmax(
        T.HFReference(SMALL).logits(ids, batch["attention_mask"], batch["position_ids"]), -1
    )
    want = torch.zeros(ids.shape)
    want[:, 1:] = logp[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
    want = want * batch["response_mask"]
    results = {}
    for packed in (True, False):
        # a small budget: several packed micro-batches, each holding several sequences
        engine = MegatronEngine.build(
            apply_overrides(
                T.base_config(SMALL),
                {
                    "micro_batch.use_packing": packed,
                    "micro_batch.max_tokens_per_microbatch": 40,
                    "micro_batch.forward_max_tokens_per_microbatch": 40,
                },
            )
        )
        out = engine.forward(batch)
        assert (out["log_probs"] - want).abs().max() <= 1e-5
        with _Shapes() as seen, engine.train_mode():
            loss = engine.forward_backward(batch, nll_loss_fn)["loss"]
            norm = engine.optimizer_step()
        results[packed] = (loss, norm, seen.shapes)
    (loss_p, norm_p, shapes_p), (loss_d, norm_d, shapes_d) = results[True], results[False]
    assert abs(loss_p - loss_d) <= 1e-5 and abs(norm_p - norm_d) <= 1e-4
    # the longest packed row holds several sequences (budget 40 tokens, sequences < 14)
    lengths = batch["attention_mask"].sum(-1)
    assert int(lengths.max()) < 14
    square = {sh[-1] for sh in shapes_p + shapes_d if len(sh) >= 2 and sh[-1] == sh[-2]}
    assert not square & set(range(14, 41)), square  # packed rows are 14..40 tokens long
    assert ids.shape[1] not in {sh[-1] for sh in shapes_d if len(sh) >= 2 and sh[-1] == sh[-2]}


def test_kernel_choice_and_refusals():
    """`sdpa` is torch on CPU (and wherever flash-attn / TransformerEngine are missing, in
    fp32, or with context parallel); `flash_attention_2` is refused naming the field and
    the reason; the engine refuses other transformers kernels."""
    assert choose_kernel("sdpa", torch.float32, on_cuda=False, cp_size=1) == "torch"
    assert choose_kernel("sdpa", torch.float32, on_cuda=True, cp_size=1) == "torch"
    assert choose_kernel("sdpa", torch.bfloat16, on_cuda=True, cp_size=2) == "torch"
    with pytest.raises(ConfigError, match=r"model\.attn_implementation='flash_attention_2'"):
        choose_kernel("flash_attention_2", torch.bfloat16, on_cuda=False, cp_size=1)
    for impl in ("flash_attention_2", "eager"):
        with pytest.raises(ConfigError, match=r"model\.attn_implementation"):
            MegatronEngine.check_config(
                apply_overrides(T.base_config(SMALL), {"model.attn_implementation": impl})
            )


def test_a_sequence_with_a_hole_is_refused():
    batch = random_batch(SMALL["vocab_size"], num_sequences=2, seed=1)
    row = batch["attention_mask"][0]
    real = row.nonzero().flatten()
    row[real[1]] = 0  # a 0 between two real prompt tokens
    batch["response_mask"][0, real[1]] = 0
    engine = MegatronEngine.build(
        apply_overrides(T.base_config(SMALL), {"micro_batch.use_packing": False})
    )
    with pytest.raises(BatchError, match="row 0: attention_mask"):
        engine.forward(batch)


@pytest.mark.multiproc
def test_ring_context_parallel_equals_cp1():
    """CP=2 by ring (K/V passed between the two ranks, log-sum-exp merge) against the same
    engine at CP=1: padded micro-batches, and packed ones of one sequence each; log-probs
    and loss 1e-5, grad norm 1e-4."""
    from tephra.engine_api.testing import run_distributed

    batch = random_batch(SMALL["vocab_size"], num_sequences=6, seed=13)
    longest = int(batch["attention_mask"].sum(-1).max())
    layouts = [
        {"micro_batch.use_packing": False},
        # one short sequence per micro-batch: some chunks hold only padding, and a rank whose
        # queries see nothing of the other rank's chunk must still take part in the backward
        {"micro_batch.use_packing": True, "micro_batch.max_tokens_per_microbatch": longest},
    ]
    calls = [(T.rank_step, (SMALL, {"context": 2}, batch, o)) for o in layouts]
    ring = run_distributed(T.rank_sequence, 2, (calls,))
    for i, overrides in enumerate(layouts):
        loss1, norm1, lp1 = T.rank_step(SMALL, {}, batch, overrides)
        for rank_results in ring:
            loss, norm, lp = rank_results[i]
            assert abs(loss - loss1) <= 1e-5 and abs(norm - norm1) <= 1e-4
            assert (lp - lp1).abs().max() <= 1e-5
