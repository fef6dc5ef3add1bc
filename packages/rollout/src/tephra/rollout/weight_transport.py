"""Which transport carries a weight update from the process that holds the new weights to a
generation server, decided by where the two run (`choose_transport`).

| where the receiver runs                       | `auto` picks | refused                     |
|-----------------------------------------------|--------------|-----------------------------|
| CPU (no GPU on the sender's side)             | `gloo`       | `nccl`, `ipc`               |
| the sender's own GPU (a server it started)    | `ipc`        | `nccl` (two ranks, one GPU) |
| the sender's GPU and others (a TP/DP server)  | `gloo`       | `nccl`, `ipc`               |
| another GPU (a server at `url`)               | `nccl`       | `ipc` (no shared memory)    |

`gloo` works everywhere (on GPU it stages through host memory, slowly), so it is never
refused by placement. Used at config load (the controller, before Ray starts) and again by
the rollout when it starts, with the same rules.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

from tephra.engine_api.errors import ConfigError

TRANSPORTS = ("gloo", "nccl", "ipc")
"""How buckets travel: broadcast over a gloo or NCCL group, or as shared-memory handles
(`tephra_weight_transport` carries all three)."""
AUTO = "auto"
WEIGHT_TRANSPORTS = (AUTO, *TRANSPORTS)
"""The values of `ServerSettings.weight_transport`."""


@dataclass(frozen=True)
class Placement:
    """Where the two ends of one weight hop run."""

    device: str
    """`cpu` or `cuda`: where the sender's tensors live."""
    same_device: bool
    """The receiver computes on the sender's GPU (a server the sender started inherits its
    device); False for a server started elsewhere (`url`)."""
    server_gpus: int = 1
    """GPUs one server spans (tensor x data parallel): a server this process starts over
    several GPUs has one rank on the sender's GPU (no NCCL) and the others elsewhere (no IPC)."""

    def describe(self) -> str:
        if self.device == "cpu":
            return "CPU"
        return "server on the sender's GPU" if self.same_device else "server on another GPU"


def check_transport_name(field: str, value: str) -> None:
    """Refuse an unknown transport name, naming the closest one."""
    if value not in WEIGHT_TRANSPORTS:
        close = difflib.get_close_matches(str(value), WEIGHT_TRANSPORTS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(
            f"{field}={value!r} is not a weight transport{hint}; choose one of "
            f"{list(WEIGHT_TRANSPORTS)}"
        )


def choose_transport(
    field: str,
    requested: str,
    placement: Placement,
    offered: tuple[str, ...] = TRANSPORTS,
    server: str = "the server",
) -> str:
    """The transport to use (`requested`, or the placement's for `auto`), or a ConfigError
    naming `field`, the value and the fix when it cannot work there (module docstring)."""
    check_transport_name(field, requested)
    if requested == AUTO:
        if placement.device == "cpu":
            return "gloo"
        if not placement.same_device:
            return "nccl"
        return "ipc" if placement.server_gpus == 1 else "gloo"
    if requested not in offered:
        raise ConfigError(
            f"{field}={requested!r}: {server} does not offer it (it offers "
            f"{list(offered)}); choose one of those or `auto`"
        )
    where = placement.describe()
    if requested == "ipc" and placement.device == "cpu":
        raise ConfigError(
            f"{field}='ipc' on CPU: ipc shares GPU memory by CUDA IPC handles; "
            "on CPU use `gloo` (what `auto` picks)"
        )
    if requested == "ipc" and not placement.same_device:
        raise ConfigError(
            f"{field}='ipc' with a {where}: CUDA IPC shares memory only "
            "between processes on one GPU of one node; use `nccl` (what `auto` "
            "picks) between different GPUs"
        )
    if requested == "ipc" and placement.server_gpus > 1:
        raise ConfigError(
            f"{field}='ipc' with a server over {placement.server_gpus} GPUs "
            "(tensor_parallel_size x data_parallel_size): the handles of the "
            "sender's GPU reach only the server rank on that GPU; use `gloo` "
            "(what `auto` picks) or a one-GPU server"
        )
    if requested == "nccl" and placement.device == "cpu":
        raise ConfigError(f"{field}='nccl' on CPU: NCCL needs CUDA; use `gloo` (what `auto` picks)")
    if requested == "nccl" and placement.same_device:
        raise ConfigError(
            f"{field}='nccl' with the {where}: NCCL refuses two ranks of one "
            "communicator on one GPU; use `ipc` (what `auto` picks) for a "
            "colocated server"
        )
    return requested
