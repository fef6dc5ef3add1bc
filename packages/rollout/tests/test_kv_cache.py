"""`GrowingLayer`: decoding through a cache that grows in place gives transformers'
`DynamicCache` results bitwise, across buffer growth and row selection."""

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from tephra.rollout.backends.kv_cache import GrowingLayer, growing_cache


def _decode(model, cache, ids, steps, select_at=None, rows=None):
    """Prefill `ids`, then `steps` greedy tokens one at a time; optionally keep only `rows`
    after step `select_at`. Returns the logits of every step, concatenated on rows kept."""
    out = model(input_ids=ids, past_key_values=cache, use_cache=True)
    logits, token = [], out.logits[:, -1:].argmax(-1)
    for step in range(steps):
        if step == select_at:
            index = torch.tensor(rows)
            cache.batch_select_indices(index)
            token = token[index]
        out = model(input_ids=token, past_key_values=cache, use_cache=True)
        logits.append(out.logits[:, -1])
        token = out.logits[:, -1:].argmax(-1)
    return logits


def test_growing_cache_equals_dynamic_cache_bitwise(tiny_model):
    model = AutoModelForCausalLM.from_pretrained(tiny_model.path, dtype=torch.float32).eval()
    ids = torch.randint(0, 300, (4, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        # the 7-token prefill makes a buffer of 71 places; 90 steps force a growth
        ref = _decode(model, DynamicCache(config=model.config), ids, 90, select_at=40, rows=[3, 1])
        cache = growing_cache(model.config)
        got = _decode(model, cache, ids, 90, select_at=40, rows=[3, 1])
    assert all(isinstance(layer, GrowingLayer) for layer in cache.layers)
    assert cache.get_seq_length() == 7 + 90
    assert cache.layers[0]._key_buffer.shape[-2] > 97  # grew past the first buffer
    for a, b in zip(got, ref, strict=True):
        assert torch.equal(a, b)
    cache.crop(-5)
    assert cache.get_seq_length() == 92
