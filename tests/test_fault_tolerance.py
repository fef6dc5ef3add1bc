"""Checkpoints are atomic and checked: a torn latest checkpoint is detected through its
manifest and the previous one is used, with a warning; a run resumed that way finishes with
the same metrics as an uninterrupted run (bitwise)."""

from __future__ import annotations

import json

import pytest

from tephra.apps.ppo.main import parse_config, run
from tephra.controller.run.checkpoints import CheckpointManager, check_manifest
from tephra.controller.testing import SMOKE_REWARD, untimed_metrics
from tephra.core.errors import CheckpointError


def _fake_checkpoint(manager, step, payload=b"weights" * 100):
    folder = manager.begin(step)
    (folder / "actor").mkdir()
    (folder / "actor" / "model.bin").write_bytes(payload)
    return manager.commit(step, {"loader": {"epoch": 0, "position": step}})


def test_manifest_catches_torn_files_and_resume_modes(tmp_path, capsys):
    manager = CheckpointManager(tmp_path / "ckpt", keep_last=3)
    assert manager.resolve("auto") is None
    with pytest.raises(
        CheckpointError, match="trainer.resume='must' but .* holds no intact checkpoint"
    ):
        manager.resolve("must")
    for step in (2, 4, 6):
        _fake_checkpoint(manager, step)
    manager.begin(8)  # a save killed midway: only the .tmp folder exists
    assert manager.latest() == manager.step_dir(6)
    # truncate a file of the latest: same name, fewer bytes
    weights = manager.step_dir(6) / "actor" / "model.bin"
    weights.write_bytes(weights.read_bytes()[:10])
    assert (
        check_manifest(manager.step_dir(6)) == "actor/model.bin has 10 bytes, the manifest says 700"
    )
    # flip bytes of the next one: same size, other content
    other = manager.step_dir(4) / "actor" / "model.bin"
    other.write_bytes(b"x" * 700)
    assert "does not match its SHA-256" in check_manifest(manager.step_dir(4))
    assert manager.resolve("auto") == manager.step_dir(2)
    out = capsys.readouterr().out
    assert "step_6 is damaged (actor/model.bin has 10 bytes" in out and "step_4 is damaged" in out
    assert manager.resolve("off") is None
    assert manager.resolve("off", str(manager.step_dir(2))) == manager.step_dir(2)
    with pytest.raises(CheckpointError, match="trainer.resume_from=.*step_6.*has 10 bytes"):
        manager.resolve("auto", str(manager.step_dir(6)))
    assert manager.load_trainer_state(manager.step_dir(2))["loader"]["position"] == 2


@pytest.mark.multiproc
def test_run_falls_back_to_the_previous_checkpoint_and_matches(tmp_path, capsys):
    import ray

    from tephra.controller.cluster.worker_group import ray_init

    reward = tmp_path / "reward.py"
    reward.write_text(SMOKE_REWARD)

    def cfg(run_dir, *extra):
        return parse_config(
            [
                "-p",
                "smoke",
                f"reward.custom_function_path={reward}",
                "trainer.steps=4",
                "trainer.save_every=2",
                f"trainer.run_dir={tmp_path / run_dir}",
                *extra,
            ]
        )

    ray_init(num_cpus=2)
    try:
        run(cfg("full", "trainer.resume=off"))
        run(cfg("torn"))
        # the latest checkpoint (step 4) is torn: a file of the actor's state loses its tail
        step4 = tmp_path / "torn" / "checkpoints" / "step_4"
        victim = max(
            (p for p in step4.rglob("*") if p.is_file() and p.suffix != ".json"),
            key=lambda p: p.stat().st_size,
        )
        victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
        capsys.readouterr()
        run(cfg("torn", "trainer.steps=4", "trainer.resume=must"))
    finally:
        ray.shutdown()
    out = capsys.readouterr().out
    assert "step_4 is damaged" in out and "resumed from" in out and "step_2 at step 2" in out
    full = [
        json.loads(line) for line in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()
    ]
    torn = [
        json.loads(line) for line in (tmp_path / "torn" / "metrics.jsonl").read_text().splitlines()
    ]

    def data(rows):
        return [untimed_metrics(r) for r in rows]

    # the torn run logged steps 1-4, then steps 3-4 again after falling back to step 2
    assert [r["step"] for r in torn] == [1, 2, 3, 4, 3, 4]
    assert data(torn[4:]) == data(full[2:]) == data(torn[2:4])

    # the export tool turns the last checkpoint into the same HF folder the run exported
    import torch
    from safetensors.torch import load_file

    from tephra.controller.launch.export import export_checkpoint

    out = export_checkpoint(tmp_path / "full" / "checkpoints" / "step_4", tmp_path / "exported")
    exported = load_file(out / "model.safetensors")
    final = load_file(tmp_path / "full" / "hf" / "model.safetensors")
    assert exported.keys() == final.keys()
    assert all(torch.equal(exported[k], final[k]) for k in final)
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(out)
    # the rerun wrote step 4 again, intact; a damaged checkpoint is refused by name
    assert check_manifest(step4) is None
    victim.write_bytes(b"")
    with pytest.raises(CheckpointError, match="has 0 bytes, the manifest says"):
        export_checkpoint(step4, tmp_path / "never")


@pytest.mark.multiproc
def test_killed_worker_is_restarted_and_the_run_matches(tmp_path, capsys):
    """SIGKILL the training worker during step 3 of a 6-step run (checkpoints every 2 steps):
    the run rebuilds its worker group, continues from step 2's checkpoint and finishes with
    the metrics and weights of an uninterrupted run (bitwise)."""
    import os
    import signal
    import threading
    import time
    from pathlib import Path

    import ray
    import torch
    from safetensors.torch import load_file

    from tephra.controller.cluster.worker_group import ray_init
    from tephra.rollout.testing import live_processes

    reward = tmp_path / "reward.py"
    reward.write_text(SMOKE_REWARD)

    def cfg(run_dir):
        return parse_config(
            [
                "-p",
                "smoke",
                f"reward.custom_function_path={reward}",
                "trainer.steps=6",
                "trainer.save_every=2",
                f"trainer.run_dir={tmp_path / run_dir}",
            ]
        )

    killed: list[int] = []

    def ours(pid: int) -> bool:
        """A worker of this test's Ray session (other test files run their own sessions at
        the same time): its parent is this session's raylet."""
        try:
            ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
            return session.encode() in Path(f"/proc/{ppid}/cmdline").read_bytes()
        except OSError:
            return False

    def killer():  # waits for step 2's checkpoint, then kills the worker in step 3
        done = tmp_path / "killed" / "checkpoints" / "step_2" / "manifest.json"
        deadline = time.monotonic() + 300
        while not done.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        pids = [pid for pid in live_processes("ray::RLWorker") if ours(pid)]
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        killed.extend(pids)

    ray_init(num_cpus=2)
    session = ray._private.worker._global_node.get_session_dir_path()
    try:
        run(cfg("uninterrupted"))
        thread = threading.Thread(target=killer, daemon=True)
        thread.start()
        summary = run(cfg("killed"))
        thread.join()
    finally:
        ray.shutdown()
    assert killed and summary["steps"] == 6
    out = capsys.readouterr().out
    assert "worker group failed at step 3" in out and "restart 1 of 1" in out
    assert "resumed from" in out and "step_2 at step 2" in out

    def last_rows(run_dir):
        rows = {}
        for line in (tmp_path / run_dir / "metrics.jsonl").read_text().splitlines():
            r = json.loads(line)
            rows[r["step"]] = untimed_metrics(r)
        return rows

    assert last_rows("killed") == last_rows("uninterrupted")
    a = load_file(tmp_path / "killed" / "hf" / "model.safetensors")
    b = load_file(tmp_path / "uninterrupted" / "hf" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in b)
