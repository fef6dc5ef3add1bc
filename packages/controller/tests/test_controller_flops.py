"""Model FLOPs against a count by hand, the peak MFU divides by, and the start-up timeline."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig

from tephra.controller.run.flops import device_peak, model_shape, row_spans, step_flops
from tephra.core.machine import published_peak
from tephra.engine_api.batch import make_batch

H, LAYERS, HEADS, KV, INTER, VOCAB = 64, 3, 4, 2, 96, 500
HD = H // HEADS


def hand_params(tied: bool) -> int:
    """Qwen2's weights that multiply a token, from its architecture (not from torch)."""
    attn = (H * HEADS * HD + HEADS * HD) + 2 * (H * KV * HD + KV * HD) + HEADS * HD * H
    mlp = 3 * H * INTER
    norms = 2 * H
    return LAYERS * (attn + mlp + norms) + H + VOCAB * H  # final norm, head (tied or not)


def save_config(folder, tied: bool) -> str:
    """A tiny qwen2's config.json (no weights: the FLOP count reads the config alone)."""
    AutoConfig.for_model(
        "qwen2",
        vocab_size=VOCAB,
        hidden_size=H,
        intermediate_size=INTER,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV,
        tie_word_embeddings=tied,
    ).save_pretrained(folder)
    return str(folder)


@pytest.mark.parametrize("tied", [False, True])
def test_model_shape_counts_what_multiplies_a_token(tmp_path, tied):
    shape = model_shape(save_config(tmp_path, tied))
    assert (shape.matmul_params, shape.layers, shape.attn_width) == (hand_params(tied), 3, 64)


def test_step_flops_equal_a_count_token_by_token(tmp_path):
    shape = model_shape(save_config(tmp_path, tied=False))
    # two groups of two samples: prompts of 3 and 2 tokens (left-padded), responses of
    # 2, 4 | 1, 3 tokens (right-padded)
    rows = [(0, 3, 2), (0, 3, 4), (1, 2, 1), (1, 2, 3)]
    width_p, width_r = 3, 4
    ids = torch.ones(4, width_p + width_r, dtype=torch.long)
    attn = torch.zeros_like(ids)
    resp = torch.zeros_like(ids)
    for i, (_, p, r) in enumerate(rows):
        attn[i, width_p - p : width_p + r] = 1
        resp[i, width_p : width_p + r] = 1
    batch = make_batch(ids, attn, resp, prompt_index=torch.tensor([g for g, _, _ in rows]))
    assert row_spans(batch) == [(g, p, p + r) for g, p, r in rows]

    def token(t: int) -> float:  # forward FLOPs of position t, by the formula
        return 2 * hand_params(False) + 4 * LAYERS * HEADS * HD * (t + 1)

    prompts = {g: p for g, p, _ in rows}
    prompt_once = sum(token(t) for p in prompts.values() for t in range(p))
    forward = prompt_once + sum(token(t) for _, p, r in rows for t in range(p, p + r))
    generation = prompt_once + sum(token(t) for _, p, r in rows for t in range(p, p + r - 1))
    # the demo's GRPO step: one old-log-prob pass, one reference pass, one epoch trained
    expected = generation + forward * (2 + 3 * 1)
    assert step_flops(shape, batch, forward_passes=2, trained_passes=1) == pytest.approx(
        expected, rel=1e-12
    )
    # counting each row's prompt again (what a model without prefix sharing computes) is more
    per_row = sum(token(t) for _, p, r in rows for t in range(p + r))
    assert per_row > forward


def test_published_peaks_and_the_measured_one(tmp_path, monkeypatch):
    assert published_peak("NVIDIA H100 80GB HBM3", "bfloat16") == 989e12
    assert published_peak("NVIDIA H100 PCIe", "bfloat16") == 756e12
    assert published_peak("NVIDIA H200", "float32") == 67e12
    assert published_peak("NVIDIA A100-SXM4-80GB", "bfloat16") == 312e12
    assert published_peak("NVIDIA L4", "bfloat16") is None
    monkeypatch.setenv("TEPHRA_CACHE", str(tmp_path))
    peak, published = device_peak("cpu", "float32")
    assert not published and peak > 0
    cache = json.loads((tmp_path / "peak_flops.json").read_text())
    (key,) = cache
    # the cache keeps the best rate seen: a planted higher one is returned, not lowered
    (tmp_path / "peak_flops.json").write_text(json.dumps({key: peak * 100}))
    assert device_peak("cpu", "float32") == (peak * 100, False)


def test_startup_timeline_starts_at_the_process_start():
    import time

    from tephra.controller.cluster.startup import Timeline, process_age_s

    age = process_age_s()
    assert 0 < age < 3600  # this pytest process started before the test, not at boot
    clock = Timeline()
    time.sleep(0.05)
    clock.lap("a")
    summary = clock.summary()
    assert list(summary) == ["imports_s", "a_s", "total_s"]
    assert summary["imports_s"] >= round(age, 2) and summary["a_s"] >= 0.05
    assert summary["total_s"] == pytest.approx(summary["imports_s"] + summary["a_s"], abs=0.02)
