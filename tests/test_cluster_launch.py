"""The cluster launch files users submit as they are: the Slurm template (`bash -n`, and a dry
run with Slurm's variables set: the commands it would run, checked), and the KubeRay RayJob
manifest (its pod templates against Kubernetes' PodTemplate schema, its RayJob fields
against the RayJob v1 fields KubeRay documents, and its settings against the launch scripts'
and the trainer's)."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tephra.apps.ppo.main import parse_config

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "scripts" / "cluster"


def dry_run(tmp_path: Path, *args: str, **env: str) -> list[list[str]]:
    """The commands `slurm.sbatch` would run, parsed, on a machine without Slurm."""
    environ = {
        "PATH": "/usr/bin:/bin",  # no srun / scontrol: nothing can really start
        "HOME": str(tmp_path),
        "PYTHON": sys.executable,
        "TEPHRA_DRY_RUN": "1",
        "SLURM_SUBMIT_DIR": str(REPO),
        **env,
    }
    done = subprocess.run(
        ["bash", str(SCRIPTS / "slurm.sbatch"), *args],
        env=environ,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert all(line.startswith("+ ") for line in lines), lines
    return [shlex.split(line[2:]) for line in lines]


def test_sbatch_template_parses():
    done = subprocess.run(["bash", "-n", str(SCRIPTS / "slurm.sbatch")], capture_output=True)
    assert done.returncode == 0, done.stderr


def test_sbatch_dry_run_starts_head_workers_and_the_app_on_the_head(tmp_path):
    commands = dry_run(
        tmp_path,
        "-p",
        "smoke",
        "batch.prompts_per_step=48",
        "trainer.steps=3",
        SLURM_JOB_NODELIST="gpu[07-09]",
        SLURM_GPUS_ON_NODE="8",
        SLURM_CPUS_PER_TASK="64",
    )
    venv, head, *workers, wait, app = commands
    assert venv == ["source", f"{REPO}/.venv/bin/activate"]
    srun = ["srun", "--nodes=1", "--ntasks=1"]
    assert head == [*srun, "--nodelist=gpu07", "bash", f"{SCRIPTS}/ray-head.sh"]
    assert workers == [
        [*srun, f"--nodelist={node}", "bash", f"{SCRIPTS}/ray-worker.sh", "gpu07:6379"]
        for node in ("gpu08", "gpu09")
    ]
    assert wait == [sys.executable, f"{SCRIPTS}/wait_for_nodes.py", "gpu07:6379", "3"]
    assert app[:2] == [sys.executable, f"{REPO}/apps/ppo"]
    # 3 nodes x 8 GPUs: one rank per GPU, the node's 64 CPUs shared by its 8 ranks
    assert app[2:] == [
        "resources.ray_address=gpu07:6379",
        "resources.world_size=24",
        "resources.cpus_per_rank=8",
        "resources.gpus_per_rank=1",
        "-p",
        "smoke",
        "batch.prompts_per_step=48",
        "trainer.steps=3",
    ]
    cfg = parse_config(app[2:])  # what the app would read: a valid config, the user's last
    r = cfg.resources
    assert (r.ray_address, r.world_size, r.cpus_per_rank, r.gpus_per_rank) == (
        "gpu07:6379",
        24,
        8.0,
        1.0,
    )
    assert cfg.trainer.steps == 3


def test_sbatch_dry_run_cpu_nodes_and_a_port(tmp_path):
    """CPU nodes (no GPUs): one rank per node with all its CPUs; a list of single hosts; a
    port of the user's."""
    *_, wait, app = dry_run(
        tmp_path,
        SLURM_JOB_NODELIST="a1,b2",
        SLURM_CPUS_PER_TASK="16",
        TEPHRA_RAY_PORT="7000",
    )
    assert wait[-2:] == ["a1:7000", "2"]
    assert app[2:] == [
        "resources.ray_address=a1:7000",
        "resources.world_size=2",
        "resources.cpus_per_rank=16",
        "resources.gpus_per_rank=0",
    ]


def test_sbatch_outside_slurm_says_so(tmp_path):
    done = subprocess.run(
        ["bash", str(SCRIPTS / "slurm.sbatch")],
        env={"PATH": "/usr/bin:/bin", "TEPHRA_DRY_RUN": "1"},
        capture_output=True,
        text=True,
    )
    assert done.returncode == 1
    assert "SLURM_JOB_NODELIST is not set: submit with sbatch" in done.stderr


STRINGS = {"type": "object", "additionalProperties": {"type": "string"}}
OBJECT = {"type": "object"}
INT = {"type": "integer", "minimum": 0}


def closed(properties: dict, required: tuple[str, ...] = ()) -> dict:
    return {
        "type": "object",
        "properties": properties,
        "required": list(required),
        "additionalProperties": False,
    }


# The RayJob v1 fields of KubeRay's API reference (v1.5-v1.6) this manifest may use. Closed
# objects: a misspelt field fails here instead of being dropped by the API server.
HEAD_GROUP = closed(
    {
        "rayStartParams": STRINGS,
        "template": OBJECT,
        "serviceType": {"type": "string"},
        "enableIngress": {"type": "boolean"},
        "headService": OBJECT,
    },
    ("template",),
)
WORKER_GROUP = closed(
    {
        "groupName": {"type": "string"},
        "replicas": INT,
        "minReplicas": INT,
        "maxReplicas": INT,
        "numOfHosts": INT,
        "rayStartParams": STRINGS,
        "template": OBJECT,
        "suspend": {"type": "boolean"},
        "idleTimeoutSeconds": INT,
        "scaleStrategy": OBJECT,
    },
    ("groupName", "template"),
)
RAY_JOB = closed(
    {
        "apiVersion": {"const": "ray.io/v1"},
        "kind": {"const": "RayJob"},
        "metadata": OBJECT,
        "spec": closed(
            {
                "entrypoint": {"type": "string"},
                "shutdownAfterJobFinishes": {"type": "boolean"},
                "ttlSecondsAfterFinished": INT,
                "activeDeadlineSeconds": INT,
                "backoffLimit": INT,
                "runtimeEnvYAML": {"type": "string"},
                "submissionMode": {"enum": ["K8sJobMode", "HTTPMode", "InteractiveMode"]},
                "submitterPodTemplate": OBJECT,
                "suspend": {"type": "boolean"},
                "rayClusterSpec": closed(
                    {
                        "rayVersion": {"type": "string"},
                        "authOptions": closed({"mode": {"enum": ["disabled", "token"]}}),
                        "enableInTreeAutoscaling": {"type": "boolean"},
                        "headGroupSpec": HEAD_GROUP,
                        "workerGroupSpecs": {"type": "array", "items": WORKER_GROUP},
                    },
                    ("headGroupSpec",),
                ),
            },
            ("entrypoint", "rayClusterSpec"),
        ),
    },
    ("apiVersion", "kind", "metadata", "spec"),
)


def load_manifest() -> dict:
    return yaml.safe_load((SCRIPTS / "rayjob.yaml").read_text())


def check_manifest(job: dict) -> None:
    jsonschema.validate(job, RAY_JOB)
    cluster = job["spec"]["rayClusterSpec"]
    groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    for group in groups:
        pod = {
            "apiVersion": "v1",
            "kind": "PodTemplate",
            "metadata": {"name": "x"},
            "template": group["template"],
        }
        kubernetes_validate.validate(pod, "1.33.0", strict=True)


def test_rayjob_manifest_passes_the_schemas_and_matches_the_scripts(monkeypatch):
    job = load_manifest()
    check_manifest(job)
    cluster = job["spec"]["rayClusterSpec"]
    assert cluster["authOptions"] == {"mode": "token"}  # as the scripts: token auth on
    head = cluster["headGroupSpec"]
    assert head["rayStartParams"]["port"] == "6379"  # common.sh's TEPHRA_RAY_PORT
    gpus = 0
    for group in [head, *cluster["workerGroupSpecs"]]:
        params = group["rayStartParams"]
        (container,) = group["template"]["spec"]["containers"]
        limits = container["resources"]["limits"]
        # Ray offers what rayStartParams say: equal to what the pod may use
        assert (
            params["num-cpus"] == limits["cpu"] and params["num-gpus"] == limits["nvidia.com/gpu"]
        )
        shm = {v["name"]: v for v in group["template"]["spec"]["volumes"]}["shm"]["emptyDir"]
        store = int(params["object-store-memory"])
        assert store <= int(shm["sizeLimit"].removesuffix("Gi")) * 2**30
        gpus += int(params["num-gpus"]) * group.get("replicas", 1)
    command = shlex.split(job["spec"]["entrypoint"])
    assert command[:2] == ["python", "apps/ppo"]
    # the job's driver runs where KubeRay's job submission set RAY_ADDRESS to the cluster
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    r = parse_config(command[2:]).resources
    assert r.world_size * r.gpus_per_rank == gpus == 16  # every GPU of the 2 pods has a rank


@pytest.mark.parametrize(
    "fault, error",
    [
        ("rayStartParams_int", jsonschema.ValidationError),
        ("misspelt_field", jsonschema.ValidationError),
        ("bad_container_field", kubernetes_validate.ValidationError),
    ],
)
def test_rayjob_schema_check_catches_planted_faults(fault, error):
    job = load_manifest()
    cluster = job["spec"]["rayClusterSpec"]
    if fault == "rayStartParams_int":  # KubeRay takes strings only
        cluster["headGroupSpec"]["rayStartParams"]["num-gpus"] = 8
    elif fault == "misspelt_field":
        cluster["workerGroupSpecs"][0]["replica"] = cluster["workerGroupSpecs"][0].pop("replicas")
    else:
        cluster["headGroupSpec"]["template"]["spec"]["containers"][0]["workdir"] = "/app"
    with pytest.raises(error):
        check_manifest(job)
