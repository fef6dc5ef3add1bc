"""An app's `rollout` section: the backend by name, its dtype and sampling, and each backend's
settings (the trainer's `rollout` section extends it with the episode fields)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from tephra.core.errors import ConfigError
from tephra.core.registry import check_registered
from tephra.engine_api.fastest_dtype import AUTO
from tephra.rollout.base import DTYPES, HFSettings, ServerSettings
from tephra.rollout.registry import ROLLOUT_BACKENDS


@dataclass
class RolloutSection:
    """Generation: the backend by name, sampling, and each backend's own settings."""

    backend: str = "hf"
    """Rollout backend from tephra.rollout.ROLLOUT_BACKENDS: `hf` (in-process transformers),
    `vllm`, `sglang` (servers)."""
    dtype: str = "auto"
    """Generation dtype: `float32`, `bfloat16`, `float16`, or `auto`: bfloat16 where the
    workers' device computes it faster than float32 (measured once at start: on a CPU with
    avx512_bf16 the demo's generate took 3.6 s in bf16 vs 5.5 s in fp32; on an AVX2-only
    CPU bf16 matmuls ran 3-7x slower than fp32). The trainer recomputes log-probs in its own
    dtype, so this only changes what is sampled."""
    temperature: float = 1.0
    """Sampling temperature (the trainer's log-probs use the same)."""
    top_p: float = 1.0
    """Nucleus sampling; 1 keeps every token (log-probs then match the trainer exactly)."""
    top_k: int = -1
    """Top-k sampling; -1 keeps every token."""
    max_tokens: int = 32
    """Most response tokens per sample (per model turn with an agent loop)."""
    sleep_when_training: bool = True
    """Colocated (hybrid) mode: `rollout.sleep()` after generation, so the rollout's memory
    is free while the engine trains (a GPU backend frees its weights / KV cache, a server as
    deep as `rollout.<backend>.sleep_level` says; on CPU the hf backend has nothing to free).
    The weight sync wakes it: a server's weights first, then its KV cache after the load."""
    hf: HFSettings = field(default_factory=HFSettings)
    """Settings of the `hf` backend (device is set from the rank's device)."""
    vllm: ServerSettings = field(default_factory=ServerSettings)
    """Settings of the `vllm` server backend."""
    sglang: ServerSettings = field(default_factory=ServerSettings)
    """Settings of the `sglang` server backend."""

    def __post_init__(self) -> None:
        check_registered("rollout.backend", self.backend, ROLLOUT_BACKENDS)
        protocol = getattr(ROLLOUT_BACKENDS.get(self.backend), "protocol_class", None)
        if protocol is not None:
            try:
                protocol().check_settings(getattr(self, self.backend))
            except ConfigError as exc:
                raise ConfigError(f"rollout.{exc}") from None
        if self.max_tokens < 1:
            raise ConfigError(f"rollout.max_tokens={self.max_tokens} must be >= 1")
        if self.dtype not in (*DTYPES, AUTO):  # the backend checks too, but only once Ray runs
            raise ConfigError(
                f"rollout.dtype={self.dtype!r} is not allowed; choose one of {[*DTYPES, AUTO]}"
            )
        if not math.isfinite(self.temperature) or self.temperature < 0:
            # NaN passes `< 0` and sampling then behaved as if it were 1.0
            what = "" if math.isfinite(self.temperature) else "a finite number "
            raise ConfigError(
                f"rollout.temperature={self.temperature} must be {what}>= 0 (1.0 "
                "samples from the policy as it is; 0 is greedy)"
            )
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"rollout.top_p={self.top_p} must be in (0, 1]")

    @property
    def server(self) -> ServerSettings | None:
        """The chosen backend's server settings; None for an in-process backend (`hf`)."""
        settings = getattr(self, self.backend, None)
        return settings if isinstance(settings, ServerSettings) else None

    @property
    def tensor_parallel_size(self) -> int:
        """Ranks per rollout engine: a server backend's `tensor_parallel_size`, 1 for `hf`
        (one in-process model per rank). Generation's data-parallel size is the world size
        divided by it."""
        settings = getattr(self, self.backend, None)
        return settings.tensor_parallel_size if isinstance(settings, ServerSettings) else 1
