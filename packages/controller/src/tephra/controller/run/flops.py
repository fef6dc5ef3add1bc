"""Model FLOPs of an RL step, counted from the tokens each pass must compute, and the peak MFU divides by.

A token at position t (0-based) costs `2 * matmul_params + 4 * layers * attn_width * (t + 1)`
FLOPs in a forward pass: every weight that multiplies it (the input embedding is a lookup and
is left out; an MoE layer counts its routed share of the experts) and causal attention over
the t + 1 keys up to it (QK^T and AV). A prompt shared by a group's samples is counted once,
a backward pass twice a forward, activation recomputation not at all: model FLOPs, the lower
bound of the work, so `perf/mfu` cannot pass 1 by counting work twice. The peak is the
device's published dense figure where known (`perf/mfu`), else the best matmul rate this
machine has shown (`perf/mfu_measured_peak`).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDict

from tephra.core.machine import cache_root, cpu_name, published_peak
from tephra.engine_api.multimodal import is_vision_config


@dataclass(frozen=True)
class ModelShape:
    """What the FLOP count needs of a model."""

    matmul_params: int
    """Parameters that multiply each token: all but the input embedding (a tied head counts
    once, as the head), experts scaled by the share a token is routed to."""
    layers: int
    """Transformer layers."""
    attn_width: int
    """Query heads x head size: the width of QK^T and AV per key."""

    def token_flops(self, position: int) -> float:
        """Forward FLOPs of the token at `position` (0-based; it attends to position + 1 keys)."""
        return 2.0 * self.matmul_params + 4.0 * self.layers * self.attn_width * (position + 1)

    def span_flops(self, start: int, end: int) -> float:
        """Forward FLOPs of positions [start, end) (closed form of summing `token_flops`)."""
        if end <= start:
            return 0.0
        keys = (end * (end + 1) - start * (start + 1)) // 2  # sum of position + 1
        return 2.0 * self.matmul_params * (end - start) + 4.0 * self.layers * self.attn_width * keys


def model_shape(path: str) -> ModelShape:
    """The `ModelShape` of the Hugging Face model at `path`, built on the meta device."""
    # heavy: transformers takes seconds to import; the driver needs it only here
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    config = AutoConfig.from_pretrained(path)
    auto = AutoModelForImageTextToText if is_vision_config(config) else AutoModelForCausalLM
    with torch.device("meta"):
        model = auto.from_config(config)
    text = config.get_text_config()
    routed = getattr(text, "num_experts_per_tok", None)
    experts = getattr(text, "num_experts", None) or getattr(text, "num_local_experts", None)
    embedding = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    tied = head is not None and head.weight is embedding
    total = 0.0
    for name, param in model.named_parameters():
        if param is embedding and not tied:
            continue
        share = routed / experts if routed and experts and ".experts." in name else 1.0
        total += param.numel() * share
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return ModelShape(round(total), text.num_hidden_layers, heads * head_dim)


def row_spans(batch: TensorDict) -> list[tuple[int, int, int]]:
    """(group, prompt tokens, all tokens) of each row: the prompt ends where the first
    response token (mask 1) begins; `prompt_index` names the group (each row its own without)."""
    attn = batch["attention_mask"].bool()
    resp = batch["response_mask"].bool() & attn
    groups = batch["prompt_index"].tolist() if "prompt_index" in batch.keys() else None
    spans = []
    for i in range(attn.shape[0]):
        real = attn[i].nonzero().flatten()
        total = len(real)
        starts = resp[i].nonzero().flatten()
        prompt = int((real < starts[0]).sum()) if len(starts) else total
        spans.append((groups[i] if groups is not None else -1 - i, prompt, total))
    return spans


def pass_flops(shape: ModelShape, spans: list[tuple[int, int, int]]) -> float:
    """Forward FLOPs of one pass over the rows: each group's prompt once, each row's rest."""
    prompts: dict[int, int] = {}
    flops = 0.0
    for group, prompt, total in spans:
        prompts[group] = max(prompts.get(group, 0), prompt)
        flops += shape.span_flops(prompt, total)
    return flops + sum(shape.span_flops(0, p) for p in prompts.values())


def step_flops(
    shape: ModelShape, batch: TensorDict, forward_passes: int, trained_passes: int
) -> float:
    """Model FLOPs of one step: generation (the prompts once, each token after them; the last
    token is sampled, never fed back), `forward_passes` forward-only passes (reference, values,
    old log-probs) and `trained_passes` passes forward and backward (3x a forward)."""
    spans = row_spans(batch)
    full = pass_flops(shape, spans)
    generation = pass_flops(shape, [(g, p, max(t - 1, p)) for g, p, t in spans])
    return generation + full * (forward_passes + 3 * trained_passes)


def peak_cache_file() -> Path:
    return cache_root() / "peak_flops.json"


def measured_peak(device: str, dtype: str, seconds: float = 0.3) -> float:
    """The best matmul rate (FLOP/s) this machine has shown for `device` and `dtype` with this
    process's threads: each call times single products for `seconds` and keeps the fastest,
    and the cache keeps the best over calls, so a measurement under load does not lower it."""
    dev = torch.device(device)
    n = 2048 if dev.type == "cuda" else 512
    a = torch.randn(n, n, device=dev, dtype=getattr(torch, dtype))
    best = 0.0
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        a @ a
        if dev.type == "cuda":
            torch.cuda.synchronize()
        best = max(best, 2 * n**3 / (time.perf_counter() - t0))
    key = f"{device_name(dev)}|{dtype}|threads={torch.get_num_threads()}"
    cache = peak_cache_file()
    known: dict[str, Any] = {}
    try:
        known = json.loads(cache.read_text())
    except (OSError, ValueError):
        pass
    best = max(best, float(known.get(key, 0.0)))
    known[key] = best
    try:  # a read-only home only loses the memory of earlier runs
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(known, indent=1, sort_keys=True))
        tmp.replace(cache)
    except OSError:
        pass
    return best


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return cpu_name()


def device_peak(device: str, dtype: str) -> tuple[float, bool]:
    """(peak FLOP/s, whether it is the published figure) of one rank computing in `dtype`."""
    dev = torch.device(device)
    published = published_peak(device_name(dev), dtype) if dev.type == "cuda" else None
    if published is not None:
        return published, True
    return measured_peak(device, dtype), False
