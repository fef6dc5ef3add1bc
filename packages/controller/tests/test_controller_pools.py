"""Parallel-aware dispatch, placement groups, rendezvous and device assignment: a tensor x data
parallel layout gets its rows replicated to tensor peers and collected once, in order; a device
comes from Ray's GPU assignment."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from tephra.controller.cluster.dispatch import (
    DataParallelInfo,
    Dispatch,
    check_layout,
    dispatch,
    dispatched_methods,
    rollout_shares,
    share_bounds,
)
from tephra.controller.cluster.watchdog import (
    StageFailure,
    Watchdog,
    WatchdogConfig,
    check_stage_names,
)
from tephra.controller.cluster.worker_group import (
    ResourcePool,
    Worker,
    WorkerGroup,
    device_from_assignment,
    process_group_backend,
    ray_init,
)
from tephra.controller.workers.rl_worker import RLWorker
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
    import tephra.controller.cluster.worker_group as wg
    from tephra.controller.config.tree import ResourcesSection

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


class StallingWorker(Worker):
    """Rank 1 sleeps or dies inside `work` when told; the other rank returns its share."""

    @dispatch(Dispatch.DP_SPLIT)
    def work(self, batch: TensorDict, stall: str = "") -> TensorDict:
        import os
        import time

        if self.rank == 1 and stall:
            print(f"rank 1 starts on uids {batch['uid'].tolist()} and will {stall}", flush=True)
            if stall == "die":
                os._exit(3)  # the process dies mid-stage, as an OOM kill would
            time.sleep(600)
        return batch


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
        _watchdog_names_the_stuck_and_the_dead_rank()
        with pytest.raises(ConfigError, match="could not place 2 bundles .* STRICT_SPREAD"):
            ResourcePool(
                world_size=2, cpus_per_rank=1, strategy="STRICT_SPREAD", ready_timeout_s=3
            ).placement_group()
    finally:
        ray.shutdown()


def _watchdog_names_the_stuck_and_the_dead_rank():
    """Rank 1 sleeps past its stage's deadline, then (in a fresh group) dies mid-stage: each
    time the failure names the group, stage, step, rank 1 with its pid, its samples and the
    line it logged, as soon as it is known (not after a collective's timeout)."""
    import time

    pool = ResourcePool(world_size=2, cpus_per_rank=0.5, name="watchdog")
    batch = TensorDict({"uid": torch.arange(8) // 2}, batch_size=[8])
    for stall in ("sleep", "die"):
        watchdog = Watchdog(WatchdogConfig(stage_timeouts_s={"work": 4.0}))
        watchdog.step = 7
        wg = WorkerGroup(StallingWorker, pool, name="actor", watchdog=watchdog)
        assert torch.equal(wg.work(batch)["uid"], batch["uid"])  # in time: results as usual
        start = time.monotonic()
        with pytest.raises(StageFailure) as failure:
            wg.work(batch, stall=stall)
        elapsed = time.monotonic() - start
        msg, pid = str(failure.value), wg.places[1].pid
        assert failure.value.kind == ("deadline" if stall == "sleep" else "died")
        assert failure.value.ranks == [1] and failure.value.stage == "work"
        assert msg.startswith("stage 'work' of worker group 'actor' at step 7: rank 1 (node ")
        assert f"pid {pid})" in msg
        assert "samples in flight on rank 1: 2, 3" in msg  # its share: rows 4-7, uids 2 and 3
        if stall == "sleep":
            assert "did not return within 4.0 s (trainer.watchdog.stage_timeouts_s.work)" in msg
            assert (
                "ranks that answered: 0" in msg and 4.0 <= elapsed < 300
            )  # not the sleeper's 600 s
        else:
            assert "died (" in msg and elapsed < 300
        # how long to look for the line: Ray flushes the worker's stdout file as it is written
        assert f"rank 1 starts on uids [2, 2, 3, 3] and will {stall}" in msg, msg
        wg.shutdown(grace_s=0)
    pool.release()


def test_watchdog_deadlines_follow_each_stages_median():
    dog = Watchdog(WatchdogConfig(factor=4, floor_s=10, first_calls_s=600, min_history=3))
    assert dog.deadline("actor", "update") == (
        600,
        "trainer.watchdog.first_calls_s (a stage's first calls)",
    )
    for seconds in (2.0, 30.0, 5.0):
        dog.record("actor", "update", seconds)
    assert dog.deadline("actor", "update") == (20.0, "trainer.watchdog.factor=4 x median 5.0 s")
    dog.record("actor", "generate", 1.0)
    for _ in range(2):
        dog.record("actor", "generate", 1.0)
    assert dog.deadline("actor", "generate") == (10, "trainer.watchdog.floor_s")
    assert dog.deadline("critic", "update")[0] == 600  # per group and stage
    fixed = Watchdog(WatchdogConfig(stage_timeouts_s={"update": 90}))
    assert fixed.deadline("actor", "update") == (90.0, "trainer.watchdog.stage_timeouts_s.update")
    assert Watchdog(WatchdogConfig(enabled=False)).deadline("a", "b") == (None, "watchdog off")
    with pytest.raises(ConfigError, match=r"trainer.watchdog.factor=0 must be > 0"):
        WatchdogConfig(factor=0)
    with pytest.raises(ConfigError, match=r"stage_timeouts_s.update='soon' must be seconds"):
        WatchdogConfig(stage_timeouts_s={"update": "soon"})
    with pytest.raises(ConfigError, match=r"min_history=5 and history=2"):
        WatchdogConfig(min_history=5, history=2)
    # a stage name that no worker method has is refused (before Ray starts, in ppo.run)
    stages = dispatched_methods(RLWorker) | {"generate_scored"}
    assert {"update_actor", "compute_log_probs", "generate"} <= stages
    check_stage_names(WatchdogConfig(stage_timeouts_s={"update_actor": 60}), stages)
    with pytest.raises(ConfigError, match=r"names \['update_actr'\], which are not stages"):
        check_stage_names(WatchdogConfig(stage_timeouts_s={"update_actr": 60}), stages)
