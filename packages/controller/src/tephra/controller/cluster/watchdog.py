"""The watchdog over stage calls: a deadline per stage, and a failure that names the rank.

Every call the driver makes on a worker group (a "stage": `compute_log_probs`,
`update_actor`, ...) waits under a deadline: `factor` times the median of that stage's last
durations, at least `floor_s`; `first_calls_s` while the stage has fewer than `min_history`
durations (first calls load models and compile); `stage_timeouts_s[stage]` replaces it.
When the deadline passes, or a rank's process dies, the driver raises `StageFailure`
naming the group, the stage, the step, each rank that did not answer (node, pid), the
sample ids it was working on and the last lines of its log; the trainer then restarts the
group (`trainer.max_restarts`) or stops with that message.
"""

from __future__ import annotations

import os
import statistics
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import ActorDiedError, OutOfMemoryError, RayActorError

from tephra.controller.cluster.memory_kills import KNOBS, node_memory, oom_kills, ray_oom_usage
from tephra.controller.cluster.stop import wait_sliced
from tephra.core.errors import TephraError
from tephra.engine_api.errors import ConfigError

LOG_LINES = 12
"""Lines of a failed rank's log quoted in the message (from each of its .err and .out)."""


@dataclass
class WatchdogConfig:
    """Deadlines for the driver's calls on worker groups (`trainer.watchdog`)."""

    enabled: bool = True
    """Watch every stage call; false waits as long as a stage takes (a dead rank is still
    named)."""
    factor: float = 10.0
    """A stage's deadline is this many times the median of its recent durations..."""
    floor_s: float = 300.0
    """...but never shorter than this many seconds."""
    first_calls_s: float = 3600.0
    """Deadline while a stage has fewer than `min_history` durations (its first calls load
    models, compile kernels, warm caches)."""
    min_history: int = 3
    """Durations a stage needs before its median sets the deadline."""
    history: int = 20
    """Recent durations per stage that the median is taken over."""
    stage_timeouts_s: dict[str, float] = field(default_factory=dict)
    """Fixed deadlines by stage (the worker method's name, e.g. `update_actor: 1800`),
    replacing the rule above for that stage."""

    def __post_init__(self) -> None:
        for name in ("factor", "floor_s", "first_calls_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"trainer.watchdog.{name}={getattr(self, name)!r} must be > 0")
        if self.min_history < 1 or self.history < self.min_history:
            raise ConfigError(
                f"trainer.watchdog.min_history={self.min_history} and history="
                f"{self.history}: need 1 <= min_history <= history"
            )
        for stage, seconds in self.stage_timeouts_s.items():
            if not (isinstance(seconds, (int, float)) and seconds > 0):
                raise ConfigError(
                    f"trainer.watchdog.stage_timeouts_s.{stage}={seconds!r} must be seconds > 0"
                )


def check_stage_names(config: WatchdogConfig, stages: set[str]) -> None:
    """Refuse a `stage_timeouts_s` key that names no stage (a typo would never apply)."""
    unknown = sorted(set(config.stage_timeouts_s) - stages)
    if unknown:
        raise ConfigError(
            f"trainer.watchdog.stage_timeouts_s names {unknown}, which are not stages; "
            f"choose from {sorted(stages)}"
        )


@dataclass(frozen=True)
class RankPlace:
    """Where one rank runs, recorded when its group starts."""

    rank: int
    node_ip: str
    pid: int
    log_files: tuple[str, ...] = ()
    """Its Ray worker's .err and .out files (on its node)."""


def this_rank_place(rank: int) -> RankPlace:
    """Called inside a worker: its node, pid and Ray log files."""
    pid = os.getpid()
    logs: tuple[str, ...] = ()
    try:
        node = ray._private.worker.global_worker.node
        if node is not None:  # None in a process that is not a Ray worker
            logs_dir = Path(node.get_logs_dir_path())
            logs = tuple(
                str(p) for ext in ("err", "out") for p in logs_dir.glob(f"worker-*-{pid}.{ext}")
            )
    except (AttributeError, OSError):  # not a Ray worker (a test calling it directly)
        pass
    return RankPlace(rank, ray.util.get_node_ip_address(), pid, logs)


class StageFailure(TephraError, RuntimeError):
    """A stage call that passed its deadline or lost a rank (`kind`: `deadline`, `died`,
    `out_of_memory`); the message says where. An app prints it as its error, without Ray's
    traceback, once no restart is left."""

    def __init__(self, message: str, kind: str, group: str, stage: str, ranks: list[int]):
        super().__init__(message)
        self.kind, self.group, self.stage, self.ranks = kind, group, stage, ranks


def log_tail(place: RankPlace, lines: int = LOG_LINES) -> str:
    """The last `lines` lines of each of the rank's log files that this machine can read."""
    parts = []
    for path in place.log_files:
        try:
            text = Path(path).read_text(errors="replace").rstrip().splitlines()[-lines:]
        except OSError:
            parts.append(f"    ({path} is on node {place.node_ip}; not readable here)")
            continue
        if text:
            parts.append(f"  {path}:\n" + "\n".join(f"    {line}" for line in text))
    return "\n".join(parts) if parts else "    (no log lines)"


def sample_ids(args: Sequence[Any], kwargs: dict[str, Any], limit: int = 16) -> str | None:
    """The ids of the samples in one rank's share of a call: a batch's `uid` (its group ids)
    or the `sample_id` of each item; None when the call carries no samples."""
    ids: list[Any] = []
    for value in [*args, *kwargs.values()]:
        keys = getattr(value, "keys", None)
        if keys is not None and "uid" in keys():
            ids.extend(sorted(set(value["uid"].tolist())))
        elif isinstance(value, (list, tuple)) and value and hasattr(value[0], "sample_id"):
            ids.extend(item.sample_id for item in value)
    if not ids:
        return None
    more = f" and {len(ids) - limit} more" if len(ids) > limit else ""
    return ", ".join(map(str, ids[:limit])) + more


class Watchdog:
    """Deadlines from each stage's recent durations; `wait` gathers a call's results."""

    def __init__(self, config: WatchdogConfig | None = None) -> None:
        self.config = config or WatchdogConfig()
        self.durations: dict[tuple[str, str], deque[float]] = {}
        self.step: int | None = None
        """The trainer's current step, quoted in failures (set by the loop)."""

    def deadline(self, group: str, stage: str) -> tuple[float | None, str]:
        """(seconds or None for no deadline, how it was set)."""
        cfg = self.config
        if not cfg.enabled:
            return None, "watchdog off"
        if stage in cfg.stage_timeouts_s:
            return float(cfg.stage_timeouts_s[stage]), f"trainer.watchdog.stage_timeouts_s.{stage}"
        past = self.durations.get((group, stage), ())
        if len(past) < cfg.min_history:
            return cfg.first_calls_s, "trainer.watchdog.first_calls_s (a stage's first calls)"
        median = statistics.median(past)
        if cfg.factor * median < cfg.floor_s:
            return cfg.floor_s, "trainer.watchdog.floor_s"
        return (
            cfg.factor * median,
            f"trainer.watchdog.factor={cfg.factor:g} x median {median:.1f} s",
        )

    def record(self, group: str, stage: str, seconds: float) -> None:
        past = self.durations.setdefault((group, stage), deque(maxlen=self.config.history))
        past.append(seconds)

    def wait(
        self,
        refs: list[Any],
        *,
        group: str,
        stage: str,
        places: Sequence[RankPlace | None],
        samples: Sequence[str | None] = (),
    ) -> list[Any]:
        """ray.get of one call's refs (one per rank, in rank order) under the stage's deadline.
        A rank's own exception is raised as Ray raises it; a dead rank or a passed deadline
        raise StageFailure, as soon as it is known (the other ranks may be stuck in a
        collective with the dead one)."""
        limit, why = self.deadline(group, stage)
        start = time.monotonic()
        kills_before = oom_kills()
        index = {ref: i for i, ref in enumerate(refs)}
        pending = list(refs)
        while pending:
            left = None if limit is None else max(0.0, limit - (time.monotonic() - start))
            done, pending = wait_sliced(pending, num_returns=1, timeout=left)
            if not done:
                stuck = sorted(index[ref] for ref in pending)
                raise self.failure(
                    "deadline",
                    group,
                    stage,
                    stuck,
                    places,
                    samples,
                    f"did not return within {limit:.1f} s ({why})",
                    answered=sorted(set(range(len(refs))) - set(stuck)),
                )
            try:
                ray.get(done[0])
            except OutOfMemoryError as exc:  # Ray's memory monitor killed the rank
                at_kill = ray_oom_usage(str(exc))
                memory = f"node memory at the kill {at_kill}" if at_kill else node_memory()
                raise self.failure(
                    "out_of_memory",
                    group,
                    stage,
                    [index[done[0]]],
                    places,
                    samples,
                    f"was killed by Ray's memory monitor ({memory}); to lower a rank's memory: "
                    f"{KNOBS}",
                ) from None
            except (ActorDiedError, RayActorError) as exc:
                rank = index[done[0]]
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
                if oom_kills() > kills_before:  # SIGKILLed by the kernel: Ray cannot say why
                    raise self.failure(
                        "out_of_memory",
                        group,
                        stage,
                        [rank],
                        places,
                        samples,
                        f"was killed by the kernel's OOM killer ({node_memory()}); to lower a "
                        f"rank's memory: {KNOBS}",
                    ) from None
                raise self.failure(
                    "died",
                    group,
                    stage,
                    [rank],
                    places,
                    samples,
                    f"died ({type(exc).__name__}: {first})",
                ) from exc
        results = ray.get(refs)  # all finished: a rank's own exception surfaces here
        self.record(group, stage, time.monotonic() - start)
        return results

    def failure(
        self,
        kind: str,
        group: str,
        stage: str,
        ranks: list[int],
        places: Sequence[RankPlace | None],
        samples: Sequence[str | None],
        what: str,
        answered: list[int] | None = None,
    ) -> StageFailure:
        """The StageFailure for `ranks` of `group` that `what` happened to in `stage`."""
        at = f" at step {self.step}" if self.step is not None else ""
        lines = []
        for rank in ranks:
            place = places[rank] if rank < len(places) else None
            where = f" (node {place.node_ip}, pid {place.pid})" if place else ""
            lines.append(f"rank {rank}{where} {what}")
        head = f"stage {stage!r} of worker group {group!r}{at}: " + "; ".join(lines)
        body = []
        if answered:
            body.append(f"ranks that answered: {', '.join(map(str, answered))}")
        for rank in ranks:
            ids = samples[rank] if rank < len(samples) else None
            if ids:
                body.append(f"samples in flight on rank {rank}: {ids}")
            place = places[rank] if rank < len(places) else None
            if place:
                body.append(f"last lines of rank {rank}'s log:\n{log_tail(place)}")
        return StageFailure("\n".join([head, *body]), kind, group, stage, ranks)
