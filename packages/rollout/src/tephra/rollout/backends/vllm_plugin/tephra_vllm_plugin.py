"""Loaded inside the vLLM server: a weight-transfer engine named `tephra` for vLLM's RL
endpoints (`/init_weight_transfer_engine`, `/start_weight_update`, `/update_weights`,
`/finish_weight_update`).

vLLM's own `nccl` and `ipc` engines need CUDA; this one takes all three transports of
`tephra_weight_transport`: a broadcast over a private torch.distributed group (`gloo`,
`nccl`), or (`ipc`) a handle of the sender's bucket in the update request (CUDA IPC for a
server on the sender's GPU, CPU shared memory otherwise: the same code on both). It loads each
bucket with the model's `load_weights` inside vLLM's layerwise-reload lifecycle, so the
weights never touch the disk. The server is started with `--worker-extension-cls
tephra_vllm_plugin.TephraWorkerExtension` (importing this module in each worker registers the
engine) and `--weight-transfer-config '{"backend": "tephra"}'`, with this folder on PYTHONPATH.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from tephra_weight_transport import BucketMeta, broadcast, open_group, open_shared, unpack
from vllm.distributed.weight_transfer import WeightTransferEngineFactory
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

BACKEND = "tephra"


@dataclass
class TephraInitInfo(WeightTransferInitInfo):
    backend: str = "gloo"
    master_address: str = ""
    master_port: int = 0
    rank_offset: int = 1
    world_size: int = 1
    timeout_s: float = 300.0


@dataclass
class TephraUpdateInfo(WeightTransferUpdateInfo):
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    handle: str | None = None
    """ipc: the bucket as `tephra_weight_transport.share` made it; None: it is broadcast."""


class TephraWeightTransferEngine(WeightTransferEngine[TephraInitInfo, TephraUpdateInfo]):
    init_info_cls = TephraInitInfo
    update_info_cls = TephraUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.group = None
        self.transport: str | None = None

    def init_transfer_engine(self, init_info: TephraInitInfo) -> None:
        self.transport = init_info.backend
        if self.transport == "ipc":  # handles come with each update; no group to join
            return
        # a unique rank per worker across data-parallel replicas, as vLLM's nccl engine does
        p = self.parallel_config
        rank = init_info.rank_offset + p.data_parallel_index * p.world_size + p.rank
        self.group = open_group(
            init_info.master_address,
            init_info.master_port,
            rank,
            init_info.world_size,
            init_info.backend,
            init_info.timeout_s,
        )

    def start_weight_update(self) -> None:
        # vllm exists only in the server's environment, where this plugin runs
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        # vllm exists only in the server's environment, where this plugin runs
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # the base class synchronises an accelerator, which a CPU server does not have
        self.receive_weights(self.parse_update_info(update_info))
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def receive_weights(self, update_info: TephraUpdateInfo) -> None:
        if self.transport is None:
            raise RuntimeError("tephra weight transfer used before /init_weight_transfer_engine")
        meta = BucketMeta(update_info.names, update_info.dtype_names, update_info.shapes)
        if update_info.handle is not None:
            # a view of the sender's memory, copied into the weights by load_weights; the
            # sender keeps it alive until this request returns
            flat = open_shared(update_info.handle, self.device)
        else:
            dtype = getattr(torch, meta.dtype_names[0]) if meta.names else torch.float32
            flat = torch.empty(meta.numel(), dtype=dtype, device=self.device)
            broadcast(self.group, flat)
        self.model.load_weights(unpack(meta, flat))

    def shutdown(self) -> None:
        self.group = None


class TephraWorkerExtension:
    """Mixed into vLLM's worker class; its only job is that importing this module in every
    worker registers the `tephra` engine before vLLM creates it."""


try:
    WeightTransferEngineFactory.register_engine(BACKEND, TephraWeightTransferEngine)
except ValueError:  # imported twice in one process
    pass
