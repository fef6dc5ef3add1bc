"""The automatic (`None`) launch settings of a server backend, resolved for where it runs.

| field                    | CPU                  | GPU, colocated with the trainer        | GPU, own GPUs / `url` |
|--------------------------|----------------------|----------------------------------------|-----------------------|
| `enforce_eager`          | true (eager)         | false (CUDA graphs)                    | false (CUDA graphs)   |
| `sleep_level`            | 0 (CPU vLLM refuses) | 1 (weights to host, KV cache freed)    | 0                     |
| `gpu_memory_utilization` | unset (ignored)      | what the trainer's peak leaves (below) | unset (server's 0.9)  |

A colocated server's fraction is `(total - trainer_peak - RESERVE_BYTES) / total` of its
smallest GPU, rounded down to a hundredth and capped at `MAX_UTILIZATION`; where n ranks share
one GPU (fractional GPUs per rank), `(total - n * (trainer_peak + RESERVE_BYTES)) / n / total`
each. The trainer's peak counts its activations too, although the server sleeps while they
exist: a run with an explicit `sleep_level=0` then still fits, and the server's start (before
the trainer allocates) never takes the memory the trainer needs later. An explicit value of any
field always wins.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from tephra.engine_api.errors import ConfigError
from tephra.rollout.base import ServerSettings

GIB = 1024**3
RESERVE_BYTES = 2 * GIB
"""Left to neither side: the CUDA contexts of the trainer and the server (~0.5 GiB each), NCCL
buffers and the caching allocator's fragmentation."""
MAX_UTILIZATION = 0.9
"""vLLM's own default: a colocated server never takes more than a server alone would."""
MIN_KV_BYTES = 1 * GIB
"""Least KV cache a colocated server is sized for: less refuses the run at start."""


@dataclass(frozen=True)
class ColocatedBudget:
    """What the trainer beside a server on the same GPUs needs, and what those GPUs hold."""

    trainer_peak_bytes: int
    """The trainer's estimated peak on one GPU (one rank: its shard of the parameters,
    gradients and optimizer state, and one micro-batch's activations and logits)."""
    gpu_total_bytes: int
    """Total memory of the smallest GPU the server spans."""
    server_weight_bytes: int
    """The server's weights on one of its GPUs (the model in the rollout dtype / its
    tensor-parallel size)."""
    basis: str
    """How the peak was found, for the printed line (e.g. `estimated from 1.5B params: ...`)."""
    sharing: int = 1
    """Ranks (each with its trainer and, where it holds one, its server) sharing one GPU
    (fractional `resources.gpus_per_rank`): the GPU holds that many trainers and reserves, and
    each server gets its share of what is left."""


@dataclass(frozen=True)
class Resolved:
    """A server's settings with every automatic field made concrete, and the line that says
    what was chosen (None where nothing was chosen for colocation)."""

    settings: ServerSettings
    note: str | None


def colocated_utilization(budget: ColocatedBudget, field: str) -> float:
    """The fraction of GPU memory a colocated server may take (module docstring), or a
    ConfigError naming `field` and the fixes when what is left cannot hold its weights and
    `MIN_KV_BYTES` of KV cache."""
    total, n = budget.gpu_total_bytes, budget.sharing
    left = (total - n * (budget.trainer_peak_bytes + RESERVE_BYTES)) // n
    needed = budget.server_weight_bytes + MIN_KV_BYTES
    if left < needed:
        shared = f" for each of {n} ranks sharing the GPU" if n > 1 else ""
        raise ConfigError(
            f"{field}: the trainer's estimated peak {budget.trainer_peak_bytes / GIB:.1f} GiB "
            f"({budget.basis}) + {RESERVE_BYTES / GIB:.0f} GiB reserve{shared} leaves "
            f"{max(left, 0) / GIB:.1f} GiB of the GPU's {total / GIB:.1f} GiB, less than the "
            f"colocated server's weights {budget.server_weight_bytes / GIB:.1f} GiB + "
            f"{MIN_KV_BYTES / GIB:.0f} GiB of KV cache; shard the trainer over more ranks "
            "(resources.world_size, actor.parallel.fsdp_size), offload its optimizer "
            "(actor.offload.optimizer=true), lower actor.micro_batch.max_tokens_per_microbatch, "
            f"put the rollout on GPUs of its own (resources.rollout.replicas), or set {field} "
            "yourself"
        )
    return min(MAX_UTILIZATION, math.floor(100 * left / total) / 100)


def resolve_server_settings(
    settings: ServerSettings,
    backend: str,
    device: str,
    budget: ColocatedBudget | None = None,
    sleeps: bool = True,
) -> Resolved:
    """`settings` with `enforce_eager`, `sleep_level` and `gpu_memory_utilization` resolved
    where None (module docstring): `device` is where the server computes (`cpu`, `cuda`, or
    `cuda:i`); `budget` is given for a server tephra starts on the trainer's GPUs; `sleeps`
    says whether its owner puts it to sleep while training (if not, no sleep mode). The note
    is the once-per-run line of a colocated GPU server."""
    cuda = device.startswith("cuda")
    colocated = cuda and budget is not None and settings.url is None
    eager = settings.enforce_eager if settings.enforce_eager is not None else not cuda
    sleep = settings.sleep_level if settings.sleep_level is not None else int(colocated and sleeps)
    share = settings.gpu_memory_utilization
    if share is None and colocated:
        assert budget is not None  # `colocated` says so
        share = colocated_utilization(budget, f"rollout.{backend}.gpu_memory_utilization")
    out = replace(settings, enforce_eager=eager, sleep_level=sleep, gpu_memory_utilization=share)
    if not colocated:
        return Resolved(out, None)
    assert budget is not None

    def how(value: object) -> str:
        return "auto" if value is None else "set"

    if settings.gpu_memory_utilization is None:
        shared = f", {budget.sharing} ranks per GPU" if budget.sharing > 1 else ""
        memory = (
            f"gpu_memory_utilization={share:.2f} (auto: trainer peak "
            f"{budget.trainer_peak_bytes / GIB:.1f} GiB of {budget.gpu_total_bytes / GIB:.1f} "
            f"GiB{shared}, {budget.basis}; {RESERVE_BYTES / GIB:.0f} GiB reserve)"
        )
    else:
        memory = f"gpu_memory_utilization={share:.2f} (set)"
    graphs = "eager" if eager else "cuda graphs on"
    return Resolved(
        out,
        f"colocated {backend} on cuda: {memory}, sleep_level={sleep} "
        f"({how(settings.sleep_level)}), {graphs} ({how(settings.enforce_eager)})",
    )
