"""Ctrl-C and SIGTERM to a run's process group, as a terminal or a job scheduler sends them: the
run stops after its step in progress with a checkpoint of it and a `stopped` summary, exits 130 /
143, leaves no process behind, and resumes into the metrics of an uninterrupted run (bitwise).
A second SIGINT stops at once, as cleanly."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tephra.controller.testing import SMOKE_REWARD, untimed_metrics

ROOT = Path(__file__).resolve().parent.parent
STEPS = 6


def session_members(sid: int) -> list[str]:
    """Live processes of session `sid` (`pid command`), zombies left out: the driver and
    everything it started (Ray's daemons, and its workers, which lead process groups of their
    own but stay in the session)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()[:120]
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[3]) == sid:
            found.append(f"{entry.name} {cmd}")
    return found


def default_sigint() -> None:
    """In the child: SIGINT at its default disposition, as a terminal's foreground job has it
    (a test runner started in the background may pass it on ignored)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def rows(run_dir: Path) -> dict[int, dict]:
    """Each step's metrics (timings aside), the last row of a step winning."""
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        out[r["step"]] = untimed_metrics(r)
    return out


def launch(run_dir: Path, log: Path, *extra: str) -> subprocess.Popen:
    """`apps/ppo -p smoke` in a new session (its own process group, as a shell's job)."""
    reward = run_dir.parent / "reward.py"
    reward.write_text(SMOKE_REWARD)
    return start_job(
        log,
        "apps/ppo",
        "-p",
        "smoke",
        f"reward.custom_function_path={reward}",
        f"trainer.steps={STEPS}",
        f"trainer.run_dir={run_dir}",
        *extra,
    )


def start_job(log: Path, *args: str) -> subprocess.Popen:
    """`python *args` from the repository root in a new session, as a shell starts a job."""
    cmd = [sys.executable, *args]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.Popen(
        cmd,
        cwd=ROOT,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
        preexec_fn=default_sigint,
    )


def steps_logged(run_dir: Path) -> int:
    """The last step in the run's metrics.jsonl (0 before the first)."""
    path = run_dir / "metrics.jsonl"
    return max(rows(run_dir), default=0) if path.exists() else 0


def wait_for(what, timeout_s: float, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while not what():
        assert proc.poll() is None, f"the run ended early:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"timed out:\n{log.read_text()[-3000:]}"
        time.sleep(0.05)


def stop_and_check(
    proc: subprocess.Popen,
    log: Path,
    run_dir: Path,
    signals: list[signal.Signals],
    exit_code: int,
    at_step: int,
    acknowledged: bool = True,
    most_behind: int = 1,
) -> dict:
    """Once `at_step` steps are logged, send `signals` to the run's process group (the second
    one once the first was acknowledged, or at once without `acknowledged`); check the exit
    code, the time to exit, the summary, the checkpoint (after a second signal, at most
    `most_behind` steps behind the last completed one) and that no process of the run
    survives. Returns the summary."""
    wait_for(lambda: steps_logged(run_dir) >= at_step, 600, proc, log)
    if len(signals) > 1 and acknowledged:
        # with save_every=1 a step is logged before it is saved: a stop asked for during
        # that save completes at the safe point right after it, before a second signal can
        # land. Signal once the save is committed, so both signals come during the next step.
        saved = run_dir / "checkpoints" / f"step_{steps_logged(run_dir)}" / "manifest.json"
        wait_for(saved.exists, 120, proc, log)
    os.killpg(proc.pid, signals[0])
    sent = time.monotonic()
    if len(signals) > 1:
        if acknowledged:
            wait_for(lambda: "send it again to stop at once" in log.read_text(), 30, proc, log)
        os.killpg(proc.pid, signals[1])
    try:
        code = proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"no exit within 60 s of {signals[0].name}:\n{log.read_text()[-3000:]}")
    took = time.monotonic() - sent
    text = log.read_text()
    assert code == exit_code, f"exit {code}, expected {exit_code}:\n{text[-3000:]}"
    assert took < 60
    assert "Traceback" not in text, text[-3000:]
    survivors = session_members(proc.pid)
    for _ in range(20):  # the session's last processes may take a moment to be reaped
        if not survivors:
            break
        time.sleep(0.1)
        survivors = session_members(proc.pid)
    assert survivors == [], f"left running after exit: {survivors}"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "stopped" and summary["signal"] == signals[0].name
    assert summary["exit_code"] == exit_code
    assert summary["steps"] == steps_logged(run_dir) and summary["steps"] >= at_step
    assert (Path(summary["checkpoint"]) / "manifest.json").exists()
    saved = int(Path(summary["checkpoint"]).name.removeprefix("step_"))
    if summary["immediate"]:
        # the step in progress is dropped; the second signal may also have come while the last
        # logged step was being saved (an interrupted save commits nothing): the checkpoint
        # is the last one committed
        assert summary["steps"] - most_behind <= saved <= summary["steps"]
    else:  # the last completed step, saved by the stop itself
        assert saved == summary["steps"]
    return summary


# slow: five smoke runs, 5 min 42 s on the loaded 2-core machine (too long for the default run)
@pytest.mark.slow
@pytest.mark.timeout(3000)  # five runs of the smoke preset, each ~1 min on an idle 2-core machine
def test_sigint_sigterm_and_a_second_sigint_stop_cleanly_and_resume_exactly(tmp_path):
    # the reference: the same run, uninterrupted
    full, log = tmp_path / "full", tmp_path / "full.log"
    proc = launch(full, log)
    assert proc.wait(timeout=900) == 0, log.read_text()[-3000:]
    assert json.loads((full / "summary.json").read_text())["status"] == "completed"

    run_dir = tmp_path / "stopped"
    # Ctrl-C after the first step: checkpointed by the stop (no save_every), exit 130
    log = tmp_path / "sigint.log"
    proc = launch(run_dir, log, "trainer.save_final=true")
    first = stop_and_check(proc, log, run_dir, [signal.SIGINT], 130, at_step=1)
    assert "stopped by SIGINT after step" in log.read_text()

    # resumed, then SIGTERM to the group after one more step: exit 143
    log = tmp_path / "sigterm.log"
    proc = launch(run_dir, log, "trainer.save_final=true")
    second = stop_and_check(proc, log, run_dir, [signal.SIGTERM], 143, at_step=first["steps"] + 1)
    assert f"resumed from {run_dir / 'checkpoints'}" in log.read_text()

    # resumed, then Ctrl-C twice: stops at once (the step in progress is dropped, the last
    # checkpoint is the last step saved by save_every)
    if second["steps"] < STEPS - 1:
        log = tmp_path / "twice.log"
        proc = launch(run_dir, log, "trainer.save_every=1")
        third = stop_and_check(
            proc, log, run_dir, [signal.SIGINT, signal.SIGINT], 130, at_step=second["steps"] + 1
        )
        assert third["immediate"] is True and "SIGINT again: stopping now" in log.read_text()

    # resumed to the end: every step's metrics as in the uninterrupted run
    log = tmp_path / "rest.log"
    proc = launch(run_dir, log)
    assert proc.wait(timeout=900) == 0, log.read_text()[-3000:]
    assert rows(run_dir) == rows(full)


def test_sft_stops_on_sigint_and_at_once_on_a_second_signal_and_resumes_exactly(tmp_path):
    """apps/sft stops as the RL trainer does: SIGINT after the first step finishes the step in
    progress and checkpoints it (exit 130); SIGINT and SIGTERM back to back stop at once
    (`immediate`, the last checkpoint the last one `save_every=3` made); the run resumed to its end
    logs the metrics of an uninterrupted run, bitwise."""

    def sft(run_dir: Path, log: Path) -> subprocess.Popen:
        steps = f"train.steps={STEPS + 2}"
        return start_job(
            log, "apps/sft", "-p", "smoke", steps, "train.save_every=3", f"train.run_dir={run_dir}"
        )

    full, log = tmp_path / "full", tmp_path / "full.log"
    proc = sft(full, log)
    assert proc.wait(timeout=600) == 0, log.read_text()[-3000:]
    assert json.loads((full / "summary.json").read_text())["status"] == "completed"

    run_dir = tmp_path / "stopped"
    log = tmp_path / "sigint.log"
    first = stop_and_check(sft(run_dir, log), log, run_dir, [signal.SIGINT], 130, at_step=1)
    assert first["immediate"] is False and "stopped by SIGINT after step" in log.read_text()

    log = tmp_path / "twice.log"
    proc = sft(run_dir, log)
    second = stop_and_check(
        proc, log, run_dir, [signal.SIGINT, signal.SIGTERM], 130, first["steps"] + 1, False, 2
    )
    assert f"resumed from {run_dir / 'checkpoints'}" in log.read_text()
    assert second["immediate"] is True and "SIGTERM again: stopping now" in log.read_text()

    log = tmp_path / "rest.log"
    proc = sft(run_dir, log)
    assert proc.wait(timeout=600) == 0, log.read_text()[-3000:]
    assert rows(run_dir) == rows(full)
