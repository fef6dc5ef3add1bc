"""What a remote environment costs: the environment server's start-up (wall and CPU seconds of
the child process), the round trip of one step over loopback against the same environment in
process, and how long after a server is SIGKILLed its trajectories are dropped with the
default retries.

    OMP_NUM_THREADS=1 uv run python benchmarks/remote_environment.py [--steps 200]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import signal
import statistics
import time

from tephra.episodes.environments.interaction import AnswerCheckInteraction
from tephra.episodes.environments.remote import (
    EnvironmentServerProcess,
    RemoteEnvironment,
    RemoteEnvironmentError,
)
from tephra.episodes.prompt import Prompt


async def step_seconds(env, steps: int) -> list[float]:
    """Seconds of each of `steps` wrong answers to `answer_check` (each is one step)."""
    item = Prompt(
        [{"role": "user", "content": "6 * 7?"}], interaction_kwargs={"ground_truth": "42"}
    )
    await env.reset(item)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        await env.step("41")
        times.append(time.perf_counter() - start)
    await env.close()
    return times


async def seconds_to_drop(url: str, pid: int) -> float:
    """Seconds from the SIGKILL of the server (during a step) to the step's error, with the
    default deadline and retries."""
    env = RemoteEnvironment(environment="answer_check", url=url)
    item = Prompt([{"role": "user", "content": "?"}], interaction_kwargs={"ground_truth": "42"})
    await env.reset(item)
    os.kill(pid, signal.SIGKILL)
    start = time.perf_counter()
    try:
        await env.step("41")
    except RemoteEnvironmentError:
        return time.perf_counter() - start
    finally:
        await env.close()
    raise AssertionError("the step of a killed server succeeded")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    server = EnvironmentServerProcess()
    started = time.perf_counter() - start
    try:
        remote = asyncio.run(
            step_seconds(RemoteEnvironment(environment="answer_check", url=server.url), args.steps)
        )
        local = asyncio.run(step_seconds(AnswerCheckInteraction(), args.steps))
        dropped = asyncio.run(seconds_to_drop(server.url, server.pid))
    finally:
        server.stop()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    ms = sorted(t * 1e3 for t in remote)
    print(f"server start-up: {started:.1f} s wall; server CPU over the whole run {cpu:.1f} s")
    print(
        f"step over loopback: median {statistics.median(ms):.2f} ms, p90 "
        f"{ms[int(0.9 * len(ms))]:.2f} ms ({args.steps} steps); in process median "
        f"{statistics.median(local) * 1e3:.3f} ms"
    )
    print(f"killed server: the step failed {dropped:.2f} s after the SIGKILL (default retries)")
    print(f"load average: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
