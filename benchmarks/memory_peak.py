"""What the memory benchmarks share: this process's resident-set peak since a reset (Linux
/proc), and the small long-context Qwen2 they measure on."""

from __future__ import annotations

from pathlib import Path

SMALL_QWEN2 = dict(
    model_type="qwen2",
    vocab_size=1024,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=65536,
    tie_word_embeddings=True,
    rms_norm_eps=1e-6,
)
"""A transformers config of a small Qwen2 (GQA: 4 query heads on 2 key/value heads) whose
positions reach 65536 tokens."""


def status_mib(field: str) -> float:
    """A `/proc/self/status` memory field (`VmRSS`, `VmHWM`) in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024.0  # kB -> MiB
    raise RuntimeError(f"/proc/self/status has no {field}")


def reset_peak() -> float:
    """Reset the resident-set peak (`5` into /proc/self/clear_refs sets VmHWM to VmRSS) and
    return the resident set now, in MiB: `status_mib("VmHWM") - reset_peak()` is the peak
    that what runs in between added."""
    Path("/proc/self/clear_refs").write_text("5")
    return status_mib("VmRSS")
