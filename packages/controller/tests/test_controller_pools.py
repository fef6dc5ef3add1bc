"""Parallel-aware dispatch, placement groups, rendezvous and device assignment: a tensor x data
parallel layout gets its rows replicated to tensor peers and collected once, in order; a device
comes from Ray's GPU assignment."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from tephra.controller.dispatch import (
    DataParallelInfo,
    Dispatch,
    check_layout,
    dispatch,
    rollout_shares,
    share_bounds,
)
from tephra.controller.worker_group import (
    ResourcePool,
    Worker,
    WorkerGroup,
    device_from_assignment,
    process_group_backend,
    ray_init,
)
from tephra.core.errors import BatchError, ConfigError
from tephra.rollout.base import SamplingParams


def test_device_comes_from_rays_gpu_assignment():
    # Ray sets CUDA_VISIBLE_DEVICES to the actor's own GPUs: its first GPU is index 0 there
    assert device_from_assignment([], None) == ("cpu", 0)
    assert device_from_assignment([3], "3") == ("cuda:0", 0)
    assert device_from_assignment(["5"], "4,5") == ("cuda:1", 1)
    assert device_from_assignment([2], None) == ("cuda:0", 0)  # not restricted: Ray's id order
    # a GPU rank's group reduces CUDA tensors (NCCL) and the engines' host-side counts (gloo)
    assert process_group_backend("cuda:1") == "cpu:gloo,cuda:nccl"
    assert process_group_backend("cpu") == "gloo"


def test_layout_checks():
    ok = [DataParallelInfo(r // 2, 2, r % 2 == 0) for r in range(4)]
    assert check_layout(ok) == 2
    with pytest.raises(BatchError, match="exactly one output rank"):
        check_layout([DataParallelInfo(0, 1, True), DataParallelInfo(0, 1, True)])
    with pytest.raises(BatchError, match="disagree on the data-parallel size"):
        check_layout([DataParallelInfo(0, 1), DataParallelInfo(0, 2)])
    with pytest.raises(ConfigError, match="resources.placement='NEAR'"):
        ResourcePool(strategy="NEAR")


def test_retain_freed_memory_resolves_per_device_and_needs_glibc(monkeypatch):
    import tephra.controller.worker_group as wg
    from tephra.controller.rl_config import ResourcesSection

    monkeypatch.setattr(wg, "retain_supported", lambda: True)
    assert ResourcePool().retains_freed_memory  # CPU ranks: on
    assert not ResourcePool(gpus_per_rank=1).retains_freed_memory  # GPU ranks: off
    assert ResourcePool(gpus_per_rank=1, retain_freed_memory=True).retains_freed_memory
    assert not ResourcePool(retain_freed_memory=False).retains_freed_memory
    # elsewhere than glibc: the automatic choice is off and an explicit true is refused
    monkeypatch.setattr(wg, "retain_supported", lambda: False)
    assert not ResourcePool().retains_freed_memory
    with pytest.raises(ConfigError, match=r"resources.retain_freed_memory=true needs glibc"):
        ResourcesSection(retain_freed_memory=True)


class TensorParallelWorker(Worker):
    """Declares tensor parallel pairs: ranks (0, 1) are replica 0, (2, 3) replica 1; the even
    rank of a pair returns the results. Each rank tags rows with its rank and all-reduces
    within the process group (so the group is real)."""

    @dispatch(Dispatch.DP_SPLIT)
    def tag(self, batch: TensorDict) -> TensorDict:
        import torch.distributed as dist

        ranks = torch.tensor(float(self.rank))
        dist.all_reduce(ranks)
        n = batch.batch_size[0]
        return TensorDict(
            {"x": batch["x"], "rank": torch.full((n,), self.rank), "sum_of_ranks": ranks.expand(n)},
            batch_size=[n],
        )

    def dp_info(self) -> DataParallelInfo:
        return DataParallelInfo(
            dp_rank=self.rank // 2, dp_size=self.world_size // 2, is_output_rank=self.rank % 2 == 0
        )

    @dispatch(Dispatch.ROLLOUT_SPLIT)
    def generate(self, prompts: list[str], sampling: SamplingParams) -> list[tuple]:
        """What this rank was asked to generate: (prompt, rank, the share's seed)."""
        self.last_share = list(prompts)
        return [(p, self.rank, sampling.seed) for p in prompts]

    @dispatch(Dispatch.BROADCAST)
    def shares(self) -> list[str]:
        return self.last_share


class RolloutPairsWorker(TensorParallelWorker):
    """Tensor-parallel training pairs whose rollout engines also take two ranks each (a
    server with tensor_parallel_size=2): the odd rank of a pair holds none."""

    def rollout_info(self) -> DataParallelInfo:
        return self.dp_info()


def test_share_bounds_and_rollout_shares():
    assert share_bounds(7, 3) == [(0, 3), (3, 5), (5, 7)]
    assert share_bounds(2, 4) == [(0, 1), (1, 2), (2, 2), (2, 2)]
    sampling = SamplingParams(n=4, seed=100)
    shares = rollout_shares((list("abcde"), sampling), {"score": True}, 2)
    assert [a[0] for a, _ in shares] == [list("abc"), list("de"), []]  # + the empty share
    # a share's seed puts its samples where they are in the whole call: seed + first * n
    assert [a[1].seed for a, _ in shares] == [100, 112, 100]
    assert all(k == {"score": True} for _, k in shares)
    with pytest.raises(BatchError, match="disagree on their row counts"):
        rollout_shares((list("abc"), list("ab")), {}, 2)


@pytest.mark.multiproc
def test_rows_split_by_data_parallel_rank_replicated_to_tensor_peers():
    import ray

    ray_init(num_cpus=2)
    try:
        pool = ResourcePool(world_size=4, cpus_per_rank=0.5)
        wg = WorkerGroup(TensorParallelWorker, pool)
        assert wg.dp_size == 2 and [i.dp_rank for i in wg.layout] == [0, 0, 1, 1]
        x = torch.arange(6, dtype=torch.float32)
        out = wg.tag(TensorDict({"x": x}, batch_size=[6]))
        # rows 0-2 went to replica 0 (returned by rank 0), rows 3-5 to replica 1 (rank 2)
        assert torch.equal(out["x"], x)
        assert out["rank"].tolist() == [0, 0, 0, 2, 2, 2]
        assert torch.all(out["sum_of_ranks"] == 6)  # 0+1+2+3: one group of 4 ranks
        with pytest.raises(BatchError, match="does not split evenly over 2"):
            wg.tag(TensorDict({"x": x[:5]}, batch_size=[5]))
        # generation: every rank is a rollout replica of its own, tensor peers included, so
        # the 4 ranks generate disjoint shares (uneven is fine), collected in order
        assert wg.rollout_dp_size == 4
        got = wg.generate([f"p{i}" for i in range(6)], SamplingParams(n=2, seed=10))
        assert got == [
            ("p0", 0, 10),
            ("p1", 0, 10),
            ("p2", 1, 14),
            ("p3", 1, 14),
            ("p4", 2, 18),
            ("p5", 3, 20),
        ]
        wg.shutdown()
        # rollout engines of 2 ranks: the even rank of each pair generates, the odd one
        # gets an empty share
        pairs = WorkerGroup(RolloutPairsWorker, pool)
        assert pairs.rollout_dp_size == 2
        got = pairs.generate([f"p{i}" for i in range(5)], SamplingParams(n=1, seed=0))
        assert got == [("p0", 0, 0), ("p1", 0, 0), ("p2", 0, 0), ("p3", 2, 3), ("p4", 2, 3)]
        assert pairs.shares() == [["p0", "p1", "p2"], [], ["p3", "p4"], []]
        pairs.shutdown()
        pool.release()
        with pytest.raises(ConfigError, match="could not place 2 bundles .* STRICT_SPREAD"):
            ResourcePool(
                world_size=2, cpus_per_rank=1, strategy="STRICT_SPREAD", ready_timeout_s=3
            ).placement_group()
    finally:
        ray.shutdown()
