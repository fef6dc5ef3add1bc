"""The W&B (offline), MLflow, ClearML (offline) and SwanLab (offline) trackers against the
real libraries, read back with each
library's own reader and compared with what was logged; no network, nothing written outside
tmp_path; a missing library names the extra to install."""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tephra.controller.run.trackers import JsonlTracker, Trackers
from tephra.engine_api.errors import ConfigError

# What a trainer logs: step 1 twice (training metrics, then a validation score: one row),
# floats that must come back bit-exact, an int, and a NaN (a diverged grad norm).
LOGGED = [
    ({"reward/mean": 0.1234567890123, "actor/kl": 1.5e-7, "response/length_mean": 17}, 1),
    ({"accuracy/val": 0.375}, 1),
    ({"reward/mean": -2.5, "actor/grad_norm": float("nan")}, 2),
    ({"reward/mean": 1e30}, 3),
]
CONFIG = {"algo": {"estimator": "grpo", "lr": 1e-6}, "seed": 3, "trackers": ["wandb"]}


def expected_rows(skip_non_finite: bool) -> dict[int, dict[str, float]]:
    rows: dict[int, dict[str, float]] = {}
    for metrics, step in LOGGED:
        rows.setdefault(step, {}).update(
            {k: v for k, v in metrics.items() if not (skip_non_finite and not math.isfinite(v))}
        )
    return rows


def user_dirs() -> dict[str, list[str]]:
    """What the libraries would write outside the run by default: their folders in the real
    home and their sockets / port files in the real temp dir."""
    home = Path.home()
    seen = {}
    for d in (
        home / ".cache/wandb",
        home / ".config/wandb",
        home / ".local/share/wandb",
        home / ".config/mlflow",
        home / ".clearml",
        home / "clearml.conf",
        home / ".swanlab",
        Path.cwd() / "wandb",
        Path.cwd() / "mlruns",
        Path.cwd() / "swanlog",
    ):
        seen[str(d)] = sorted(str(p) for p in d.rglob("*")) if d.exists() else []
    seen["CLEARML_CACHE_DIR"] = [os.environ.get("CLEARML_CACHE_DIR", "")]
    tmp = Path(tempfile.gettempdir())
    seen[str(tmp)] = sorted(p.name for p in tmp.glob("wandb-*"))
    return seen


@pytest.fixture
def offline(tmp_path, monkeypatch, network_guard):
    """Every default location of wandb and mlflow moved under tmp_path, telemetry off, and
    the `network_guard` (conftest.py) in this process. wandb's Go service
    is another process: its API URL points at a local trap socket that must see no connection."""
    before = user_dirs()
    home, tmp, cwd = tmp_path / "home", tmp_path / "t", tmp_path / "cwd"
    for d in (home, tmp, cwd):
        d.mkdir()
    monkeypatch.setenv("HOME", str(home))
    for var in ("XDG_CACHE_HOME", "XDG_CONFIG_HOME", "XDG_DATA_HOME", "XDG_STATE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("TMPDIR", str(tmp))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    monkeypatch.chdir(cwd)
    trap = socket.socket()
    trap.bind(("127.0.0.1", 0))
    trap.listen(8)
    env = {
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_ERROR_REPORTING": "false",
        "WANDB_DIR": str(tmp_path / "run"),
        "WANDB_CACHE_DIR": str(home / "wandb-cache"),
        "WANDB_CONFIG_DIR": str(home / "wandb-config"),
        "WANDB_DATA_DIR": str(home / "wandb-data"),
        "WANDB_ARTIFACT_DIR": str(home / "wandb-artifacts"),
        "WANDB_BASE_URL": f"http://127.0.0.1:{trap.getsockname()[1]}",
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "DO_NOT_TRACK": "true",
    }
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    for k in ("WANDB_API_KEY", "MLFLOW_TRACKING_URI"):
        monkeypatch.delenv(k, raising=False)

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    yield run_dir, network_guard, trap
    trap.close()
    assert not any(cwd.iterdir()), f"written into the working directory: {list(cwd.iterdir())}"
    monkeypatch.undo()
    assert user_dirs() == before


def test_wandb_offline_history_matches_what_was_logged(offline):
    import wandb

    run_dir, attempts, trap = offline
    try:
        t = Trackers(["wandb"], run_dir, "proj", "run-a", CONFIG)
        for metrics, step in LOGGED:
            t.log(metrics, step)
        t.close()
    finally:
        wandb.teardown()  # stops the service process this test started
    (folder,) = (run_dir / "wandb").glob("offline-run-*")
    # wandb's own reader of the run's transaction log (`run-<id>.wandb`)
    out = subprocess.run(
        [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(folder)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    records = [json.loads(line) for line in out.stdout.splitlines() if line.strip()]
    history = {}
    for r in records:
        if r["type"] == "history":
            item = r["history"]["item"]
            history[item["_step"]] = {k: v for k, v in item.items() if not k.startswith("_")}
    rows = expected_rows(skip_non_finite=False)
    nan_logged = history[2].pop("actor/grad_norm")
    del rows[2]["actor/grad_norm"]
    assert history == rows  # exact: same steps, same keys, bit-identical floats
    assert math.isnan(float(nan_logged))  # the inspector prints it as the string "NaN"
    (run,) = [r["run"] for r in records if r["type"] == "run"]
    config = {k: v for k, v in run["config"]["update"].items() if k != "_wandb"}
    assert (run["project"], run["display_name"], config) == ("proj", "run-a", CONFIG)
    assert attempts == []
    trap.setblocking(False)
    with pytest.raises(BlockingIOError):  # nothing connected to the W&B API URL
        trap.accept()


@pytest.fixture
def sqlite_without_fsync():
    """SQLite connections that skip fsync: creating MLflow's tables runs ~470 DDL statements,
    whose fsyncs cost seconds on a busy disk; a test database needs no durability."""
    from sqlalchemy import event
    from sqlalchemy.engine import Engine

    def no_fsync(dbapi_connection, _record):
        if type(dbapi_connection).__module__.startswith("sqlite3"):
            dbapi_connection.execute("PRAGMA synchronous=OFF")

    event.listen(Engine, "connect", no_fsync)
    yield
    event.remove(Engine, "connect", no_fsync)


def test_mlflow_sqlite_metric_history_matches_what_was_logged(offline, sqlite_without_fsync):
    from mlflow.artifacts import load_text
    from mlflow.tracking import MlflowClient

    run_dir, attempts, _ = offline
    t = Trackers(["mlflow"], run_dir, "proj", "run-a", CONFIG)
    for metrics, step in LOGGED:
        t.log(metrics, step)
    t.close()
    tracker = t.items[0]
    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}")
    rows = expected_rows(skip_non_finite=True)
    keys = sorted({k for row in rows.values() for k in row})
    got = {
        k: [(m.step, m.value) for m in client.get_metric_history(tracker.run_id, k)] for k in keys
    }
    want = {k: [(s, row[k]) for s, row in sorted(rows.items()) if k in row] for k in keys}
    assert got == want  # exact steps and values
    assert client.get_metric_history(tracker.run_id, "actor/grad_norm") == []  # NaN skipped
    run = client.get_run(tracker.run_id)
    assert (run.info.status, run.info.run_name) == ("FINISHED", "run-a")
    assert json.loads(load_text(run.info.artifact_uri + "/config.json")) == CONFIG
    assert Path(run.info.artifact_uri.removeprefix("file://")).is_relative_to(run_dir)
    # a resumed run reuses the experiment and adds a run beside the first
    again = Trackers(["mlflow"], run_dir, "proj", "run-b", CONFIG)
    again.log({"reward/mean": 0.5}, 4)
    again.close()
    second = again.items[0]
    assert client.get_run(second.run_id).info.experiment_id == run.info.experiment_id
    assert [(m.step, m.value) for m in client.get_metric_history(second.run_id, "reward/mean")] == [
        (4, 0.5)
    ]
    assert attempts == []


def test_clearml_offline_session_matches_what_was_logged(offline):
    """ClearML's offline session, read back from the files its importer reads (the zip's
    `metrics.jsonl` events and `task.json`); the session lands in the run folder, and the
    environment variable that sent it there is restored."""
    import zipfile

    run_dir, attempts, _ = offline
    t = Trackers(["clearml"], run_dir, "proj", "run-a", CONFIG)
    for metrics, step in LOGGED:
        t.log(metrics, step)
    t.close()
    assert "CLEARML_CACHE_DIR" not in os.environ
    tracker = t.items[0]
    assert tracker.folder.is_relative_to(run_dir / "clearml")
    with zipfile.ZipFile(f"{tracker.folder}.zip") as session:
        events = [
            e
            for line in session.read("metrics.jsonl").decode().splitlines()
            for e in json.loads(line)
        ]
        task = json.loads(session.read("task.json"))
    history: dict[int, dict[str, float]] = {}
    for e in events:
        assert e["type"] == "training_stats_scalar"
        history.setdefault(e["iter"], {})[f"{e['metric']}/{e['variant']}"] = e["value"]
    assert history == expected_rows(skip_non_finite=True)  # exact; the NaN skipped
    assert task["name"] == "run-a"
    assert attempts == []  # no connection tried (the network guard)


def test_swanlab_offline_run_matches_what_was_logged(offline):
    """SwanLab's offline run read back with its own record reader (the records `swanlab sync`
    uploads)."""
    from swanlab.proto.swanlab.record.v1.record_pb2 import Record
    from swanlab.sdk.internal.core_python.store import DataStoreReader

    run_dir, attempts, _ = offline
    t = Trackers(["swanlab"], run_dir, "proj", "run-a", CONFIG)
    for metrics, step in LOGGED:
        t.log(metrics, step)
    t.close()
    (path,) = (run_dir / "swanlab").glob("run-*/run-*.swanlab")
    reader = DataStoreReader()
    reader.open(path)
    history: dict[int, dict[str, float]] = {}
    for data in reader:
        record = Record()
        record.ParseFromString(data)
        if record.WhichOneof("record_type") == "scalar":
            scalar = record.scalar
            history.setdefault(scalar.step, {})[scalar.key] = scalar.value.number
    reader.close()
    assert history == expected_rows(skip_non_finite=True)  # exact; the NaN skipped
    assert attempts == []


@pytest.mark.parametrize(
    ("tracker", "modules"),
    [
        ("wandb", ["wandb"]),
        ("mlflow", ["mlflow", "mlflow.entities", "mlflow.tracking"]),
        ("mlflow", ["sqlalchemy"]),
        ("clearml", ["clearml"]),
        ("swanlab", ["swanlab"]),
    ],
)
def test_missing_library_names_the_extra(tmp_path, monkeypatch, tracker, modules):
    closed = []
    real_close = JsonlTracker.close
    monkeypatch.setattr(JsonlTracker, "close", lambda self: (closed.append(self), real_close(self)))
    for name in modules:
        monkeypatch.setitem(sys.modules, name, None)  # makes `import name` fail
    with pytest.raises(
        ConfigError,
        match=rf"trainer.trackers has '{tracker}' but .* is not "
        rf"installed; install the extra: pip install 'tephra-controller\[{tracker}\]'",
    ):
        Trackers(["jsonl", tracker], tmp_path, "proj", "run", {})
    assert len(closed) == 1  # the tracker built before the failing one was closed
