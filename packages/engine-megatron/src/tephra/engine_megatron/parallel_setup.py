"""torch.distributed and megatron's parallel_state from a `ParallelConfig`.

megatron keeps its process groups in module globals, so one process holds one layout: a
second engine with the same sizes shares the groups; one with other sizes rebuilds them
(and the first engine must no longer be used).
"""

from __future__ import annotations

import os
import tempfile

import torch.distributed as dist
from megatron.core import parallel_state as ps

from tephra.engine_api.config import ParallelConfig
from tephra.engine_api.process_group import ensure_single_process_group
from tephra.engine_api.process_group import release_process_group as release_single_process_group
from tephra.engine_megatron import cpu_compat

_CURRENT: tuple | None = None


def ensure_process_group() -> None:
    """A single process without torch.distributed gets a world of one (megatron needs one)."""
    if dist.is_initialized():
        return
    if "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1:
        dist.init_process_group(cpu_compat.default_backend())
        return
    ensure_single_process_group(
        cpu_compat.default_backend(),
        store=dist.FileStore(tempfile.mktemp(prefix="tephra_megatron_store_"), 1),
    )


def release_process_group() -> bool:
    """Destroy megatron's groups and the 1-rank default group `ensure_process_group` created,
    if any (engines built on them stop working). For test suites and programs that
    initialise torch.distributed themselves afterwards. Returns whether a group was destroyed."""
    global _CURRENT
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    _CURRENT = None
    return release_single_process_group()


def initialize(parallel: ParallelConfig) -> None:
    """Create megatron's TP/PP/CP/EP/DP groups for `parallel` (world = tp*pp*cp*dp)."""
    global _CURRENT
    ensure_process_group()
    world = dist.get_world_size()
    dp = parallel.data_parallel_size(world)
    # the sizes were checked against the world by MegatronEngine.check_config
    key = (
        parallel.tensor,
        parallel.pipeline,
        parallel.virtual_pipeline,
        parallel.context,
        parallel.expert,
        parallel.expert_tensor,
        world,
    )
    if _CURRENT == key and ps.model_parallel_is_initialized():
        return
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=parallel.tensor,
        pipeline_model_parallel_size=parallel.pipeline,
        virtual_pipeline_model_parallel_size=(
            parallel.virtual_pipeline if parallel.virtual_pipeline > 1 else None
        ),
        context_parallel_size=parallel.context,
        expert_model_parallel_size=parallel.expert,
        expert_tensor_parallel_size=parallel.expert_tensor,
        create_gloo_process_groups=False,
    )
    del dp
    _CURRENT = key
