"""Rollout replicas on a pool of their own: the same numbers as the colocated engine when they
generate the same batches, and `trainer.mode=async` within its staleness bound."""

from __future__ import annotations

import json

import pytest

from tephra.apps.ppo.main import parse_config, run
from tephra.controller.run.trackers import read_jsonl
from tephra.controller.testing import SMOKE_REWARD, untimed_metrics

pytestmark = pytest.mark.multiproc


def _run(tmp_path, name, *overrides):
    reward = tmp_path / "reward.py"
    reward.write_text(SMOKE_REWARD)
    run(
        parse_config(
            [
                "-p",
                "smoke",
                f"reward.custom_function_path={reward}",
                f"trainer.run_dir={tmp_path / name}",
                *overrides,
            ]
        )
    )
    return read_jsonl(tmp_path / name / "metrics.jsonl")


def _data(records):
    return [untimed_metrics(r) for r in records]


def test_one_replica_equals_the_colocated_engine(ray_session, tmp_path):
    """one_step_off, 3 steps: the replica generates each next batch while the training rank
    updates, receives the weights by broadcast, and every metric equals the colocated run's."""
    mode = ("trainer.mode=one_step_off", "trainer.steps=3")
    colocated = _run(tmp_path, "colocated", *mode)
    replica = _run(tmp_path, "replica", *mode, "resources.rollout.replicas=1")
    assert _data(replica) == _data(colocated)
    assert [r["staleness/weight_version_max"] for r in replica] == [0.0, 0.0, 1.0]


def test_async_never_trains_on_samples_older_than_the_window(ray_session, tmp_path):
    """Multi-turn agent loops (the python tool) on 2 replicas, 4 steps, with partial rollout
    and 2 prompt groups per request: every token of a trajectory carries the version that
    produced it, and a sample counts as old as its oldest token."""
    records = _run(
        tmp_path,
        "async",
        "-p",
        "smoke_tools",
        "trainer.mode=async",
        "trainer.steps=4",
        "trainer.async_window=1",
        "trainer.dump_generations=1",
        "trainer.partial_rollout=true",
        "trainer.async_groups_per_request=2",
        "resources.rollout.replicas=2",
        "resources.rollout.cpus_per_replica=0.5",
    )
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for r in records:
        step = r["step"]
        rows = [
            json.loads(line)
            for line in (tmp_path / "async" / "generations" / f"train_step{step}.jsonl")
            .read_text()
            .splitlines()
        ]
        assert len(rows) == 8  # prompts_per_step x samples_per_prompt
        for row in rows:
            v = row["token_versions"]
            assert v and v == sorted(v)
            assert row["weight_version"] == v[0]
        assert r["async/resumed_tokens"] == sum(
            t != row["token_versions"][0] for row in rows for t in row["token_versions"]
        )
        lags = [(step - 1) - row["weight_version"] for row in rows]
        assert min(lags) >= 0 and max(lags) <= 1
        assert r["staleness/max"] == max(lags)
    last = records[-1]
    # every trained group came back in a request of at most 2 groups; admission keeps at most
    # (window + 1) x prompts_per_step groups admitted and untrained. Which replica answered is
    # timing: on a loaded machine one replica can answer every request of 4 steps while the
    # other's first is still decoding; the least-loaded choice itself is tested without timing
    # below
    served = last["async/replica0_requests"] + last["async/replica1_requests"]
    assert 2 * served >= 4 * 2
    assert last["async/admitted_untrained_groups"] <= 2 * 2
    assert last["async/lag_max"] <= 1


def _trained_prompts(run_dir, steps):
    return [
        [
            json.loads(line)["prompt"]
            for line in (run_dir / "generations" / f"train_step{s}.jsonl").read_text().splitlines()
        ]
        for s in range(1, steps + 1)
    ]


def test_an_async_run_stopped_and_resumed_trains_the_prompts_of_an_uninterrupted_one(
    ray_session, tmp_path
):
    """One replica (requests answered in the order sent), a wide async window: a run stopped
    after step 2 and resumed to step 4 trains, step by step, the prompts an uninterrupted
    4-step run trains; the groups in flight at the stop are sent again, none skipped."""
    mode = (
        "trainer.mode=async",
        "trainer.async_window=100",
        "trainer.dump_generations=1",
        "trainer.save_every=2",
        "resources.rollout.replicas=1",
        "resources.rollout.cpus_per_replica=0.5",
    )
    _run(tmp_path, "whole", *mode, "trainer.steps=4")
    _run(tmp_path, "stopped", *mode, "trainer.steps=2")
    saved = json.loads(
        (tmp_path / "stopped" / "checkpoints" / "step_2" / "trainer_state.json").read_text()
    )
    assert saved["stream"]["owed"]  # groups were in flight or waiting when it stopped
    resumed = _run(tmp_path, "stopped", *mode, "trainer.steps=4")
    assert [r["step"] for r in resumed][-2:] == [3, 4]
    assert _trained_prompts(tmp_path / "stopped", 4) == _trained_prompts(tmp_path / "whole", 4)


def test_partial_rollout_resumes_a_request_under_the_new_weights(ray_session, tmp_path):
    """trainer.partial_rollout, 1 replica, 2 steps. Responses of up to 400 tokens make a request
    outlast step 1's update, so the sync after it interrupts the request in flight, which
    continues under version 1 and is trained in step 2 (the first to finish then). The dumped
    per-token versions must agree with each sample's `weight_version`, the staleness bound and
    the `async/*` counts."""
    records = _run(
        tmp_path,
        "partial",
        "trainer.mode=async",
        "trainer.partial_rollout=true",
        "trainer.steps=2",
        "trainer.async_window=1",
        "trainer.async_in_flight=2",
        "trainer.dump_generations=1",
        "resources.rollout.replicas=1",
        "rollout.max_tokens=400",
        "actor.micro_batch.max_tokens_per_microbatch=1024",
        "algorithm.rollout_correction=tis",
    )
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        step = r["step"]
        rows = [
            json.loads(line)
            for line in (tmp_path / "partial" / "generations" / f"train_step{step}.jsonl")
            .read_text()
            .splitlines()
        ]
        versions = [row["token_versions"] for row in rows]
        for row, v in zip(rows, versions):
            assert v == sorted(v) and row["weight_version"] == v[0]
            assert 0 <= (step - 1) - v[0] <= 1 and v[-1] <= step - 1
        assert r["staleness/max"] == max((step - 1) - v[0] for v in versions)
        assert r["async/partial_samples"] == sum(v[0] != v[-1] for v in versions)
        assert r["async/resumed_tokens"] == sum(t != v[0] for v in versions for t in v)
        assert "rollout_corr/tis_weight_mean" in r
    assert records[0]["async/partial_samples"] == 0  # no update happened before step 1's batch
    assert records[1]["async/partial_samples"] >= 1 and records[1]["async/resumed_tokens"] >= 1


def test_the_scheduler_routes_around_a_slow_replica(ray_session):
    """Two replica actors, one 20x slower (a long-tail sample, a slow tool): the stream keeps
    2 requests in flight and sends each new one to the least-loaded replica, so the fast
    one answers most of them while the slow one holds one request at a time."""
    import time

    import ray

    from tephra.controller.cluster.watchdog import StageFailure, Watchdog, WatchdogConfig
    from tephra.controller.workers.rollout_replicas import RolloutReplicas

    @ray.remote(num_cpus=0)
    class Replica:  # the `execute("generate_scored", items, sampling)` of a RolloutWorker
        def __init__(self, delay):
            self.delay = delay

        def execute(self, method, items, sampling):
            time.sleep(self.delay)
            return [(method, item) for item in items]

    replicas = RolloutReplicas.__new__(RolloutReplicas)  # the scheduler, on stand-in actors
    replicas.replicas = [Replica.remote(0.05), Replica.remote(1.0)]
    replicas.in_flight, replicas.served, replicas._pending = [0, 0], [0, 0], {}
    replicas.watchdog, replicas.places = Watchdog(), [None, None]
    pending = [replicas.submit([i], None) for i in range(2)]
    assert replicas.in_flight == [1, 1]  # one each: both idle at first
    answers = []
    for i in range(2, 14):
        done, samples = replicas.wait_any(pending)
        pending.remove(done)
        answers += samples
        pending.append(replicas.submit([i], None))
    while pending:
        done, samples = replicas.wait_any(pending)
        pending.remove(done)
        answers += samples
    assert sorted(item for _, item in answers) == list(range(14))  # nothing lost
    fast, slow = replicas.served
    assert fast + slow == 14 and slow <= 2 and fast >= 12
    # a replica that answers nothing within the watchdog's deadline is named
    replicas.watchdog = Watchdog(WatchdogConfig(stage_timeouts_s={"generate_scored": 0.2}))
    replicas.in_flight = [5, 0]  # the next request goes to the slow replica (index 1)
    stuck = replicas.submit([99], None)
    with pytest.raises(
        StageFailure,
        match=r"'generate_scored' of worker group 'rollout'.*rank 1 "
        r"answered none of its 1 requests in flight within 0.2 s",
    ):
        replicas.wait_any([stuck])
    ray.get(stuck)
