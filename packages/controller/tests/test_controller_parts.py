"""Controller parts: config loading, data, loader resume, checkpoints, trackers, and a worker
group on Ray with a trivial worker (dispatch modes checked against a single-process value)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensordict import TensorDict

from tephra.controller.cluster.dispatch import Dispatch, dispatch
from tephra.controller.cluster.worker_group import (
    ResourcePool,
    Worker,
    WorkerGroup,
    _rendezvous_address,
    ray_init,
    rendezvous_address,
)
from tephra.controller.data.prompts import (
    DatasetError,
    PromptLoader,
    load_hf_dataset,
    load_parquet,
    reasoning_gym_records,
)
from tephra.controller.run.trackers import Trackers, read_jsonl
from tephra.core.config import load_config, split_cli
from tephra.engine_api.errors import BatchError, ConfigError
from tephra.episodes.prompt import Prompt
from tephra.episodes.rewards import reasoning_gym_rows
from tephra.episodes.testing import CALC_MCP_SERVER
from tephra.rollout.testing import live_processes


@dataclass
class Inner:
    lr: float = 1e-3
    """learning rate"""
    names: list[str] = field(default_factory=lambda: ["a"])
    """names"""


@dataclass
class Outer:
    steps: int = 1
    """steps"""
    path: str | None = None
    """a path"""
    inner: Inner = field(default_factory=Inner)
    """inner"""


def test_config_presets_overrides_and_unknown_keys(tmp_path):
    (tmp_path / "p.yaml").write_text("steps: 3\ninner:\n  lr: 0.5\n")
    cfg = load_config(
        Outer, ["p"], ["inner.lr=2e-2", "inner.names=[x,y]", "path=/m"], preset_dir=tmp_path
    )
    assert cfg == Outer(steps=3, path="/m", inner=Inner(lr=0.02, names=["x", "y"]))
    with pytest.raises(
        ConfigError, match=r"unknown config key 'inner\.lrr'; did you mean 'inner\.lr'"
    ):
        load_config(Outer, [], ["inner.lrr=1"])
    (tmp_path / "bad.yaml").write_text("inner:\n  lx: 1\n")
    with pytest.raises(ConfigError, match=r"'inner\.lx'; did you mean 'lr'"):
        load_config(Outer, [str(tmp_path / "bad.yaml")])
    with pytest.raises(ConfigError, match=r"steps='many' must be an integer"):
        load_config(Outer, [], ["steps=many"])
    assert split_cli(["-p", "smoke", "a=1", "preset=x,y"]) == (["smoke", "x", "y"], ["a=1"])


def test_parquet_rows_are_validated_with_row_and_field(tmp_path):
    good = {
        "prompt": [[{"role": "user", "content": "1+1?"}]],
        "data_source": ["gsm8k"],
        "reward_model": [{"ground_truth": "2", "style": "rule"}],
        "extra_info": [{"i": 0}],
    }
    pq.write_table(pa.table(good), tmp_path / "good.parquet")
    (rec,) = load_parquet(tmp_path / "good.parquet")
    assert (
        rec.ground_truth == "2"
        and rec.messages[0]["content"] == "1+1?"
        and rec.extra_info == {"i": 0}
    )
    bad = {
        "prompt": [[{"role": "user", "content": "q"}]] * 2,
        "data_source": ["a", "a"],
        "reward_model": [{"ground_truth": "1"}, {"style": "rule"}],
    }
    pq.write_table(pa.table(bad), tmp_path / "bad.parquet")
    with pytest.raises(
        DatasetError, match=r"row 1 of bad.parquet: field 'reward_model.ground_truth' is missing"
    ):
        load_parquet(tmp_path / "bad.parquet")


VERL_ROWS = [
    {
        "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1?"}],
        "data_source": "gsm8k",
        "reward_model": {"ground_truth": "2", "style": "rule"},
        "extra_info": {"index": 0, "split": "train"},
    },
    {
        "prompt": [{"role": "user", "content": "3*4?"}],
        "data_source": "math",
        "reward_model": {"ground_truth": "12", "style": "rule"},
        "extra_info": {"index": 1, "split": "x"},
    },
]


def records_by_hand(rows, where):
    return [
        Prompt(
            r["prompt"],
            r["data_source"],
            r["reward_model"]["ground_truth"],
            r["extra_info"],
            origin=f"row {i} of {where}",
        )
        for i, r in enumerate(rows)
    ]


def test_hf_datasets_offline_folders_files_splits_and_row_errors(
    tmp_path, monkeypatch, network_guard
):
    import datasets

    # load_dataset converts data files into its cache: keep that under tmp_path
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
    train, test = VERL_ROWS, [dict(VERL_ROWS[1], data_source="held_out")]
    datasets.Dataset.from_list(train).save_to_disk(str(tmp_path / "single"))
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(train), "test": datasets.Dataset.from_list(test)}
    ).save_to_disk(str(tmp_path / "dict"))
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in train))
    (tmp_path / "files").mkdir()
    pq.write_table(pa.Table.from_pylist(test), tmp_path / "files" / "part-0.parquet")

    def loaded(name, split="train"):
        return load_hf_dataset(str(tmp_path / name), split)

    # each record names its row for later errors: "row <i> of <source>[<split>]"
    assert loaded("single") == records_by_hand(train, f"{tmp_path / 'single'}[train]")
    assert loaded("dict") == records_by_hand(train, f"{tmp_path / 'dict'}[train]")
    assert loaded("dict", "test") == records_by_hand(test, f"{tmp_path / 'dict'}[test]")
    assert loaded("rows.jsonl") == records_by_hand(train, f"{tmp_path / 'rows.jsonl'}[train]")
    assert loaded("files") == records_by_hand(test, f"{tmp_path / 'files'}[train]")

    with pytest.raises(DatasetError, match=r"no split 'validation'; it has \['test', 'train'\]"):
        load_hf_dataset(str(tmp_path / "dict"), "validation")
    with pytest.raises(DatasetError, match=r"files\[valid\]: Unknown split"):
        load_hf_dataset(str(tmp_path / "files"), "valid")
    with pytest.raises(DatasetError, match=r"missing does not exist; set data.train_files"):
        load_hf_dataset(str(tmp_path / "missing"), "train")
    with pytest.raises(
        DatasetError, match=r"a single file holds only the split 'train', not 'test'"
    ):
        load_hf_dataset(str(tmp_path / "rows.jsonl"), "test")
    (tmp_path / "rows.txt").write_text("x")
    with pytest.raises(DatasetError, match=r"cannot read '.txt' files"):
        load_hf_dataset(str(tmp_path / "rows.txt"))

    # each broken row is named by its index in the split, with the field and the fix
    bad = {
        "no_source": (dict(VERL_ROWS[1], data_source=None), "data_source", "is missing"),
        "no_truth": (
            dict(VERL_ROWS[1], reward_model={"style": "rule", "ground_truth": None}),
            "reward_model.ground_truth",
            "is missing",
        ),
        "no_content": (
            dict(VERL_ROWS[1], prompt=[{"role": "user", "content": None}]),
            "prompt",
            "holds .*, not a {role, content} message",
        ),
    }
    for folder, (row, field_name, why) in bad.items():
        datasets.Dataset.from_list([VERL_ROWS[0], row]).save_to_disk(str(tmp_path / folder))
        with pytest.raises(
            DatasetError,
            match=rf"row 1 of .*{folder}\[train\]: field "
            rf"'{re.escape(field_name)}' {why}; each row needs 'prompt'",
        ):
            load_hf_dataset(str(tmp_path / folder), "train")
    assert network_guard == []


def test_reasoning_gym_is_reproducible_and_loader_resumes():
    a = reasoning_gym_records("basic_arithmetic", 5, seed=3)
    b = reasoning_gym_records("basic_arithmetic", 5, seed=3)
    assert [r.messages for r in a] == [r.messages for r in b] and a[0].data_source.endswith(
        "basic_arithmetic"
    )
    full = PromptLoader(10, 4, seed=1)
    seq = [full.next_indices() for _ in range(5)]
    part = PromptLoader(10, 4, seed=1)
    part.next_indices(), part.next_indices()
    resumed = PromptLoader(10, 4, seed=1)
    resumed.load_state_dict(json.loads(json.dumps(part.state_dict())))
    assert [resumed.next_indices() for _ in range(3)] == seq[2:]
    assert all(len(set(s)) == 4 for s in seq)


@pytest.mark.parametrize("num_prompts, per_step", [(10, 4), (7, 3), (12, 4), (5, 5), (9, 8)])
def test_loader_serves_every_prompt_once_per_epoch_across_resumes(num_prompts, per_step):
    """The prompt stream, cut into epochs of `num_prompts`, is a permutation of all prompts in
    each epoch (the leftover of an epoch is carried into the next step, not dropped); each step
    holds distinct prompts; a loader resumed from any step's saved state continues the same."""
    steps = 12 * num_prompts // per_step + 1
    whole = PromptLoader(num_prompts, per_step, seed=4)
    seq = [whole.next_indices() for _ in range(steps)]
    assert all(len(step) == per_step and len(set(step)) == per_step for step in seq)
    stream = [i for step in seq for i in step]
    epochs = [stream[e : e + num_prompts] for e in range(0, len(stream), num_prompts)]
    assert all(sorted(epoch) == list(range(num_prompts)) for epoch in epochs[:-1])
    assert len(epochs) >= 12 and whole.epoch == (steps * per_step - 1) // num_prompts
    for k in range(steps):
        part = PromptLoader(num_prompts, per_step, seed=4)
        for _ in range(k):
            part.next_indices()
        resumed = PromptLoader(num_prompts, per_step, seed=4)
        resumed.load_state_dict(json.loads(json.dumps(part.state_dict())))
        assert [resumed.next_indices() for _ in range(steps - k)] == seq[k:], k


def test_trackers_write_jsonl_and_tensorboard(tmp_path, capsys):
    t = Trackers(["jsonl", "tensorboard", "console"], tmp_path, "p", "r", {})
    t.log({"reward/mean": 0.5, "critic/loss": 2.0}, 1)
    t.log({"reward/mean": 0.7}, 2)
    t.log({"loss": 1.25, "grad_norm": 3.0}, 3)  # no RL headline metric (SFT): all of them
    t.close()
    assert [r.get("reward/mean") for r in read_jsonl(tmp_path / "metrics.jsonl")] == [
        0.5,
        0.7,
        None,
    ]
    # the scalars read back from the event files, step by step
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    logged = {
        tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]
    }
    assert logged["reward/mean"] == [(1, 0.5), (2, pytest.approx(0.7))]
    assert logged["critic/loss"] == [(1, 2.0)]
    assert logged["grad_norm"] == [(3, 3.0)] and logged["loss"] == [(3, 1.25)]
    assert capsys.readouterr().out.splitlines() == [
        "step 1: mean=0.5",
        "step 2: mean=0.7",
        "step 3: loss=1.25 grad_norm=3",
    ]


class EngineGone:
    """A rollout engine whose close fails: the worker must close its tools anyway."""

    def close(self):
        raise RuntimeError("engine already gone")


def test_rl_worker_close_closes_the_tools_it_built(tmp_path):
    from tephra.controller.workers.generation import Generator
    from tephra.controller.workers.rl_worker import RLWorker
    from tephra.episodes.tools import load_tools

    server = tmp_path / "worker_mcp_server.py"
    server.write_text(CALC_MCP_SERVER)
    (tmp_path / "tools.yaml").write_text(
        f"- class: mcp\n  config: {{command: {sys.executable}, args: [{server}]}}\n"
    )
    worker = RLWorker.__new__(RLWorker)  # no engines: only the shutdown path is under test
    generation = worker.generation = Generator(None, str(tmp_path), None, EngineGone())
    generation._tools = load_tools(tmp_path / "tools.yaml")
    assert len(live_processes(str(server))) == 1
    with pytest.raises(RuntimeError, match="engine already gone"):
        worker.close()
    assert live_processes(str(server)) == [] and generation._tools == {}


class SumWorker(Worker):
    """Each rank scales its share; an all-reduce checks the process group is real."""

    def __init__(self, rank, world_size, *worker_args, scale):
        super().__init__(rank, world_size, *worker_args)
        self.scale = scale

    @dispatch(Dispatch.DP_SPLIT)
    def scaled(self, batch: TensorDict) -> TensorDict:
        import torch.distributed as dist

        total = batch["x"].sum().clone()
        dist.all_reduce(total)
        return TensorDict(
            {
                "y": batch["x"] * self.scale,
                "total": total.expand(batch.batch_size[0]),
                "rank": torch.full((batch.batch_size[0],), self.rank),
            },
            batch_size=batch.batch_size,
        )

    @dispatch(Dispatch.BROADCAST)
    def whoami(self) -> int:
        return self.rank

    @dispatch(Dispatch.RANK_ZERO)
    def first(self, v):
        return (self.rank, v)

    @dispatch(Dispatch.BROADCAST)
    def environ(self, key: str) -> str | None:
        return os.environ.get(key)

    @dispatch(Dispatch.BROADCAST)
    def retains(self) -> bool:
        return self.retains_freed_memory

    @dispatch(Dispatch.BROADCAST)
    def write_after(self, folder: str, delay_s: float) -> None:
        time.sleep(delay_s)
        (Path(folder) / f"rank{self.rank}").write_text("done")


@pytest.mark.multiproc
def test_worker_group_dispatch_on_ray(tmp_path):
    import ray

    ray_init(num_cpus=2)
    pool = ResourcePool(world_size=2, cpus_per_rank=1)
    wg = WorkerGroup(SumWorker, pool, {"scale": 3.0})
    x = torch.arange(6, dtype=torch.float32)
    out = wg.scaled(TensorDict({"x": x}, batch_size=[6]))
    assert torch.equal(out["y"], x * 3) and torch.equal(
        out["rank"], torch.tensor([0, 0, 0, 1, 1, 1])
    )
    assert torch.all(out["total"] == x.sum())
    assert wg.whoami() == [0, 1] and wg.first("v") == (0, "v")
    # the ranks start quiet: no per-rank weight-loading progress bars in the console
    assert wg.environ("HF_HUB_DISABLE_PROGRESS_BARS") == ["1", "1"]
    # CPU ranks keep freed memory (resources.retain_freed_memory=None: glibc took the raised
    # thresholds; the effect itself is tested in tephra-core)
    assert wg.retains() == [True, True]
    # rank 0's address is found in the driver when its bundle is on the driver's node: the
    # same address the task on rank 0's bundle (the path for another node) reports
    (addr, port), (task_addr, _) = (
        rendezvous_address(pool),
        ray.get(_rendezvous_address.options(scheduling_strategy=pool.strategy_for(0)).remote()),
    )
    assert addr == task_addr == ray.util.get_node_ip_address() and 0 < port < 65536
    with pytest.raises(BatchError, match="does not split evenly over 2"):
        wg.scaled(TensorDict({"x": x[:5]}, batch_size=[5]))
    with pytest.raises(ConfigError, match="needs 4 CPUs"):
        WorkerGroup(SumWorker, ResourcePool(world_size=2, cpus_per_rank=2), {"scale": 1.0})
    # a local session demands its own token: a client without it is turned away, and no
    # dashboard was started
    gcs = ray.get_runtime_context().gcs_address
    assert os.environ["RAY_AUTH_MODE"] == "token" and len(os.environ["RAY_AUTH_TOKEN"]) == 64
    assert not ray._private.worker.global_worker.node.address_info.get("webui_url")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    intruder = subprocess.Popen(
        [sys.executable, "-c", f"import ray; ray.init(address={gcs!r}); print('joined')"],
        env={**env, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "0" * 64},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:  # Ray's client retries for a minute before it gives up: its first refusal is enough
        out, err = intruder.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        intruder.kill()
        out, err = intruder.communicate()
    assert "joined" not in out and "InvalidAuthToken" in err, err[-2000:]
    # shutdown lets each rank finish what it was asked before it exits (no kill mid-call)
    for w in wg.workers:
        w.execute.remote("write_after", str(tmp_path), 1.0)
    wg.shutdown()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0", "rank1"]
    pool.release()
    ray.shutdown()


NEUTRAL = ["model.path=tiny", "data.source=code_problems"]
"""The least a library config (no app preset under it) must name: a policy and a data source
(`code_problems` needs no other data key)."""


def test_the_library_defaults_are_neutral_and_the_policy_is_required():
    """The library's tree is tuned for no task: no default policy and no default data source
    (a config without either is refused while it loads, naming `model.path` / `data.source`
    and how to set it, before Ray starts), no reasoning-gym task, options or instruction, one
    step, the engine-api optimizer and the algos loss as they define them. The demo's
    choices are the apps/ppo default preset's (tests/test_preset_configs.py)."""
    import ray

    from tephra.algos import ActorObjectiveConfig
    from tephra.controller.config.tree import PPOConfig
    from tephra.engine_api.config import OptimizerConfig

    for overrides in ([], ["trainer.steps=3", "actor.optimizer.lr=1e-4"]):
        with pytest.raises(
            ConfigError,
            match=r"^config key 'model' is required and not set: set model\.path to a local "
            r"Hugging Face folder .* e\.g\. model\.path=smollm2; `uv run apps/ppo` sets",
        ):
            load_config(PPOConfig, [], overrides)
    with pytest.raises(ConfigError, match=r"set exactly one of model\.path .* or model\.hf_config"):
        load_config(PPOConfig, [], ["model.tokenizer_path=/x"])  # a model section without a path
    for overrides in (["model.path=tiny"], ["model.path=tiny", "data.val_size=8"]):
        with pytest.raises(
            ConfigError,
            match=r"^data\.source is not set: set data\.source to one of reasoning_gym, "
            r"parquet, hf, colour_squares, code_problems, swe_tasks \(reasoning_gym needs data\.task, "
            r"parquet and hf data\.train_files\), e\.g\. data\.source=reasoning_gym "
            r"data\.task=basic_arithmetic; `uv run apps/ppo` sets the demo's data",
        ):
            load_config(PPOConfig, [], overrides)
    with pytest.raises(
        ConfigError,
        match=r"^data\.task is not set: data\.source=reasoning_gym .* e\.g\. "
        r"data\.task=basic_arithmetic",
    ):
        load_config(PPOConfig, [], ["model.path=tiny", "data.source=reasoning_gym"])
    assert not ray.is_initialized()
    cfg = load_config(PPOConfig, [], NEUTRAL)
    assert cfg.model.path == "tiny" and cfg.trainer.steps == 1
    assert (cfg.data.task, cfg.data.task_config, cfg.data.instruction) == ("", {}, "")
    assert cfg.actor.optimizer == OptimizerConfig() and OptimizerConfig().lr == 1e-6
    assert cfg.actor.objective == ActorObjectiveConfig()
    assert cfg.actor.objective.loss_agg_mode == "token-mean"
    # a reasoning-gym task named alone: its own options, the question with nothing appended
    rg = load_config(
        PPOConfig,
        [],
        ["model.path=tiny", "data.source=reasoning_gym", "data.task=basic_arithmetic"],
    )
    (item,) = reasoning_gym_records(rg.data.task, 1, 0, rg.data.task_config, rg.data.instruction)
    (row,) = reasoning_gym_rows("basic_arithmetic", 1, 0, extract="last_number")
    assert item.messages == [{"role": "user", "content": row["question"]}]


def test_auto_dtypes_are_resolved_once_for_the_workers_device():
    """`auto` (the default) becomes one concrete dtype before any worker starts: the CPU's
    measured choice for CPU ranks and replicas, bf16 for CUDA ones; explicit dtypes stay."""
    from tephra.controller.config.tree import PPOConfig
    from tephra.controller.launch.preflight import resolve_auto_dtypes
    from tephra.engine_api.fastest_dtype import fastest_dtype

    cfg = load_config(PPOConfig, [], NEUTRAL)
    assert (cfg.actor.precision.param_dtype, cfg.rollout.dtype) == ("auto", "auto")
    cpu = resolve_auto_dtypes(cfg)
    assert (
        cpu.actor.precision.param_dtype == cpu.critic.precision.param_dtype == fastest_dtype("cpu")
    )
    assert cpu.rollout.dtype == fastest_dtype("cpu")
    fixed = resolve_auto_dtypes(
        load_config(
            PPOConfig,
            [],
            [*NEUTRAL, "actor.precision.param_dtype=float32", "rollout.dtype=bfloat16"],
        )
    )
    assert (fixed.actor.precision.param_dtype, fixed.rollout.dtype) == ("float32", "bfloat16")
    # the critic's `auto` follows the actor's dtype, as its field says (an fp32 critic beside
    # an fp32 actor, whatever the machine's fastest dtype), and an explicit one stays
    assert fixed.critic.precision.param_dtype == "float32"
    mixed = resolve_auto_dtypes(
        load_config(
            PPOConfig,
            [],
            [
                *NEUTRAL,
                "actor.precision.param_dtype=float32",
                "critic.precision.param_dtype=bfloat16",
            ],
        )
    )
    assert mixed.critic.precision.param_dtype == "bfloat16"
    if torch.cuda.is_available() and torch.cuda.is_bf16_supported():
        gpu = resolve_auto_dtypes(
            load_config(PPOConfig, [], [*NEUTRAL, "resources.gpus_per_rank=1"])
        )
        assert (gpu.actor.precision.param_dtype, gpu.rollout.dtype) == ("bfloat16", "bfloat16")
    with pytest.raises(ConfigError, match=r"rollout.dtype='fp8'.*'auto'"):
        load_config(PPOConfig, [], [*NEUTRAL, "rollout.dtype=fp8"])


def test_a_server_key_never_reaches_the_run_folder():
    from tephra.controller.config.tree import PPOConfig
    from tephra.controller.launch.ppo import config_to_save

    cfg = load_config(
        PPOConfig,
        [],
        [*NEUTRAL, "rollout.vllm.api_key=s3cret", "rollout.sglang.api_key=auto"],
    )
    saved = config_to_save(cfg)
    assert saved["rollout"]["vllm"]["api_key"].startswith("<redacted")
    assert saved["rollout"]["sglang"]["api_key"] == "auto"
    assert "s3cret" not in json.dumps(saved) and cfg.rollout.vllm.api_key == "s3cret"
