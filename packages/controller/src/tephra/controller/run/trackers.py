"""Where per-step metrics go: console, jsonl (default), TensorBoard, W&B (offline), MLflow,
ClearML (offline), SwanLab (offline).

Every tracker takes `log(metrics, step)` and `close()`. `TRACKERS` is the registry; the
config lists names (`trainer.trackers=[console,jsonl]`).
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

from tephra.engine_api.errors import ConfigError
from tephra.engine_api.registry import Registry

TRACKERS: Registry[type[Tracker]] = Registry("tracker")


class Tracker:
    def __init__(self, run_dir: Path, project: str, run_name: str, config: dict[str, Any]) -> None:
        self.run_dir = run_dir

    def log(self, metrics: dict[str, float], step: int) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


@TRACKERS.register("jsonl")
class JsonlTracker(Tracker):
    """One JSON object per step in `run_dir/metrics.jsonl` (appends, so resumed runs continue)."""

    def __init__(self, run_dir: Path, project: str, run_name: str, config: dict[str, Any]) -> None:
        super().__init__(run_dir, project, run_name, config)
        self.path = run_dir / "metrics.jsonl"
        self._file = self.path.open("a")

    def log(self, metrics: dict[str, float], step: int) -> None:
        self._file.write(json.dumps({"step": step, **metrics}) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


@TRACKERS.register("console")
class ConsoleTracker(Tracker):
    """A short line per step with the headline metrics (RL runs), or every metric when none
    of them is logged (e.g. SFT's loss and grad norm)."""

    KEYS = (
        "reward/mean",
        "accuracy/train",
        "accuracy/val",
        "actor/kl",
        "actor/entropy",
        "response/length_mean",
        "actor/grad_norm",
        "time/step_s",
    )

    def log(self, metrics: dict[str, float], step: int) -> None:
        keys = [k for k in self.KEYS if k in metrics] or list(metrics)
        parts = [
            f"{k.split('/')[-1] if k != 'accuracy/val' else 'val_acc'}={metrics[k]:.4g}"
            for k in keys
            if isinstance(metrics[k], (int, float))
        ]
        print(f"step {step}: " + " ".join(parts), flush=True)


@TRACKERS.register("tensorboard")
class TensorBoardTracker(Tracker):
    """Scalars under `run_dir/tensorboard`."""

    def __init__(self, run_dir: Path, project: str, run_name: str, config: dict[str, Any]) -> None:
        super().__init__(run_dir, project, run_name, config)
        from torch.utils.tensorboard import SummaryWriter  # optional: tensorboard

        self.writer = SummaryWriter(str(run_dir / "tensorboard"))

    def log(self, metrics: dict[str, float], step: int) -> None:
        for k, v in metrics.items():
            if isinstance(v, (int, float)) and math.isfinite(v):
                self.writer.add_scalar(k, v, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def missing_extra(name: str, modules: str) -> ConfigError:
    """The error for a tracker whose library is not installed: names the extra that brings it."""
    return ConfigError(
        f"trainer.trackers has {name!r} but {modules} is not installed; install the extra: "
        f"pip install 'tephra-controller[{name}]' (in this workspace: uv sync installs it), "
        f"or drop {name!r} from trainer.trackers"
    )


@TRACKERS.register("wandb")
class WandbTracker(Tracker):
    """Weights & Biases in offline mode: the run is written under `run_dir/wandb/offline-run-*`
    and nothing is sent; upload later with `wandb sync run_dir/wandb/offline-run-*`.

    Metrics are logged with `step=` the trainer's step, so a step logged twice (training
    metrics, then a validation score) lands in one history row.
    """

    def __init__(self, run_dir: Path, project: str, run_name: str, config: dict[str, Any]) -> None:
        super().__init__(run_dir, project, run_name, config)
        try:
            import wandb  # optional: the wandb extra
        except ImportError:
            raise missing_extra("wandb", "wandb") from None
        self.run = wandb.init(
            project=project, name=run_name, config=config, mode="offline", dir=str(run_dir)
        )

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()


def _finite_numbers(metrics: dict[str, Any]) -> dict[str, float]:
    return {
        k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and math.isfinite(v)
    }


@TRACKERS.register("mlflow")
class MlflowTracker(Tracker):
    """MLflow to a local SQLite store, `run_dir/mlflow.db` (artifacts in `run_dir/mlartifacts`).

    View with `mlflow ui --backend-store-uri sqlite:///<run_dir>/mlflow.db`. SQLite, not the
    `./mlruns` folder store: MLflow 3 refuses the folder store unless MLFLOW_ALLOW_FILE_STORE
    is set. The tracker talks through its own `MlflowClient`, so it leaves mlflow's global
    tracking URI and active run alone. The config goes to the run's `config.json` artifact;
    non-numeric and non-finite values are skipped, as for TensorBoard.
    """

    def __init__(self, run_dir: Path, project: str, run_name: str, config: dict[str, Any]) -> None:
        super().__init__(run_dir, project, run_name, config)
        try:
            import alembic  # noqa: F401 (the SQLite store needs it; mlflow-skinny leaves it out)
            import sqlalchemy  # noqa: F401
            from mlflow.entities import Metric  # optional: the mlflow extra
            from mlflow.tracking import MlflowClient
        except ImportError:
            raise missing_extra("mlflow", "mlflow-skinny (or sqlalchemy, alembic)") from None
        self._metric = Metric
        self.tracking_uri = "sqlite:///" + str((run_dir / "mlflow.db").resolve())
        self.client = MlflowClient(tracking_uri=self.tracking_uri)
        experiment = self.client.get_experiment_by_name(project)
        experiment_id = (
            experiment.experiment_id
            if experiment is not None
            else self.client.create_experiment(
                project, artifact_location=(run_dir / "mlartifacts").resolve().as_uri()
            )
        )
        self.run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id
        self.client.log_text(self.run_id, json.dumps(config, indent=1, default=str), "config.json")

    def log(self, metrics: dict[str, float], step: int) -> None:
        now_ms = int(time.time() * 1000)
        batch = [self._metric(k, v, now_ms, step) for k, v in _finite_numbers(metrics).items()]
        if batch:
            self.client.log_batch(self.run_id, metrics=batch)

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


_CLEARML_AUTO_CONNECT = (
    "detect_repository",
    "hydra",
    "scikit",
    "joblib",
    "matplotlib",
    "tensorflow",
    "tensorboard",
    "tfdefines",
    "pytorch",
    "megengine",
    "xgboost",
    "catboost",
    "fastai",
    "lightgbm",
    "gradio",
)
"""Everything `clearml.Task.init` connects by itself (clearml 2.1)."""


@TRACKERS.register("clearml")
class ClearMLTracker(Tracker):
    """ClearML in offline mode: the session is written under `run_dir/clearml/offline/` (a
    folder, and a `.zip` of it when the run closes) and nothing is sent; upload later with
    `clearml.Task.import_offline_session("<run_dir>/clearml/offline/offline-<id>.zip")`.

    Each metric `section/name` is a scalar of title `section`, series `name` (ClearML's two
    levels), at iteration = the trainer's step; the config is the task's `config`
    configuration. Non-numeric and non-finite values are skipped, as for MLflow. ClearML's
    automatic logging (frameworks, console, resources, argv) is off: the trainer logs what it
    measures itself. ClearML's offline switch is process-wide and stays on after the run (it
    cannot be switched back off on a machine without a ClearML server configured).
    """

    def __init__(self, run_dir: Path, project: str, run_name: str, config: dict[str, Any]) -> None:
        super().__init__(run_dir, project, run_name, config)
        try:
            from clearml import Logger, Task  # optional: the clearml extra
        except ImportError:
            raise missing_extra("clearml", "clearml") from None
        Task.set_offline(offline_mode=True)
        # ClearML reads where its offline sessions go when a task starts
        before = os.environ.get("CLEARML_CACHE_DIR")
        os.environ["CLEARML_CACHE_DIR"] = str((run_dir / "clearml").resolve())
        try:
            # clearml's `init` returns a TypeVar its `cls` is not annotated with: name the type
            self.task: Task = Task.init(
                project_name=project,
                task_name=run_name,
                reuse_last_task_id=False,
                auto_connect_arg_parser=False,
                # a dict, not False: only a dict also turns off the repository and package
                # detection (a pip freeze of the environment, and a request for ClearML's
                # updates); its missing keys would count as True
                auto_connect_frameworks=dict.fromkeys(_CLEARML_AUTO_CONNECT, False),
                auto_resource_monitoring=False,
                auto_connect_streams=False,
            )
        finally:
            if before is None:
                del os.environ["CLEARML_CACHE_DIR"]
            else:
                os.environ["CLEARML_CACHE_DIR"] = before
        self.task.connect_configuration(config, name="config")
        self.folder = Path(self.task.get_offline_mode_folder())
        self.logger: Logger = self.task.get_logger()

    def log(self, metrics: dict[str, float], step: int) -> None:
        for key, value in _finite_numbers(metrics).items():
            title, _, series = key.rpartition("/")
            self.logger.report_scalar(title or series, series, value, iteration=step)

    def close(self) -> None:
        self.task.close()


@TRACKERS.register("swanlab")
class SwanLabTracker(Tracker):
    """SwanLab in offline mode: the run is written under `run_dir/swanlab/run-*` and nothing
    is sent; upload later with `swanlab sync run_dir/swanlab/run-*`.

    Metrics are logged with `step=` the trainer's step; non-numeric and non-finite values are
    skipped, as for MLflow.
    """

    def __init__(self, run_dir: Path, project: str, run_name: str, config: dict[str, Any]) -> None:
        super().__init__(run_dir, project, run_name, config)
        try:
            import swanlab  # optional: the swanlab extra
        except ImportError:
            raise missing_extra("swanlab", "swanlab") from None
        self.run = swanlab.init(
            project=project,
            experiment_name=run_name,
            config=config,
            mode="offline",
            logdir=str(run_dir / "swanlab"),
        )

    def log(self, metrics: dict[str, float], step: int) -> None:
        numbers = _finite_numbers(metrics)
        if numbers:
            self.run.log(numbers, step=step)

    def close(self) -> None:
        self.run.finish()


class Trackers:
    """All configured trackers behind one `log`."""

    def __init__(
        self, names: list[str], run_dir: Path, project: str, run_name: str, config: dict[str, Any]
    ) -> None:
        self.items: list[Tracker] = []
        try:
            for name in names:
                self.items.append(TRACKERS.get(name)(run_dir, project, run_name, config))
        except BaseException:
            self.close()  # a tracker that cannot start must not leave the others' files open
            raise

    def log(self, metrics: dict[str, float], step: int) -> None:
        for t in self.items:
            t.log(metrics, step)

    def close(self) -> None:
        for t in self.items:
            t.close()


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """One merged record per step, in step order. Records of one step are merged (training
    metrics and a validation score are logged separately); a key logged again, as when a
    resumed run repeats steps after its checkpoint, keeps the later value."""
    by_step: dict[int, dict] = {}
    for line in Path(path).read_text().splitlines():
        if line.strip():
            rec = json.loads(line)
            by_step.setdefault(rec["step"], {}).update(rec)
    return [by_step[s] for s in sorted(by_step)]


def plot_curves(
    records: list[dict[str, Any]],
    path: Path,
    keys: tuple[str, ...] = ("reward/mean", "accuracy/train", "accuracy/val"),
) -> None:
    """Reward/accuracy against step as a PNG."""
    import matplotlib  # heavy: only the curve plot at the end needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after use("Agg"): no display here

    fig, ax = plt.subplots(figsize=(7, 4))
    for key in keys:
        pts = [(r["step"], r[key]) for r in records if key in r]
        if pts:
            ax.plot(*zip(*pts), marker="o" if key == "accuracy/val" else None, label=key)
    ax.set_xlabel("step")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
