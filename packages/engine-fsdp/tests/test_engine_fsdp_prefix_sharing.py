"""Shared prompt prefixes (`micro_batch.share_prefix`): the same outputs, gradients and
weights as running every row whole, on a GRPO-shaped batch (the 2-rank case is in the
conformance test)."""

import pytest
import torch

from tephra.engine_api import batch as B
from tephra.engine_api.errors import ConfigError
from tephra.engine_api.testing import nll_loss_fn
from tephra.engine_fsdp import FSDPEngine, prefix_sharing
from tephra.engine_fsdp.testing import grouped_batch, tiny_engine_config, train_step


def test_find_by_hand():
    # rows 0, 1, 3 share a left-padded prompt [0, 5, 6]; row 2 differs; the first scored
    # column is 2 (token 3 is the first response token anywhere)
    ids = torch.tensor([[0, 5, 6, 7, 8], [0, 5, 6, 9, 0], [4, 5, 6, 7, 0], [0, 5, 6, 1, 2]])
    attn = (ids != 0).long()
    attn[2] = torch.tensor([1, 1, 1, 1, 0])
    labels = torch.zeros_like(ids)
    labels[:, 2:4] = 1
    shared = prefix_sharing.find(ids, attn, labels)
    assert shared.cut == 2
    assert shared.first.tolist() == [0, 2] and shared.owner.tolist() == [0, 0, 1, 0]
    # nothing shared, or nothing scored: run whole
    assert prefix_sharing.find(ids[1:3], attn[1:3], labels[1:3]) is None
    assert prefix_sharing.find(ids, attn, torch.zeros_like(ids)) is None


def _engine(share: bool, **overrides):
    return FSDPEngine.build(tiny_engine_config(**{"micro_batch.share_prefix": share, **overrides}))


@pytest.mark.parametrize("overrides", [{}, {"model.gradient_checkpointing": True}])
def test_shared_prefix_equals_whole_rows(monkeypatch, overrides):
    batch = grouped_batch(groups=3, n=4, seed=1)
    calls = []
    layout = prefix_sharing.layout
    monkeypatch.setattr(prefix_sharing, "layout", lambda *a: calls.append(layout(*a)) or calls[-1])
    out, steps, grads = {}, {}, {}
    for share in (True, False):
        engine = _engine(share, **overrides)
        # shared rows attend per block (`tree_attention`), the others through SDPA
        assert engine.hf_model.config._attn_implementation == (
            "tephra_tree_sdpa" if share else "sdpa"
        )
        with engine.eval_mode():
            out[share] = engine.forward(batch)
        with engine.train_mode():
            engine.forward_backward(batch, nll_loss_fn)
        grads[share] = {
            n: p.grad.full_tensor().clone()
            for n, p in engine.model.named_parameters()
            if p.grad is not None
        }
        engine.optimizer.zero_grad(set_to_none=True)
        steps[share] = [train_step(engine, batch) for _ in range(2)]
    # forward, forward_backward + 2 training steps: one micro-batch each, 12 rows, 3 prefixes,
    # laid out flat (one row, no padding) for the block attention
    assert len(calls) == 4 and all(
        c.input_ids.shape[0] == 1 and c.attention_mask is None and c.blocks[0].query.shape[0] == 3
        for c in calls
    )
    mask = batch[B.RESPONSE_MASK].bool()
    for key in ("log_probs", "entropy"):
        assert out[True][key][mask].abs().min() > 0
        torch.testing.assert_close(out[True][key], out[False][key], atol=1e-5, rtol=0)
    for (loss, norm), (want_loss, want_norm) in zip(steps[True], steps[False]):
        assert loss == pytest.approx(want_loss, abs=1e-6)
        assert norm == pytest.approx(want_norm, abs=1e-5)
    assert grads[True].keys() == grads[False].keys() and len(grads[False]) > 10
    for name, grad in grads[False].items():
        torch.testing.assert_close(grads[True][name], grad, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize(
    "overrides, key",
    [
        ({"model.role": "value"}, "values"),
        ({"model.attn_implementation": "eager"}, "log_probs"),  # the mask as 0 / min additive
    ],
)
def test_value_model_and_eager_attention_share_too(overrides, key):
    batch = grouped_batch(groups=2, n=3, seed=2)
    out = {}
    for share in (True, False):
        engine = _engine(share, **overrides)
        with engine.eval_mode():
            out[share] = engine.forward(batch)[key]
    assert out[True].abs().max() > 0
    torch.testing.assert_close(out[True], out[False], atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "overrides",
    [
        {"micro_batch.use_packing": True},
        {"model.attn_implementation": "flash_attention_2"},  # packs by default
    ],
)
def test_forced_where_unsupported_is_refused(overrides):
    with pytest.raises(ConfigError, match=r"micro_batch.share_prefix=true needs padded"):
        _engine(True, **overrides)


def test_long_segments_run_whole():
    # the prefix is column 0 (column 1 is scored), each row adds a 41-token segment: 2 rows
    # make a tree row of 83 tokens, 83^2 <= 4 x 2 x 42^2: shared; 8 rows make 329 tokens,
    # 329^2 > 4 x 8 x 42^2: the rows run whole
    def rows(n):
        ids = torch.cat(
            [
                torch.tensor([[3, 4]]).expand(n, 2),
                torch.randint(5, 200, (n, 40), generator=torch.Generator().manual_seed(0)),
            ],
            1,
        )
        resp = torch.zeros_like(ids)
        resp[:, 2:] = 1
        attn = torch.ones_like(ids)
        return ids, attn, B.positions_from_mask(attn), B.label_positions(resp) * attn

    assert prefix_sharing.layout(*rows(2)) is not None
    assert prefix_sharing.layout(*rows(8)) is None
    # the flat layout has no dense mask: its blocks attend over less than the rows do
    assert prefix_sharing.layout(*rows(8), flat=True) is not None


def test_flat_layout_by_hand():
    """`flat=True`: the tree rows end to end without padding, the scored positions mapped
    into it, no dense mask. Rows 0 and 1 share the prompt [5, 6]; row 2's prompt [4] is
    left-padded. The first scored column is 1 (token 2 is the first response token), so the
    shared prefix is column 0: [5] for rows 0 and 1, nothing real for row 2."""
    ids = torch.tensor([[5, 6, 7, 8, 9], [5, 6, 3, 0, 0], [0, 4, 2, 2, 0]])
    attn = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [0, 1, 1, 1, 0]])
    resp = torch.zeros_like(ids)
    resp[:, 2:] = 1
    labels = B.label_positions(resp * attn) * attn
    tree = prefix_sharing.layout(ids, attn, B.positions_from_mask(attn), labels, flat=True)
    assert tree.attention_mask is None
    assert tree.input_ids.tolist() == [[5, 6, 7, 8, 9, 6, 3, 4, 2, 2]]
    assert tree.position_ids.tolist() == [[0, 1, 2, 3, 4, 1, 2, 0, 1, 2]]
    # scored (row, column) -> flat position, in the label mask's row-major order
    assert labels.nonzero().tolist() == [[0, 1], [0, 2], [0, 3], [1, 1], [2, 1], [2, 2]]
    assert tree.scored.tolist() == [1, 2, 3, 5, 7, 8]
    prefix, segments = tree.blocks
    assert prefix.target.tolist() == [0]
    assert [k[m.any(0)].tolist() for k, m in zip(segments.key, segments.mask[:, 0])] == [
        [0, 1, 2, 3, 4],
        [0, 5, 6],
        [7, 8, 9],
    ]


def test_tree_attention_blocks_equal_the_dense_mask():
    """`tree_attention` per prefix and segment block: the outputs and the gradients of the
    dense-mask SDPA at every real position (grouped-query heads, two tree rows with prefixes
    and segments of different lengths, padding); padding positions get zeros."""
    from tephra.engine_fsdp import tree_attention

    seg = torch.tensor([[-1, -1, -1, 0, 0, 1, 1, 1, -2], [-1, -1, 2, 2, 2, 3, -2, -2, -2]])
    blocks = tree_attention.tree_blocks([seg[0, :8], seg[1, :6]], [0, 9])
    prefix, segments = blocks
    assert prefix.query.shape == (2, 3) and segments.query.shape == (4, 3)
    # segment 1 (row 0, positions 5-7) sees the prefix 0-2 and itself causally
    assert segments.key[1].tolist() == [0, 1, 2, 5, 6, 7]
    assert segments.mask[1, 0].int().tolist() == [
        [1, 1, 1, 1, 0, 0],
        [1, 1, 1, 1, 1, 0],
        [1, 1, 1, 1, 1, 1],
    ]
    real = (seg != -2).flatten()
    assert sorted(torch.cat([b.target for b in blocks]).tolist()) == real.nonzero()[:, 0].tolist()

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 9, 4, generator=gen, requires_grad=True) for h in (6, 2, 2))
    module = torch.nn.Module().eval()
    got, _ = tree_attention.tree_attention(module, q, k, v, None, tree_blocks=blocks)
    qs, ks = seg[:, :, None], seg[:, None, :]
    dense = torch.ones(9, 9, dtype=torch.bool).tril() & (ks != -2) & ((ks == -1) | (ks == qs))
    dense |= torch.eye(9, dtype=torch.bool) & (qs == -2)
    want = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=dense[:, None], enable_gqa=True
    ).transpose(1, 2)
    got_real, want_real = got.flatten(0, 1)[real], want.flatten(0, 1)[real]
    torch.testing.assert_close(got_real, want_real, atol=1e-6, rtol=1e-5)
    assert got.flatten(0, 1)[~real].abs().max() == 0
    weights = torch.randn(got_real.shape, generator=gen)
    grads = [torch.autograd.grad((x * weights).sum(), (q, k, v)) for x in (got_real, want_real)]
    for g_tree, g_dense in zip(*grads):
        torch.testing.assert_close(g_tree, g_dense, atol=1e-6, rtol=1e-5)
