"""Data parallelism with megatron's distributed optimizer (ZeRO-1) against a single-process
run: its own file so that pytest-xdist runs it beside the other multi-process tests."""

from __future__ import annotations

import numpy as np
import pytest

from tephra.engine_api.testing import random_batch, run_distributed
from tephra.engine_megatron import testing as T

pytestmark = pytest.mark.multiproc


def _same_steps(ranks: list[dict], ref: dict) -> None:
    """Every rank's 3 steps equal the reference run; its resumed step 3 equals its own."""
    for r in ranks:
        assert np.allclose(r["losses"], ref["losses"], rtol=0, atol=1e-5), (r["losses"], ref)
        assert np.allclose(r["norms"], ref["norms"], rtol=0, atol=1e-4), (r["norms"], ref)
        assert r["weights"].keys() == ref["weights"].keys()
        for name, want in ref["weights"].items():
            assert np.abs(r["weights"][name] - want).max() <= 1e-5, name
        assert r["resumed_losses"] == r["losses"][2:]
        assert r["resumed_norms"] == r["norms"][2:]
        assert all(np.array_equal(r["resumed_weights"][k], v) for k, v in r["weights"].items())


def test_dp2_distributed_optimizer_equals_dp1(tmp_path):
    """DP=2 with megatron's distributed optimizer (ZeRO-1), dense and Qwen2-MoE (experts
    sharded over the expert data-parallel group, EDP=2): 3 AdamW steps (cosine lr) equal a
    single-process DP=1 run on the same global batch (loss 1e-5, grad norm 1e-4, final
    weights 1e-5); each rank's optimizer holds only its slice (about half; the two slices add
    up to the parameter count); a fresh engine loading the checkpoint written after step 2
    repeats step 3 bit for bit (loss, grad norm, weights)."""
    dense = {**T.TINY_DENSE, "num_hidden_layers": 2}
    batch = random_batch(dense["vocab_size"], num_sequences=8, seed=7)
    runs = [(dense, batch, str(tmp_path / "dense")), (T.TINY_MOE, batch, str(tmp_path / "moe"))]
    ranks = run_distributed(T.rank_sequence, 2, ([(T.rank_dp_steps, args) for args in runs],))
    for i, (model, _, workdir) in enumerate(runs):
        ref = T.rank_dp_steps(model, batch, workdir + "-dp1")  # this process: a world of one
        total = ref["param_numel"]
        assert ref["local_numel"] == total
        per_rank = [r[i] for r in ranks]
        assert sum(r["local_numel"] for r in per_rank) == total
        assert all(abs(r["local_numel"] - total / 2) <= 0.05 * total for r in per_rank)
        assert all(r["param_numel"] == total for r in per_rank)
        _same_steps(per_rank, ref)


@pytest.mark.slow
def test_tp2_sp_dp2_distributed_optimizer_equals_dp1(tmp_path):
    """4 ranks, TP=2 + sequence parallel x DP=2 with the distributed optimizer: the same 3
    steps as a single-process run (loss 1e-5, grad norm 1e-4, weights 1e-5); the slices of
    each TP shard add up over its two DP ranks; resume is bit-exact. (slow: 4 processes on a
    2-core machine took over 60 s.)"""
    model = {**T.TINY_DENSE, "num_hidden_layers": 2}
    batch = random_batch(model["vocab_size"], num_sequences=8, seed=7)
    parallel = {"tensor": 2, "sequence_parallel": True}
    ranks = run_distributed(
        T.rank_dp_steps, 4, (model, batch, str(tmp_path / "tp2dp2"), 3, 2, parallel)
    )
    ref = T.rank_dp_steps(model, batch, str(tmp_path / "dp1"))
    assert all(r["dp_size"] == 2 for r in ranks)
    assert sum(r["local_numel"] for r in ranks) * 2 == sum(r["param_numel"] for r in ranks)
    _same_steps(ranks, ref)
