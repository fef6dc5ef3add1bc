"""Streamed export: the safetensors writer against safetensors' own reader, and the streamed
`export_weights` / `export_hf` against the export before streaming (every rank gathered the
whole model with `all_gather_object`), bitwise, single-process and at TP=2, PP=2 and EP=2."""

from __future__ import annotations

import random

import pytest
import torch
from safetensors.torch import load_file

from tephra.engine_api.testing import run_distributed
from tephra.engine_megatron import testing as T
from tephra.engine_megatron.safetensors_stream import SafetensorsWriter


def test_writer_equals_safetensors_reader_in_any_order(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {
        "a.weight": torch.randn(3, 5, generator=g),
        "b.bias": torch.randn(7, generator=g).to(torch.bfloat16),
        "c.idx": torch.arange(6).reshape(2, 3),
        "d.half": torch.randn(2, 2, 2, generator=g).half(),
        "e.scalar": torch.tensor(1.5),
    }
    entries = [(n, tuple(t.shape), t.dtype) for n, t in tensors.items()]
    order = list(tensors)
    random.Random(1).shuffle(order)
    with SafetensorsWriter(tmp_path / "m.safetensors", entries) as w:
        for n in order:
            w.write(n, tensors[n])
    read = load_file(tmp_path / "m.safetensors")
    assert read.keys() == tensors.keys()
    assert all(read[n].dtype == t.dtype and torch.equal(read[n], t) for n, t in tensors.items())


def test_writer_checks_shapes_and_completeness(tmp_path):
    t = torch.ones(2, 3)
    with pytest.raises(ValueError, match=r"a: got \(3, 2\)"):
        with SafetensorsWriter(tmp_path / "x.safetensors", [("a", (2, 3), t.dtype)]) as w:
            w.write("a", t.t())
    with pytest.raises(ValueError, match="without"):
        with SafetensorsWriter(tmp_path / "y.safetensors", [("a", (2, 3), t.dtype)]):
            pass


def test_streamed_export_equals_the_gathered_one_single_process(tmp_path):
    (result,) = T.rank_streamed_export([("dense_tied", {})], str(tmp_path))
    assert all(result[k] for k in ("unique_names", "export_equal", "untied_head", "hf_equal"))
    assert result["buckets"] > 10  # 20 kB buckets: the stream is cut into many


@pytest.mark.multiproc
def test_streamed_export_at_tp2_pp2_ep2(tmp_path):
    """TP=2 + SP (dense), PP=2 with tied embeddings, EP=2 (Qwen2-MoE: fused experts arrive
    from both ranks): after one step, every rank's streamed export and rank 0's
    safetensors equal the gathered export bitwise."""
    runs = [
        ("dense", {"tensor": 2, "sequence_parallel": True}),
        ("dense_tied", {"pipeline": 2}),
        ("moe", {"expert": 2}),
    ]
    results = run_distributed(T.rank_streamed_export, 2, (runs, str(tmp_path)))
    for rank, per_run in enumerate(results):
        for run, result in zip(runs, per_run):
            checks = ["unique_names", "export_equal", "untied_head"]
            checks += ["hf_equal"] if rank == 0 else []
            assert all(result[k] for k in checks), (rank, run, result)
