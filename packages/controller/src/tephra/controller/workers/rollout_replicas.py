"""Rollout replicas on their own resource pool (disaggregated placement).

With `resources.rollout.replicas > 0` the training ranks hold no rollout engine: generation runs
on `RolloutWorker`s, one Ray actor per replica with its own backend (`hf` in process, or a
`vllm` / `sglang` server it starts), placed on a pool of their own. After each update the
training rank 0 broadcasts the weights to every replica over a private process group (gloo on
CPU, NCCL on GPU; buckets of `rollout.<backend>.weight_bucket_mb`), and each replica records
the version it holds. `RolloutReplicas` is the driver's side: a batch split over the replicas
(sync and one_step_off), and `submit` / `wait_any` for the asynchronous stream, where each
request goes to the least-loaded replica.

Each replica actor has a second concurrency group, `weights`, so an update is received while
a request generates and the trainer never waits for a request to finish. Without
`trainer.partial_rollout` a busy replica keeps the received weights aside (one extra copy) and
takes them before its next request; an idle one takes them at once, bucket by bucket. With
partial rollout the engine's `paused()` interrupts the request instead (`hf` at the next
token; `vllm` / `sglang` abort the server's requests, which return their tokens so far), takes
the weights, and the request goes on under them (the server backends resubmit prompt +
tokens); every token records the version that produced it.
"""

from __future__ import annotations

import itertools
import threading
from typing import TYPE_CHECKING, Any

import ray
import torch

from tephra.controller.cluster.dispatch import Dispatch, dispatch, share_bounds
from tephra.controller.cluster.watchdog import Watchdog, sample_ids
from tephra.controller.cluster.worker_group import ResourcePool, Worker, WorkerGroup
from tephra.controller.config.tree import PPOConfig
from tephra.controller.samples import Prompt, Sample
from tephra.controller.workers.generation import Generator
from tephra.rollout.backends.vllm_plugin.tephra_weight_transport import open_group, receive_all

if TYPE_CHECKING:  # a type alias the module defines for the type checker only
    from tephra.rollout.backends.vllm_plugin.tephra_weight_transport import TransferGroup


class RolloutWorker(Worker):
    """A rollout replica: the generation part (`Generator`: rollout engine, tokenizer, tools
    and scorer) that the training worker holds too, without its training engines, and the
    receiving end of the weight broadcast."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        *worker_args: Any,
        cfg: PPOConfig,
        model_path: str,
        tools_file: str | None = None,
        reward_actors: list | None = None,
    ) -> None:
        """`reward_actors`: the reward pool's ranks (`resources.reward`); this replica's
        samples go to rank `rank % len(reward_actors)` of it to be scored."""
        super().__init__(rank, world_size, *worker_args)
        self.generation = Generator.build(
            cfg,
            model_path,
            tools_file,
            self.device,
            with_rollout=True,
            reward_actor=reward_actors[rank % len(reward_actors)] if reward_actors else None,
        )
        self.version = 0
        self._weights_group: TransferGroup | None = None
        self._generating = threading.Lock()
        """Held while a request generates (the default concurrency group)."""
        self._staged: tuple[int, list] | None = None
        """(version, weights) received while a request generated, taken before the next one."""
        self._staging = threading.Lock()
        """Guards `_staged` (set by the `weights` thread, taken by the generating one)."""
        self.partial = cfg.trainer.partial_rollout
        if self.partial:  # the engine tags each token with the version it holds
            self.rollout.weight_version = 0

    @property
    def rollout(self) -> Any:
        """The replica's rollout engine (the generation part's)."""
        return self.generation.rollout

    # dp_info / rollout_info: `Worker`'s defaults, one share per replica (each is a rollout
    # engine of its own)

    def join_weight_group(
        self, address: str, port: int, world_size: int, backend: str, timeout_s: float
    ) -> None:
        self._weights_group = open_group(
            address, port, 1 + self.rank, world_size, backend, timeout_s
        )

    def receive_weights(self, version: int) -> int:
        """Take one broadcast update (in the `weights` concurrency group, beside a request in
        flight); the replica holds `version` once it is in the engine (module docstring)."""
        assert self._weights_group is not None, "join_weight_group comes first"
        device = torch.device(self.device) if self.device.startswith("cuda") else None
        received = receive_all(self._weights_group, device)
        if self.partial:  # interrupt the request in flight; it goes on under the new weights
            with self.rollout.paused():
                self.rollout.update_weights(received)
                self.rollout.weight_version = version
            self.version = version
        elif self._generating.acquire(blocking=False):  # idle: straight into the engine
            try:
                with self._staging:
                    self._staged = None  # an older version kept aside is superseded
                self._load(version, received)
            finally:
                self._generating.release()
        else:  # busy: the request finishes under the weights it started with; the copy kept
            # aside lives in host memory (a GPU replica's engine has no room for a second one)
            weights = [(name, t.cpu()) for name, t in received]
            with self._staging:
                self._staged = (version, weights)
        return version

    def _take_staged(self) -> None:
        """Copy weights kept aside into the engine (the caller holds `_generating`)."""
        with self._staging:
            staged, self._staged = self._staged, None
        if staged is not None:
            self._load(*staged)

    def _load(self, version: int, named: Any) -> None:
        self.rollout.update_weights(named)
        self.version = version

    @dispatch(Dispatch.DP_SPLIT)
    def generate_scored(self, items: list[Prompt], sampling: Any) -> list[Sample]:
        """`generate`, scored here, each sample stamped with this replica's weight version (with
        partial rollout: the oldest version among its tokens, the one it started under)."""
        with self._generating:
            self._take_staged()  # weights received while the last request ran, if any
            samples = self.generation.generate(items, sampling)
            for sample, reward in zip(
                samples, self.generation.collect_scores().rewards, strict=True
            ):
                sample.reward = reward
                sample.weight_version = (
                    min(sample.token_versions) if sample.token_versions else self.version
                )
        return samples

    def close(self) -> None:
        """Stop the generation part (`Generator.close`)."""
        self.generation.close()


class RolloutReplicas:
    """The driver's handle on the replicas (see module docstring)."""

    def __init__(
        self,
        cfg: PPOConfig,
        model_path: str,
        tools_file: str | None,
        watchdog: Watchdog | None = None,
        reward_actors: list | None = None,
    ) -> None:
        """`reward_actors`: the reward pool's ranks that score the replicas' samples
        (`resources.reward`); None: each replica scores its own."""
        r = cfg.resources.rollout
        self.cfg = cfg
        self.pool = ResourcePool(
            r.replicas,
            r.cpus_per_replica,
            r.gpus_per_replica,
            strategy=cfg.resources.placement,
            name="rollout",
            retain_freed_memory=cfg.resources.retain_freed_memory,
        )
        try:
            self.group = WorkerGroup(
                RolloutWorker,
                self.pool,
                {
                    "cfg": cfg,
                    "model_path": model_path,
                    "tools_file": tools_file,
                    "reward_actors": reward_actors,
                },
                name="rollout",
                concurrency_groups={"weights": 1},
                watchdog=watchdog,
            )
        except BaseException:
            self.pool.release()
            raise
        self.replicas = self.group.workers
        self.watchdog, self.places = self.group.watchdog, self.group.places
        self.in_flight = [0] * len(self.replicas)
        """Requests each replica has not answered yet (the load the scheduler balances)."""
        self.served = [0] * len(self.replicas)
        """Requests each replica has answered (reported in the metrics)."""
        self._pending: dict[Any, int] = {}
        self.version = 0
        settings = getattr(cfg.rollout, cfg.rollout.backend, None)
        self.bucket_mb = getattr(settings, "weight_bucket_mb", 256.0)

    def connect(self, trainers: WorkerGroup, version: int = 0) -> None:
        """Open the weight group (training rank 0 + every replica) and send the first weights,
        as `version` (the trainer's: a resumed run's replicas stamp their samples with it)."""
        address, port = trainers.call("weight_group_address")
        world = 1 + len(self.replicas)
        timeout = 600.0
        # one backend for both ends (NCCL only when both pools compute on GPUs; whole GPUs,
        # checked at config load, so that no replica shares a training rank's device)
        r = self.cfg.resources
        backend = "nccl" if r.gpus_per_rank > 0 and r.rollout.gpus_per_replica > 0 else "gloo"
        ray.get(
            [
                w.execute.remote("open_weight_group", address, port, world, backend, timeout)
                for w in trainers.workers
            ]
            + [
                w.execute.remote("join_weight_group", address, port, world, backend, timeout)
                for w in self.replicas
            ]
        )
        self.sync(trainers, version)

    def sync(self, trainers: WorkerGroup, version: int) -> None:
        """Broadcast the actor's weights to every replica; returns once they are received. A
        replica busy generating takes them before its next request, or, with partial rollout,
        at once (its request continues under the new weights)."""
        receive = [w.execute.options(concurrency_group="weights") for w in self.replicas]
        ray.get(
            [w.execute.remote("send_weights", self.bucket_mb) for w in trainers.workers]
            + [method.remote("receive_weights", version) for method in receive]
        )
        self.version = version

    def generate(self, items: list[Prompt], sampling: Any) -> list[Sample]:
        """Scored samples of `items` (prompt-major), the items split over the replicas in
        order (`share_bounds`; each share seeded as in the whole batch: `for_share`), under
        the watchdog's deadline for `generate_scored`."""
        bounds = share_bounds(len(items), len(self.replicas))
        busy = [(i, start, end) for i, (start, end) in enumerate(bounds) if end > start]
        refs = [
            self.replicas[i].execute.remote(
                "generate_scored", items[start:end], sampling.for_share(start)
            )
            for i, start, end in busy
        ]
        shares = self.watchdog.wait(
            refs,
            group="rollout",
            stage="generate_scored",
            places=[self.places[i] for i, _, _ in busy],
            samples=[sample_ids([items[start:end]], {}) for _, start, end in busy],
        )
        return list(itertools.chain.from_iterable(shares))

    def submit_split(self, items: list[Prompt], sampling: Any) -> Any:
        """`generate` without waiting: one object ref that resolves to the samples."""
        bounds = share_bounds(len(items), len(self.replicas))
        refs = [
            w.execute.remote("generate_scored", items[start:end], sampling.for_share(start))
            for w, (start, end) in zip(self.replicas, bounds)
            if end > start
        ]
        return _concat.remote(*refs)

    # ----- the asynchronous stream -----------------------------------------------------------
    def submit(self, items: list[Prompt], sampling: Any) -> Any:
        """Send one request to the least-loaded replica (fewest unanswered requests)."""
        index = min(range(len(self.replicas)), key=lambda i: (self.in_flight[i], i))
        ref = self.replicas[index].execute.remote("generate_scored", items, sampling)
        self.in_flight[index] += 1
        self._pending[ref] = index
        return ref

    def wait_any(self, refs: list[Any]) -> tuple[Any, list[Sample]]:
        """A finished request of `refs` (given in the order sent: the earliest-sent of those
        finished) and its samples. When none finishes within the
        watchdog's deadline for `generate_scored`, StageFailure names the replicas that hold
        requests."""
        limit, why = self.watchdog.deadline("rollout", "generate_scored")
        ready, _ = ray.wait(refs, num_returns=1, timeout=limit)
        if not ready:
            holding = sorted({self._pending[ref] for ref in refs})
            raise self.watchdog.failure(
                "deadline",
                "rollout",
                "generate_scored",
                holding,
                self.places,
                [],
                f"answered none of its {len(refs)} requests in flight within {limit:.1f} s ({why})",
            )
        # of those finished by now, the one sent first: a run then trains its prompts in the
        # same order whichever of two finished answers Ray lists first (resume relies on it)
        finished, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        done = min([*ready, *finished], key=refs.index)
        index = self._pending.pop(done)
        self.in_flight[index] -= 1
        self.served[index] += 1
        return done, ray.get(done)

    def close(self) -> None:
        try:
            ray.get([w.execute.remote("close") for w in self.replicas])
        except Exception:  # noqa: BLE001  (a dead replica cannot close; shutdown still runs)
            pass
        finally:
            self.group.shutdown()
            self.pool.release()


@ray.remote(num_cpus=0)
def _concat(*shares: list[Sample]) -> list[Sample]:
    return list(itertools.chain.from_iterable(shares))
