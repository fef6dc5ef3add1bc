"""A worker killed for memory is a worker failure: killed by the kernel's OOM killer (a memory
cgroup made for the test holds the run) it is restarted from the last checkpoint; killed by
Ray's memory monitor with no restart left, the run stops with one message naming the group,
rank, stage, step, the node's memory at the kill and the settings that lower it (no Ray
traceback)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tephra.episodes.tools.memory_cgroup import MemoryCgroup

ROOT = Path(__file__).resolve().parent.parent
GIB = 2**30

HOG = """
import os

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    # once the test drops the trigger file: fill {gib} GiB (written, so the pages are resident)
    if os.path.exists({trigger!r}):
        if {once}:
            os.remove({trigger!r})
        hog = bytearray(b"\\1") * ({gib} * 2**30)
        del hog
    return (sum(map(ord, solution_str)) % 5) / 4.0
"""
"""The smoke test's reward with variance (tephra.controller.testing.SMOKE_REWARD), plus a
memory hog armed by a file."""


def launch(
    tmp: Path,
    name: str,
    hog_gib: int,
    once: bool,
    extra: list[str],
    cgroup=None,
    env=None,
    armed: bool = False,
):
    """Run `apps/ppo -p smoke` with the hog reward; the hog is armed once step 2's checkpoint
    is committed (the kill then comes in step 3), or from the start (`armed`)."""
    trigger = tmp / f"{name}.trigger"
    reward = tmp / f"{name}_reward.py"
    reward.write_text(HOG.format(trigger=str(trigger), gib=hog_gib, once=once))
    run_dir = tmp / name
    cmd = [
        sys.executable,
        "apps/ppo",
        "-p",
        "smoke",
        f"reward.custom_function_path={reward}",
        "trainer.steps=3",
        "trainer.save_every=2",
        f"trainer.run_dir={run_dir}",
        *extra,
    ]

    def join_cgroup() -> None:
        if cgroup is not None:
            Path(cgroup.procs).write_text("0")

    log = tmp / f"{name}.log"
    if armed:
        trigger.write_text("")
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        env=dict(os.environ, OMP_NUM_THREADS="1", **(env or {})),
        start_new_session=True,
        preexec_fn=join_cgroup,
    )
    manifest = run_dir / "checkpoints" / "step_2" / "manifest.json"
    deadline = time.monotonic() + 900
    while not armed and not manifest.exists():
        assert proc.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.1)
    trigger.write_text("")
    code = proc.wait(timeout=900)
    return code, log.read_text(), run_dir


# slow: a smoke run killed for memory (~3 min on an idle 2-core machine); not yet seen
# passing twice on a quiet machine, so kept out of the default run until it has
@pytest.mark.slow
@pytest.mark.timeout(1800)  # one run of the smoke preset, restarted once
def test_kernel_oom_kill_restarts_from_the_last_checkpoint(tmp_path):
    cgroup = MemoryCgroup.create(5 * GIB)
    if cgroup is None:
        pytest.skip("no memory cgroup can be made here (needs root or a delegated cgroup)")
    try:
        # the kernel's OOM killer, inside a 5 GiB cgroup: a 6 GiB hog in step 3, once
        code, out, run_dir = launch(tmp_path, "kernel", 6, True, [], cgroup=cgroup)
        kills = cgroup.oom_kills()
    finally:
        cgroup.remove()
    assert code == 0, out[-4000:]
    assert kills >= 1
    assert "worker group failed at step 3" in out and "restart 1 of 1" in out
    assert "was killed by the kernel's OOM killer (node memory" in out
    assert "the run's cgroup limit 5.0 GiB" in out
    assert "resumed from" in out and "step_2 at step 2" in out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 3


# slow: a smoke run killed for memory (~3 min on an idle 2-core machine); not yet seen
# passing twice on a quiet machine, so kept out of the default run until it has
@pytest.mark.slow
@pytest.mark.timeout(1200)  # one run of the smoke preset, stopped in its first step
def test_ray_memory_monitor_kill_with_no_restart_left_is_one_message(tmp_path):
    # Ray's memory monitor, its threshold 2 GiB above what the machine uses now, and a 4 GiB
    # hog at every scoring call. The machine is shared: another program's growth may make the
    # monitor kill a rank earlier (while it starts); the message is then the start-up one
    meminfo = dict(
        (line.split(":")[0], int(line.split()[1]) * 1024)
        for line in Path("/proc/meminfo").read_text().splitlines()
    )
    used = meminfo["MemTotal"] - meminfo["MemAvailable"]
    threshold = min(0.97, (used + 2 * GIB) / meminfo["MemTotal"])
    env = {"RAY_memory_usage_threshold": f"{threshold:.3f}", "RAY_memory_monitor_refresh_ms": "50"}
    code, out, _ = launch(
        tmp_path,
        "monitor",
        4,
        False,
        ["trainer.max_restarts=0", "resources.memory_per_rank_gb=0.5"],
        env=env,
        armed=True,
    )
    assert code == 2, out[-4000:]
    error = out[out.index("error: ") :]
    head = error.splitlines()[0]
    assert re.match(
        r"error: (stage '\w+' of worker group 'rl' at step 1: rank 0 \(node [\d.]+, pid \d+\) was"
        r"|worker group 'rl' at start-up: a rank was) killed by Ray's memory monitor \(node "
        r"memory at the kill [\d.]+GB used / [\d.]+GB limit \([\d.]+\)\); to lower a rank's memory: ",
        head,
    ), head
    for knob in (
        "actor.micro_batch.max_tokens_per_microbatch",
        "actor.offload",
        "resources.memory_per_rank_gb",
    ):
        assert knob in head
    assert "Traceback" not in out and "ray.exceptions" not in out, out[-4000:]
