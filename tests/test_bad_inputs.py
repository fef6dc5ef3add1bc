"""The bad-input campaign (issue #20): one table, one row per bad input. Each ends in ONE
clear tephra error whose message names the input, the field and the fix, or in a skip that
is counted and logged; never a stack trace from deep in a library, never silent data loss.

Every case calls the cheapest layer that shows the behaviour (the config loader, the data
loaders, the model-folder checks, the reward manager, the tools loader, the checkpoint
manager, one in-process engine); nothing starts Ray or vLLM.
"""

from __future__ import annotations

import asyncio
import errno
import http.server
import json
import logging
import re
import shutil
import socket
import sys
import textwrap
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tephra.core.errors import CheckpointError, ConfigError, RegistryError, TephraError


@dataclass
class Skipped:
    """What a case that skips returns: how many items were skipped and the text (log lines,
    tool errors) that reports them."""

    count: int
    text: str


@dataclass
class Case:
    id: str
    run: Callable[[Path, pytest.MonkeyPatch], Skipped | None]
    error: type[Exception] | str | None
    """The error class (or its name, for classes imported lazily) it raises; None: a skip."""
    says: tuple[str, ...]
    """Regexes the message (or the skip's report) must match: the input, field and fix."""
    skipped: int = 0


# ----- helpers ------------------------------------------------------------------------------
def _row(**fields: Any) -> dict[str, Any]:
    row = {
        "prompt": [{"role": "user", "content": "What is 1+1?"}],
        "data_source": "gsm8k",
        "reward_model": {"ground_truth": "2"},
    }
    row.update(fields)
    return {k: v for k, v in row.items() if v is not ...}


def _parquet(tmp: Path, *rows: dict[str, Any], name: str = "train.parquet") -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp / name
    pq.write_table(pa.Table.from_pylist(list(rows)), path)
    return path


def _load_parquet(*rows: dict[str, Any]) -> Callable:
    def run(tmp, mp):
        from tephra.controller.data.prompts import load_parquet

        load_parquet(_parquet(tmp, *rows))

    return run


def _tiny_copy(tmp: Path, *remove: str) -> Path:
    from tephra.controller.run.models import resolve_model_path

    folder = tmp / "model"
    shutil.copytree(resolve_model_path("tiny"), folder)
    for name in remove:
        (folder / name).unlink()
    return folder


def _parse(*overrides: str):
    from tephra.apps.ppo.main import parse_config

    return parse_config(["-p", "smoke", *overrides])


def unknown_preset(tmp, mp):
    from tephra.apps.ppo.main import parse_config

    parse_config(["-p", "smok"])


def _config(*overrides: str) -> Callable:
    return lambda tmp, mp: _parse(*overrides)


def _prepare(tmp: Path, rows: list[dict], *overrides: str) -> Any:
    from tephra.controller.launch.ppo import prepare

    data = _parquet(tmp, *rows)
    return prepare(
        _parse(
            "data.source=parquet",
            f"data.train_files=[{data}]",
            f"trainer.run_dir={tmp / 'run'}",
            *overrides,
        )
    )


def _score(tmp: Path, body: str, n: int = 2, **reward: Any) -> Skipped:
    """Score `n` responses with a custom reward file holding `body`; report its skips."""
    from tephra.controller.step.scoring import Scorer
    from tephra.episodes.prompt import Prompt
    from tephra.episodes.rewards import RewardConfig

    file = tmp / "reward.py"
    file.write_text(textwrap.dedent(body))
    scorer = Scorer(RewardConfig(custom_function_path=str(file), executor="serial", **reward))
    record = Prompt([{"role": "user", "content": "1+1?"}], "my_task", "2")
    results = scorer.score(["2"] * n, [record] * n)
    report = scorer.manager.last_report
    assert [r.score for r in results] == [0.0] * n  # a failed item scores 0, not NaN
    assert report.errors_by_source == {"my_task": report.num_errors}
    return Skipped(report.num_errors, "\n".join(r.error for r in results if r.error))


def _tools(content: str) -> Callable:
    def run(tmp, mp):
        from tephra.episodes.tools import load_tools

        path = tmp / "tools.yaml"
        path.write_text(content)
        load_tools(path)

    return run


# ----- cases that need more than one line ---------------------------------------------------
def jsonl_non_utf8(tmp, mp):
    from tephra.controller.data.prompts import load_hf_dataset

    path = tmp / "train.jsonl"
    path.write_bytes(
        b'{"prompt": "caf\xe9?", "data_source": "gsm8k", "reward_model": {"ground_truth": "1"}}\n'
    )
    load_hf_dataset(str(path))


def not_parquet(tmp, mp):
    from tephra.controller.data.prompts import load_parquet

    (tmp / "train.parquet").write_text("prompt,answer\n1+1,2\n")
    load_parquet(tmp / "train.parquet")


def no_rows(tmp, mp):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tephra.controller.data.prompts import load_parquet

    pq.write_table(pa.table({"prompt": pa.array([], pa.string())}), tmp / "empty.parquet")
    load_parquet(tmp / "empty.parquet")


def missing_data_file(tmp, mp):
    from tephra.controller.data.prompts import load_parquet

    load_parquet(tmp / "nowhere.parquet")


LONG = [{"role": "user", "content": "word " * 200}]


def long_prompt_dropped(tmp, mp):
    prepared = _prepare(tmp, [_row(), _row(prompt=LONG), _row()], "data.max_prompt_tokens=64")
    assert len(prepared.train.ids) == 2 and all(len(ids) <= 64 for ids in prepared.train.ids)
    return Skipped(3 - len(prepared.train.ids), "")  # the printed count is checked by `says`


def all_prompts_too_long(tmp, mp):
    _prepare(tmp, [_row(prompt=LONG)] * 2, "data.max_prompt_tokens=16")


def too_few_prompts(tmp, mp):
    from tephra.controller.data.prompts import PromptLoader

    PromptLoader(num_prompts=3, prompts_per_step=4, seed=0)


def unknown_data_source(tmp, mp):
    from tephra.controller.step.scoring import Scorer
    from tephra.episodes.prompt import Prompt

    Scorer().score(["2"], [Prompt([{"role": "user", "content": "?"}], "gsm9k", "2")])


def model_missing(tmp, mp):
    from tephra.controller.run.models import resolve_model_path

    resolve_model_path(str(tmp / "no-such-model"))


def model_without(*names: str) -> Callable:
    def run(tmp, mp):
        from tephra.controller.run.models import resolve_model_path

        resolve_model_path(str(_tiny_copy(tmp, *names)))

    return run


def tokenizer_without_chat_template(tmp, mp):
    from tephra.controller.run.models import load_tokenizer, resolve_model_path

    folder = _tiny_copy(tmp, "chat_template.jinja")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    load_tokenizer(resolve_model_path(str(folder)))


def reward(body: str, **reward_cfg: Any) -> Callable:
    return lambda tmp, mp: _score(tmp, body, **reward_cfg)


def reward_fails_everywhere(tmp, mp):
    from tephra.controller.step.scoring import check_not_all_failed

    skipped = _score(tmp, "def compute_score(**kw):\n    return {}['answer']\n")
    check_not_all_failed(skipped.text.splitlines())


def reward_file_without_function(tmp, mp):
    _score(
        tmp,
        "def score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n",
    )


def missing_tools_file(tmp, mp):
    from tephra.controller.launch.ppo import resolve_tools_file

    resolve_tools_file(str(tmp / "tools.yaml"))


MCP_SERVER = '''
import os
from mcp.server.mcpserver import MCPServer

server = MCPServer("fragile")

@server.tool()
def echo(text: str) -> str:
    """Echo the text."""
    return text

@server.tool()
def crash() -> str:
    """Kill the server."""
    os._exit(1)

if __name__ == "__main__":
    server.run("stdio")
'''


def mcp_server_dies(tmp, mp):
    from tephra.episodes.tools import MCPToolset

    (tmp / "server.py").write_text(MCP_SERVER)
    toolset = MCPToolset(command=sys.executable, args=[str(tmp / "server.py")], timeout_s=20)
    tools = {t.name: t for t in toolset.tools()}
    try:

        async def calls():
            first = await tools["echo"].execute("i", {"text": "hi"})
            # the server dies in a call; the call after it must fail fast, not hang
            died = await tools["crash"].execute("i", {})
            after = await asyncio.wait_for(tools["echo"].execute("i", {"text": "hi"}), 10)
            return first, died, after

        first, died, after = asyncio.run(calls())
    finally:
        toolset.close()
    assert first.text == "hi" and first.ok
    failed = [r for r in (died, after) if not r.ok]
    return Skipped(len(failed), "\n".join(r.error for r in failed))


def nan_loss(tmp, mp):
    """A NaN loss: the engine skips the optimizer step, counts it and keeps the weights."""
    import torch
    import torch.distributed as dist

    from tephra.engine_api.testing.batches import random_batch
    from tephra.engine_fsdp import FSDPEngine
    from tephra.engine_fsdp.testing import TINY_VOCAB, tiny_engine_config

    engine = FSDPEngine.build(tiny_engine_config())
    try:

        def nan_loss_fn(out, batch):
            return out["log_probs"].sum() * float("nan"), {}

        before = {
            n: p.detach().full_tensor().clone() if hasattr(p, "full_tensor") else p.detach().clone()
            for n, p in engine.scorer.named_parameters()
        }
        with engine.train_mode():
            engine.forward_backward(random_batch(TINY_VOCAB, 4, seed=0), nan_loss_fn)
            norm = engine.optimizer_step()
        after = {
            n: p.detach().full_tensor() if hasattr(p, "full_tensor") else p.detach()
            for n, p in engine.scorer.named_parameters()
        }
        assert norm != norm  # NaN
        assert all(torch.equal(before[n], after[n]) for n in before), "weights changed"
        return Skipped(engine.skipped_updates, "")
    finally:
        if engine.owns_process_group and dist.is_initialized():
            dist.destroy_process_group()


def disk_full_engine_write(tmp, mp):
    from tephra.controller.run.checkpoints import CheckpointManager

    def write(folder: Path) -> None:  # the workers' engine save, cut short by a full disk
        (folder / "actor").mkdir()
        (folder / "actor" / "model.bin").write_bytes(b"half")
        raise OSError(errno.ENOSPC, "No space left on device", str(folder / "actor"))

    CheckpointManager(tmp / "run" / "checkpoints").save(2, write, {})


def resume_from_not_a_checkpoint(tmp, mp):
    from tephra.controller.run.checkpoints import CheckpointManager

    (tmp / "step_3").mkdir()
    CheckpointManager(tmp / "checkpoints").resolve("auto", str(tmp / "step_3"))


def export_missing_checkpoint(tmp, mp):
    from tephra.controller.launch.export import export_checkpoint

    export_checkpoint(tmp / "checkpoints" / "step_9", tmp / "out")


def unreachable_ray(tmp, mp):
    import ray

    from tephra.controller.cluster.worker_group import ray_init

    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    try:
        ray_init(f"127.0.0.1:{port}")
    finally:
        assert not ray.is_initialized()


def malformed_ray_address(tmp, mp):
    from tephra.controller.cluster.worker_group import ray_init

    ray_init("headnode")


def _file(tmp: Path, name: str, text: str = "") -> Path:
    path = tmp / name
    path.write_text(textwrap.dedent(text))
    return path


def reward_file_missing_at_load(tmp, mp):
    _parse(f"reward.custom_function_path={tmp / 'nowhere.py'}")


def reward_signature_at_load(tmp, mp):
    reward = _file(tmp, "reward.py", "def compute_score(solution, answer):\n    return 1.0\n")
    _parse(f"reward.custom_function_path={reward}")


def reward_function_name_at_load(tmp, mp):
    reward = _file(
        tmp,
        "reward.py",
        "def score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n",
    )
    _parse(f"reward.custom_function_path={reward}")


def resume_must_without_checkpoint(tmp, mp):
    (tmp / "run" / "checkpoints" / "step_2.tmp").mkdir(parents=True)  # a save cut short
    _parse("trainer.resume=must", f"trainer.run_dir={tmp / 'run'}")


def resume_from_missing(tmp, mp):
    _parse(f"trainer.resume_from={tmp / 'run' / 'checkpoints' / 'step_4'}")


def resume_from_without_manifest(tmp, mp):
    (tmp / "step_4").mkdir()
    _parse(f"trainer.resume_from={tmp / 'step_4'}")


def run_dir_under_a_file(tmp, mp):
    _file(tmp, "results", "not a folder")
    _parse(f"trainer.run_dir={tmp / 'results' / 'ppo'}")


def ray_auto_without_cluster(tmp, mp):
    import ray
    import ray._private.services as services

    # no cluster on this machine, whatever other tests left running: ray.init("auto") finds
    # its address in RAY_ADDRESS, the last `ray start`'s file, or a running GCS process
    mp.delenv("RAY_ADDRESS", raising=False)
    mp.setattr(services, "find_bootstrap_address", lambda temp_dir: None)
    mp.setattr(services, "find_gcs_addresses", lambda: [])
    try:
        _parse("resources.ray_address=auto")
    finally:
        assert not ray.is_initialized()


def truncated_safetensors(tmp, mp):
    from tephra.controller.run.models import resolve_model_path

    folder = _tiny_copy(tmp)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    resolve_model_path(str(folder))


def kv_heads_model(tmp: Path, kv_heads: int) -> Path:
    """A model folder whose config.json has `kv_heads` key/value heads (3 as SmolLM2-135M);
    the check reads config.json alone."""
    folder = tmp / "model"
    folder.mkdir()
    (folder / "config.json").write_text(
        json.dumps(
            {
                "model_type": "llama",
                "vocab_size": 64,
                "hidden_size": 72,
                "intermediate_size": 96,
                "num_hidden_layers": 2,
                "num_attention_heads": 9 if kv_heads == 3 else 4,
                "num_key_value_heads": kv_heads,
            }
        )
    )
    return folder


def kv_heads_vs_tensor(kv_heads: int) -> Callable:
    def run(tmp, mp):
        cpu_compat = pytest.importorskip("tephra.engine_megatron.cpu_compat")
        # CPU ranks: where CUDA is visible megatron would refuse device=cpu first
        mp.setattr(cpu_compat, "cuda_absent", lambda: True)
        _parse(
            f"model.path={kv_heads_model(tmp, kv_heads)}",
            "actor.engine=megatron",
            "actor.parallel.tensor=2",
            "resources.world_size=2",
            "batch.prompts_per_step=2",
        )

    return run


def _step_round(scores: list[float], n: int = 2):
    """A step's round of one prompt group with these scores (what the trainer checks)."""
    from tephra.controller.samples import RewardResult, Sample
    from tephra.controller.step.rounds import Round
    from tephra.episodes.prompt import Prompt

    item = Prompt(
        [{"role": "user", "content": "1+1?"}],
        "my_task",
        "2",
        sample_id="train-0",
        prompt_ids=[1, 2],
    )
    samples = [Sample([1, 2], [3], [1], [0.0], "stop", reward=RewardResult(x)) for x in scores]
    return Round([item], samples, n, kept_groups=[0], indices=[17])


def absurd_reward(tmp, mp):
    from tephra.controller.step.scoring import Scorer, check_rewards
    from tephra.episodes.prompt import Prompt
    from tephra.episodes.rewards import RewardConfig

    file = _file(tmp, "reward.py", "def compute_score(**kw):\n    return 1e308\n")
    config = RewardConfig(custom_function_path=str(file), executor="serial")
    record = Prompt([{"role": "user", "content": "1+1?"}], "my_task", "2")
    scores = [r.score for r in Scorer(config).score(["2", "3"], [record] * 2)]
    assert scores == [1e308, 1e308]  # finite, so it passes the scorer's own check
    check_rewards(scores, _step_round(scores).kept_names(), config.max_abs)


def clipped_reward(tmp, mp):
    from tephra.controller.step.scoring import Scorer, check_rewards
    from tephra.episodes.prompt import Prompt
    from tephra.episodes.rewards import RewardConfig

    file = _file(
        tmp, "reward.py", "def compute_score(solution_str, **kw):\n    return float(solution_str)\n"
    )
    config = RewardConfig(custom_function_path=str(file), executor="serial", clip=(-1, 1))
    record = Prompt([{"role": "user", "content": "1+1?"}], "my_task", "2")
    scorer = Scorer(config)
    scores = [r.score for r in scorer.score(["1e308", "-1e308", "0.5"], [record] * 3)]
    assert scores == [1.0, -1.0, 0.5]
    check_rewards(scores, ["a", "b", "c"], config.max_abs)  # in range now: no error
    assert scorer.manager.last_report.as_metrics()["reward/clipped"] == 2.0
    return Skipped(scorer.manager.last_report.clipped, "")


def nan_advantages(tmp, mp):
    """Scores within a raised reward.max_abs that overflow float32: the advantages are NaN."""
    import torch

    from tephra.algos import AdvantageConfig, compute_advantages
    from tephra.controller.step.advantages import outcome_token_rewards
    from tephra.controller.step.scoring import check_advantages, check_rewards

    rnd = _step_round([1e308, -1e308])
    check_rewards(rnd.scores, rnd.kept_names(), max_abs=1e308)
    mask = torch.ones(2, 3)
    adv, _ = compute_advantages(
        "grpo",
        token_rewards=outcome_token_rewards(torch.tensor(rnd.scores, dtype=torch.float32), mask),
        response_mask=mask,
        group_ids=torch.zeros(2, dtype=torch.int64),
        values=None,
        config=AdvantageConfig(),
    )
    assert not torch.isfinite(adv).all()  # what every optimizer step then skipped on
    check_advantages(adv, mask, rnd.kept_names())


# ----- issue #59: the last slow or silent bad inputs ---------------------------------------
HANGS_ON_SOME = """
import threading

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str == "hang":
        threading.Event().wait()  # never set: the call never returns
    return 1.0
"""


def reward_step_deadline(tmp, mp):
    """Three hung samples with a per-sample limit of 20 s: one after another they would hold
    the batch 60 s; the batch's deadline (0.5 s) scores them as timeouts within about 0.5 s."""
    import time

    from tephra.controller.step.scoring import Scorer
    from tephra.episodes.prompt import Prompt
    from tephra.episodes.rewards import RewardConfig

    reward_file = _file(tmp, "reward.py", HANGS_ON_SOME)
    config = RewardConfig(
        custom_function_path=str(reward_file),
        executor="serial",
        timeout_s=20.0,
        step_timeout_s=0.5,
    )
    scorer = Scorer(config)
    record = Prompt([{"role": "user", "content": "1+1?"}], "my_task", "2")
    start = time.perf_counter()
    results = scorer.score(["2", "hang", "hang", "hang"], [record] * 4)
    elapsed = time.perf_counter() - start
    assert elapsed < 5.0, f"scoring took {elapsed:.1f} s, not bounded by the 0.5 s deadline"
    assert [r.score for r in results] == [1.0, 0.0, 0.0, 0.0]
    report = scorer.manager.last_report
    assert report.as_metrics()["reward/timeouts"] == 3.0 == report.num_errors
    return Skipped(report.num_timeouts, "\n".join(r.error for r in results if r.error))


def vocab_below_tokenizer(tmp, mp):
    folder = _tiny_copy(tmp)
    config = json.loads((folder / "config.json").read_text())
    config["vocab_size"] = 300  # the tiny tokenizer has 384 tokens
    (folder / "config.json").write_text(json.dumps(config))
    _prepare(tmp, [_row(), _row()], f"model.path={folder}")


def _free_port() -> int:
    with socket.socket() as probe:  # bound, never listening: connections are refused
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def unreachable_judge(tmp, mp):
    import ray

    from tephra.controller.run.models import resolve_model_path

    try:
        _prepare(
            tmp,
            [_row(), _row()],
            f"reward.judge.model_path={resolve_model_path('tiny')}",
            "reward.judge.backend=vllm",
            f"reward.judge.vllm.url=http://127.0.0.1:{_free_port()}",
        )
    finally:
        assert not ray.is_initialized()


ENV_FILE = """
from tephra.episodes.environments import Environment, StepResult


class Fragile(Environment):
    \"\"\"Answers `again` until turn `fail_at`, where it raises; or answers `size` characters.\"\"\"

    async def step(self, action):
        self.turn = getattr(self, "turn", 0) + 1
        if self.turn == self.kwargs.get("fail_at"):
            raise ValueError("the board has no square 'Z9'")
        if self.turn == 3:
            return StepResult(reward=1.0, done=True)
        return StepResult([{"role": "user", "content": "x" * self.kwargs.get("size", 5)}])
"""


def _episode(tmp: Path, **agent: Any):
    """The real environment loop (tiny tokenizer, a scripted model) over `Fragile`, on one
    item read from a parquet row (its origin names the row)."""
    import time

    from transformers import AutoTokenizer

    from tephra.controller.data.prompts import load_parquet
    from tephra.controller.run.models import resolve_model_path
    from tephra.episodes.agent import TOOL_CHAT_TEMPLATE, AgentLoopConfig, Prompt
    from tephra.episodes.registry import EPISODES
    from tephra.rollout.base import SamplingParams
    from tephra.rollout.testing import ScriptedRollout

    (tmp / "fragile_env.py").write_text(ENV_FILE)
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("tiny"))
    tokenizer.chat_template = TOOL_CHAT_TEMPLATE
    kwargs = agent.pop("kwargs")
    cfg = AgentLoopConfig(
        max_turns=4,
        max_response_tokens=4000,
        environment=f"{tmp / 'fragile_env.py'}:Fragile",
        environment_kwargs=kwargs,
        **agent,
    )
    record = load_parquet(_parquet(tmp, _row(), _row(), _row()))[2]
    item = Prompt(list(record.messages), sample_id="step0-2-0", origin=record.origin)
    model = ScriptedRollout(tokenizer, lambda s, k: "ok")
    start = time.perf_counter()
    sample = asyncio.run(
        EPISODES.get("environment")(tokenizer, cfg).run(
            model, item, SamplingParams(temperature=0.0, max_tokens=8)
        )
    )
    return sample, time.perf_counter() - start


def environment_raises(policy: str) -> Callable:
    def run(tmp, mp):
        from tephra.controller.samples import agent_metrics

        sample, _ = _episode(tmp, kwargs={"fail_at": 2}, environment_errors=policy)
        # only `drop` gets here: the trajectory trains nothing and is counted
        assert sample.dropped and not any(sample.response_mask) and sample.env_reward == 0.0
        metrics = agent_metrics([sample])
        assert metrics["agent/environment_errors"] == 1.0 == metrics["agent/dropped"]
        return Skipped(
            int(metrics["agent/environment_errors"]), sample.extra_info["environment_error"]
        )

    return run


def oversized_observation(policy: str) -> Callable:
    def run(tmp, mp):
        from tephra.controller.samples import agent_metrics

        # 10 MB per turn, as in the issue; with the limit it costs milliseconds, not minutes
        sample, elapsed = _episode(
            tmp,
            kwargs={"size": 10_000_000},
            max_observation_chars=1000,
            oversize_observation=policy,
            environment_errors="stop",
        )
        assert elapsed < 30, f"the episode took {elapsed:.0f} s"
        user_turns = [m["content"] for m in sample.messages if m["role"] == "user"][1:]
        assert [len(t.split("\n")[0]) for t in user_turns] == [1000, 1000]
        metrics = agent_metrics([sample])
        return Skipped(int(metrics["agent/observations_truncated"]), user_turns[0][1000:])

    return run


LOGGED = r"reward scoring: 2 of 2 items failed and scored 0.0 \(by data_source: \{'my_task': 2\}\)"
"""The manager's warning for a batch whose scorer failed (the first traceback is logged too)."""

CASES = [
    # --- data rows (verl parquet) and files
    Case(
        "parquet: row without prompt",
        _load_parquet(_row(), _row(prompt=None)),
        "DatasetError",
        (r"row 1 of train.parquet: field 'prompt' is missing", r"each row needs 'prompt'"),
    ),
    Case(
        "parquet: prompt of the wrong type",
        _load_parquet(_row(prompt=5)),
        "DatasetError",
        (r"row 0 .*field 'prompt' is 5, not a non-empty list of messages",),
    ),
    Case(
        "parquet: message that is a plain string",
        _load_parquet(_row(prompt=["hi", "there"])),
        "DatasetError",
        (r"field 'prompt' holds 'hi', not a \{role, content\} message",),
    ),
    Case(
        "parquet: content of the wrong type",
        _load_parquet(_row(prompt=[{"role": "user", "content": 7}])),
        "DatasetError",
        (r"field 'prompt.content' is 7, not text",),
    ),
    Case(
        "parquet: empty ground truth",
        _load_parquet(_row(reward_model={"ground_truth": " "})),
        "DatasetError",
        (r"field 'reward_model.ground_truth' is empty", r"reward_model.ground_truth"),
    ),
    Case(
        "parquet: no reward_model",
        _load_parquet(_row(reward_model=...), _row()),
        "DatasetError",
        (r"row 0 .*'reward_model.ground_truth' is missing",),
    ),
    Case(
        "parquet: data_source not a string",
        _load_parquet(_row(data_source=3)),
        "DatasetError",
        (r"field 'data_source' is 3, not a name",),
    ),
    Case(
        "parquet: non-UTF-8 bytes",
        _load_parquet(_row(prompt=[{"role": "user", "content": b"caf\xe9"}])),
        "DatasetError",
        (r"field 'prompt.content' holds bytes that are not UTF-8", r"re-encode the file as UTF-8"),
    ),
    Case(
        "jsonl: non-UTF-8 bytes",
        jsonl_non_utf8,
        "DatasetError",
        (
            r"row 0 of .*train.jsonl\[train\]: text that is not UTF-8",
            r"re-encode the file as UTF-8",
        ),
    ),
    Case(
        "parquet: extra_info not JSON",
        _load_parquet(_row(extra_info="{oops")),
        "DatasetError",
        (r"field 'extra_info' is a string but not JSON",),
    ),
    Case(
        "parquet: file that is not parquet",
        not_parquet,
        "DatasetError",
        (r"train.parquet cannot be read as parquet", r"set data.train_files to a parquet file"),
    ),
    Case(
        "parquet: file without rows",
        no_rows,
        "DatasetError",
        (r"empty.parquet has no rows", r"remove it from data.train_files"),
    ),
    Case(
        "parquet: file that does not exist",
        missing_data_file,
        "DatasetError",
        (r"nowhere.parquet does not exist", r"set data.train_files"),
    ),
    Case(
        "prompt longer than data.max_prompt_tokens",
        long_prompt_dropped,
        None,
        (r"dropped 1 prompts longer than data.max_prompt_tokens=64",),
        skipped=1,
    ),
    Case(
        "empty dataset after filtering",
        all_prompts_too_long,
        "DatasetError",
        (r"every one of 2 prompts is longer than data.max_prompt_tokens=16", r"raise it"),
    ),
    Case(
        "fewer prompts than a step needs",
        too_few_prompts,
        ConfigError,
        (r"3 prompts after filtering, fewer than batch.prompts_per_step=4", r"add data or lower"),
    ),
    Case(
        "unknown data_source",
        unknown_data_source,
        RegistryError,
        (r"reward data_source 'gsm9k'", r"did you mean 'gsm8k'", r"reward.custom_function_path"),
    ),
    # --- model folders
    Case(
        "model folder that does not exist",
        model_missing,
        ConfigError,
        (r"model.path=.*no-such-model.*does not exist", r"give a local Hugging Face folder"),
    ),
    Case(
        "model folder without config.json",
        model_without("config.json"),
        ConfigError,
        (r"model.path=.* has no config.json", r"save_pretrained"),
    ),
    Case(
        "model folder without weights",
        model_without("model.safetensors"),
        ConfigError,
        (r"model.path=.* has no weights", r"model.save_pretrained\(folder\)"),
    ),
    Case(
        "model folder without tokenizer",
        model_without("tokenizer.json"),
        ConfigError,
        (r"model.path=.* has no tokenizer", r"tokenizer.save_pretrained\(folder\)"),
    ),
    Case(
        "tokenizer without chat template",
        tokenizer_without_chat_template,
        ConfigError,
        (r"tokenizer of model.path=.* has no chat template", r"chat_template.jinja"),
    ),
    # --- reward functions
    Case(
        "reward function raises",
        reward("def compute_score(**kw):\n    raise ValueError('no answer key')\n"),
        None,
        (r"ValueError: no answer key", LOGGED),
        skipped=2,
    ),
    Case(
        "reward function returns NaN",
        reward("def compute_score(**kw):\n    return float('nan')\n"),
        None,
        (r"scorer 'custom' returned a non-finite score \(nan\)", r"return a finite number", LOGGED),
        skipped=2,
    ),
    Case(
        "reward function returns a string",
        reward("def compute_score(**kw):\n    return '1.0'\n"),
        None,
        (r"returned score='1.0' of type str", r"return a number", LOGGED),
        skipped=2,
    ),
    Case(
        "reward function hangs",
        reward("import time\ndef compute_score(**kw):\n    time.sleep(30)\n", timeout_s=0.2),
        None,
        (
            r"RewardTimeout: scorer 'custom' did not return within reward.timeout_s=0.2 s",
            r"raise reward.timeout_s",
            LOGGED,
        ),
        skipped=2,
    ),
    Case(
        "reward function fails on every sample",
        reward_fails_everywhere,
        "RewardFailure",
        (r"failed on all 2 samples", r"KeyError: 'answer'", r"reward.custom_function_path"),
    ),
    Case(
        "reward file without compute_score",
        reward_file_without_function,
        "RewardFunctionError",
        (
            r"reward.py has no function 'compute_score'; it defines: score",
            r"Set reward.custom_function_name",
        ),
    ),
    # --- tools and MCP
    Case(
        "tools YAML: unknown class",
        _tools("- class: pythn\n"),
        "ToolConfigError",
        (
            r"tools.yaml', entry 0: class 'pythn' is neither a registered tool",
            r"package.module:ClassName",
        ),
    ),
    Case(
        "tools YAML: class that does not import",
        _tools("- class: nowhere.mod:Tool\n"),
        "ToolConfigError",
        (r"entry 0: cannot import module 'nowhere.mod'",),
    ),
    Case(
        "tools YAML: not a list",
        _tools("tools: 3\n"),
        "ToolConfigError",
        (r"expected a list of \{class, config\} entries",),
    ),
    Case(
        "rollout.tools_file that does not exist",
        missing_tools_file,
        ConfigError,
        (r"rollout.tools_file=.*tools.yaml.*: no such file", r"bundled names \['python'\]"),
    ),
    Case(
        "MCP server that dies",
        mcp_server_dies,
        None,
        (
            r"mcp tool 'crash' failed: .*server: .*server.py",
            r"mcp tool 'echo' failed",
            r"see its log: server_log",
        ),
        skipped=2,
    ),
    # --- training and checkpoints
    Case(
        "NaN loss",
        nan_loss,
        None,
        (r"optimizer step skipped: gradient norm is nan", r"weights are unchanged"),
        skipped=1,
    ),
    Case(
        "disk full while writing a checkpoint",
        disk_full_engine_write,
        CheckpointError,
        (
            r"checkpoint of step 2 failed: the disk under .*run/checkpoints is full",
            r"No space left on device",
            r"lower trainer.keep_checkpoints, or set trainer.run_dir",
        ),
    ),
    Case(
        "resume_from a folder that is no checkpoint",
        resume_from_not_a_checkpoint,
        CheckpointError,
        (r"trainer.resume_from=.*step_3.*manifest.json is missing", r"give a step_<N> folder"),
    ),
    Case(
        "export of a checkpoint that does not exist",
        export_missing_checkpoint,
        CheckpointError,
        (r"step_9: no such folder", r"give a step_<N> folder"),
    ),
    # --- the config and the cluster
    Case(
        "unreachable ray_address",
        unreachable_ray,
        ConfigError,
        (
            r"resources.ray_address='127.0.0.1:\d+': nothing answers there",
            r"ray start --head",
            r"resources.ray_address=null",
        ),
    ),
    Case(
        "ray_address without a port",
        malformed_ray_address,
        ConfigError,
        (r"resources.ray_address='headnode': write host:port",),
    ),
    Case(
        "conflicting parallel sizes",
        _config(
            "resources.world_size=2",
            "actor.engine=megatron",
            "actor.parallel.tensor=2",
            "actor.parallel.pipeline=2",
            "batch.prompts_per_step=2",
        ),
        ConfigError,
        (r"world size 2 is not divisible by parallel.tensor \* parallel.pipeline",),
    ),
    Case(
        "override without '='",
        _config("trainer.steps"),
        ConfigError,
        (r"argument 'trainer.steps' is not an override; write key=value",),
    ),
    Case(
        "override with broken YAML",
        _config("trainer.trackers=[jsonl"),
        ConfigError,
        (
            r"override 'trainer.trackers=\[jsonl': the value is not valid YAML",
            r"close its brackets",
        ),
    ),
    Case(
        "unknown preset",
        unknown_preset,
        ConfigError,
        (r"preset 'smok' not found", r"known presets: .*'smoke'"),
    ),
    Case(
        "unknown tracker name",
        _config("trainer.trackers=[tensorbord]"),
        ConfigError,
        (
            r"trainer.trackers='tensorbord' is not a registered tracker \(did you mean 'tensorboard'\?\)",
        ),
    ),
    Case(
        "wrong rollout dtype",
        _config("rollout.dtype=float33"),
        ConfigError,
        (r"rollout.dtype='float33' is not allowed; choose one of \['float32'",),
    ),
    Case(
        "wrong engine dtype",
        _config("actor.precision.param_dtype=fp8"),
        ConfigError,
        (r"precision.param_dtype='fp8' is not allowed; choose one of",),
    ),
    Case(
        "negative prompts_per_step",
        _config("batch.prompts_per_step=-2"),
        ConfigError,
        (r"batch.prompts_per_step=-2 must be >= 1",),
    ),
    Case(
        "negative save_every",
        _config("trainer.save_every=-1"),
        ConfigError,
        (r"trainer.save_every=-1 must be >= 0",),
    ),
    Case(
        "zero num_cpus",
        _config("resources.num_cpus=0"),
        ConfigError,
        (r"resources.num_cpus=0 must be >= 1 \(or null: all\)",),
    ),
    Case(
        "negative temperature",
        _config("rollout.temperature=-0.5"),
        ConfigError,
        (r"rollout.temperature=-0.5 must be >= 0",),
    ),
    Case(
        "zero reward timeout",
        _config("reward.timeout_s=0"),
        ConfigError,
        (r"reward.timeout_s=0.* must be > 0",),
    ),
    # --- checked while the config loads, before Ray starts (issue #49)
    Case(
        "reward file that does not exist, at config load",
        reward_file_missing_at_load,
        ConfigError,
        (
            r"^reward.custom_function_path: custom reward file .*nowhere.py does not "
            r"exist; set reward.custom_function_path to an existing .py file$",
        ),
    ),
    Case(
        "reward function with the wrong signature, at config load",
        reward_signature_at_load,
        ConfigError,
        (
            r"^reward.custom_function_path: custom reward file .*reward.py: function "
            r"'compute_score'\(solution, answer\) does not fit",
            r"cannot take the keyword argument\(s\) data_source, solution_str, "
            r"ground_truth, extra_info",
            r"Expected e.g. def compute_score\(data_source, solution_str, ground_truth, "
            r"extra_info=None, \*\*kwargs\)",
        ),
    ),
    Case(
        "reward file without the function, at config load",
        reward_function_name_at_load,
        ConfigError,
        (
            r"reward.py has no function 'compute_score'; it defines: score",
            r"Set reward.custom_function_name",
        ),
    ),
    Case(
        "trainer.resume=must without a checkpoint",
        resume_must_without_checkpoint,
        ConfigError,
        (
            r"^trainer.resume=must but .*run/checkpoints holds no checkpoint; run once with "
            r"trainer.save_every or trainer.save_final set",
        ),
    ),
    Case(
        "trainer.resume_from that does not exist",
        resume_from_missing,
        ConfigError,
        (r"^trainer.resume_from='.*step_4': no such folder; give a step_<N> folder",),
    ),
    Case(
        "trainer.resume_from without a manifest",
        resume_from_without_manifest,
        ConfigError,
        (r"^trainer.resume_from='.*step_4': manifest.json is missing",),
    ),
    Case(
        "trainer.run_dir that cannot be created",
        run_dir_under_a_file,
        ConfigError,
        (
            r"^trainer.run_dir='.*results/ppo' cannot be created: .*results is a file, not a "
            r"folder; set trainer.run_dir to a folder you can write$",
        ),
    ),
    Case(
        "ray_address=auto with no cluster",
        ray_auto_without_cluster,
        ConfigError,
        (
            r"^resources.ray_address=auto but no Ray cluster runs on this machine; start one "
            r"\(`ray start --head`\)",
            r"or set resources.ray_address=null",
        ),
    ),
    Case(
        "truncated model.safetensors",
        truncated_safetensors,
        ConfigError,
        (
            r"model.path=.*model.safetensors has \d+ bytes, but its header says \d+ \(truncated\)",
            r"copy the file again",
        ),
    ),
    Case(
        "tensor=2 on a model with 3 kv heads",
        kv_heads_vs_tensor(3),
        ConfigError,
        (
            r"^actor.engine='megatron': the model's num_key_value_heads=3 is not divisible by "
            r"parallel.tensor=2 .*set parallel.tensor to one of \[1, 3\]$",
        ),
    ),
    Case(
        "tensor=2 on a model with 1 kv head",
        kv_heads_vs_tensor(1),
        ConfigError,
        (r"num_key_value_heads=1 is not divisible by parallel.tensor=2 .*one of \[1\]$",),
    ),
    # --- rewards and advantages out of range (issue #49)
    Case(
        "reward of 1e308",
        absurd_reward,
        "RewardRangeError",
        (
            r"^the reward of sample 0 of the step \(prompt 'train-0', dataset row 17, data_source "
            r"'my_task'\) is 1e\+308, beyond reward.max_abs=1e\+06; fix the reward function, or "
            r"set reward.clip=\[low,high\]",
        ),
    ),
    Case(
        "rewards clipped by reward.clip",
        clipped_reward,
        None,
        (r"reward scoring: 2 of 3 scores clipped into reward.clip=\[-1.0, 1.0\]",),
        skipped=2,
    ),
    Case(
        "advantages that are not finite",
        nan_advantages,
        "RewardRangeError",
        (
            r"^the advantage of sample 0 of the step \(prompt 'train-0', dataset row 17, "
            r"data_source 'my_task'\) is nan, and 2 of 2 samples have a non-finite advantage",
            r"set reward.clip=\[low,high\]",
        ),
    ),
    # --- issue #59: the last slow or silent bad inputs
    Case(
        "reward function that hangs on some samples: the batch's deadline",
        reward_step_deadline,
        None,
        (
            r"RewardTimeout: scorer 'custom' on data_source 'my_task': not scored before the "
            r"batch's deadline reward.step_timeout_s=0.5 s",
            r"raise reward.step_timeout_s \(null: no deadline for the batch\)",
        ),
        skipped=3,
    ),
    Case(
        "empty prompts",
        _load_parquet(
            _row(),
            _row(prompt=[{"role": "user", "content": "  "}]),
            _row(),
            _row(prompt=[{"role": "system", "content": ""}, {"role": "user", "content": "\n"}]),
        ),
        "DatasetError",
        (
            r"^2 of 4 prompts of .*train.parquet are empty \(no text in any message\): rows 1, 3; "
            r"give each row's 'prompt' a question, or remove those rows$",
        ),
    ),
    Case(
        "model vocab_size below the tokenizer's",
        vocab_below_tokenizer,
        ConfigError,
        (
            r"^model.path='.*model': config.json has vocab_size=300, below the tokenizer's 384 "
            r"tokens \(ids 300..383 have no embedding row\)",
            r"resize its embeddings \(model.resize_token_embeddings\(len\(tokenizer\)\), then "
            r"save_pretrained\) so that vocab_size >= 384$",
        ),
    ),
    Case(
        "unreachable judge URL",
        unreachable_judge,
        ConfigError,
        (
            r"^reward.judge.vllm.url='http://127.0.0.1:(\d+)': nothing answers at "
            r"http://127.0.0.1:\1 within 5 s \(ConnectionRefusedError: ",
            r"start the server there, correct the URL, or set reward.judge.vllm.url=null",
        ),
    ),
    Case(
        "environment raises in step (stop)",
        environment_raises("stop"),
        "EnvironmentFailure",
        (
            r"^environment '.*fragile_env.py:Fragile' raised in step at turn 2 of row 2 of "
            r"train.parquet \(sample 'step0-2-0'\): ValueError: the board has no square 'Z9'; "
            r"fix the environment, or set rollout.agent.environment_errors=drop",
        ),
    ),
    Case(
        "environment raises in step (drop)",
        environment_raises("drop"),
        None,
        (r"raised in step at turn 2 of row 2 of train.parquet .*ValueError: the board",),
        skipped=1,
    ),
    Case(
        "observation of 10 MB (truncate)",
        oversized_observation("truncate"),
        None,
        (r"\[observation truncated: 9999000 of 10000000 characters removed\]",),
        skipped=2,
    ),
    Case(
        "observation of 10 MB (refuse)",
        oversized_observation("refuse"),
        "EnvironmentFailure",
        (
            r"^environment '.*Fragile' returned an observation of 10000000 characters after turn "
            r"1 of row 2 of train.parquet \(sample 'step0-2-0'\), beyond "
            r"rollout.agent.max_observation_chars=1000; .* or set "
            r"rollout.agent.oversize_observation=truncate$",
        ),
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(case: Case, tmp_path, monkeypatch, caplog, capsys):
    caplog.set_level(logging.WARNING)
    if case.error is None:
        skipped = case.run(tmp_path, monkeypatch)
        assert skipped.count == case.skipped
        report = "\n".join([skipped.text, caplog.text, capsys.readouterr().out])
        for pattern in case.says:
            assert re.search(pattern, report), f"{pattern!r} not in the report:\n{report}"
        return
    with pytest.raises(TephraError) as info:
        case.run(tmp_path, monkeypatch)
    name = case.error if isinstance(case.error, str) else case.error.__name__
    assert type(info.value).__name__ == name, f"{type(info.value).__name__}: {info.value}"
    for pattern in case.says:
        assert re.search(pattern, str(info.value)), f"{pattern!r} not in: {info.value}"


def test_the_table_is_a_campaign():
    assert len(CASES) >= 30 and len({c.id for c in CASES}) == len(CASES)


def _ray_wrapped_enospc(folder: Path) -> OSError:
    """The error a Ray worker's full disk reaches the driver as: a RayTaskError that
    subclasses the cause's type, its errno not carried over."""
    from ray.exceptions import RayTaskError

    cause = OSError(errno.ENOSPC, "No space left on device", str(folder / "actor"))
    return RayTaskError("RLWorker.save_checkpoint", "Traceback ...", cause).as_instanceof_cause()


@pytest.mark.parametrize("where", ["driver manifest", "worker via Ray"])
def test_disk_full_leaves_the_previous_checkpoint_loadable(tmp_path, monkeypatch, where):
    from tephra.controller.run import checkpoints
    from tephra.controller.run.checkpoints import CheckpointManager

    manager = CheckpointManager(tmp_path / "run" / "checkpoints", keep_last=2)

    def engines(folder: Path) -> None:
        (folder / "actor").mkdir()
        (folder / "actor" / "model.bin").write_bytes(b"weights" * 100)

    manager.save(2, engines, {"loader": {"epoch": 0, "position": 2}})
    if where == "driver manifest":

        def full(folder):  # the disk fills up while the driver writes the manifest
            (folder / checkpoints.MANIFEST).write_text("{")
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(checkpoints, "write_manifest", full)
        write = engines
    else:

        def write(folder: Path) -> None:
            engines(folder)
            raise _ray_wrapped_enospc(folder)

    with pytest.raises(CheckpointError) as info:
        manager.save(4, write, {"loader": {"epoch": 0, "position": 4}})
    message = str(info.value)
    assert f"the disk under {manager.root} is full" in message
    assert "OSError: [Errno 28] No space left on device" in message
    assert "lower trainer.keep_checkpoints, or set trainer.run_dir to a bigger disk" in message
    assert f"the previous checkpoint ({manager.step_dir(2)}) is intact" in message
    # nothing torn is visible: no step_4, no step_4.tmp; step 2 resumes as before
    assert sorted(p.name for p in manager.root.iterdir()) == ["step_2"]
    assert manager.latest() == manager.step_dir(2) == manager.resolve("must")
    assert manager.load_trainer_state(manager.step_dir(2))["loader"]["position"] == 2
    # an error that is not a full disk is not dressed up as one
    monkeypatch.undo()
    with pytest.raises(PermissionError):
        manager.save(6, lambda folder: (_ for _ in ()).throw(PermissionError("read-only")), {})


NEVER_RETURNS = """
import threading

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    threading.Event().wait()  # never set: the call never returns
"""


def test_reward_that_never_returns_does_not_hang_training(tmp_path, caplog):
    """Issue #49: with no limit by default, one such call hung the run. The trainer's reward
    section now has a finite default limit; a late call scores 0.0 and is counted in
    `reward/timeouts` (the limit is lowered here only to keep the test fast)."""
    import dataclasses
    import math
    import threading

    from tephra.controller.step.scoring import Scorer
    from tephra.episodes.prompt import Prompt
    from tephra.episodes.rewards import RewardConfig, RewardResult

    reward = _file(tmp_path, "reward.py", NEVER_RETURNS)
    cfg = _parse(f"reward.custom_function_path={reward}")
    # the limit a user gets without setting one: finite, and the documented default
    assert math.isfinite(cfg.reward.timeout_s) and cfg.reward.timeout_s == 90.0
    assert RewardConfig().timeout_s == 90.0
    scorer = Scorer(dataclasses.replace(cfg.reward, timeout_s=0.2))
    record = Prompt([{"role": "user", "content": "1+1?"}], "my_task", "2")
    results: list = []
    worker = threading.Thread(
        target=lambda: results.extend(scorer.score(["2"] * 3, [record] * 3)), daemon=True
    )
    worker.start()
    worker.join(30)  # a generous bound: a hang, not a speed, is what this detects
    assert not worker.is_alive(), "scoring hung"
    assert [r.score for r in results] == [0.0, 0.0, 0.0]
    assert all(
        (r.error or "").startswith(
            "RewardTimeout: scorer 'custom' did not return within reward.timeout_s=0.2 s"
        )
        for r in results
    )
    report = scorer.manager.last_report
    assert report.timeouts_by_source == {"my_task": 3} == report.errors_by_source
    assert report.as_metrics()["reward/timeouts"] == 3.0
    # the trainer's step metric counts the same samples
    rnd = _step_round([0.0, 0.0, 1.0], n=3)
    for sample, reward in zip(rnd.samples, [*results[:2], RewardResult(1.0)], strict=True):
        sample.reward = reward
    assert (rnd.errors, rnd.timeouts) == (2, 2)


class CannedWorkers:
    """The worker group's side of a step, canned: every sample of the step gets the next of
    `outcomes` (score, scorer error, clipped); updates are counted, not run."""

    world_size = dp_size = 1

    def __init__(self, outcomes: list[tuple[float, str | None, bool]]) -> None:
        self.outcomes, self.updates, self.count = outcomes, 0, 0

    def generate(self, items, sampling):
        from tephra.controller.samples import Sample

        self.count = len(items) * sampling.n
        return [
            Sample([1, 2], [3, 4], [1, 1], [-0.5, -0.5], "stop", text="4", sample_id=item.sample_id)
            for item in items
            for _ in range(sampling.n)
        ]

    def collect_scores(self):
        from tephra.controller.samples import RewardResult, Scores

        return Scores(
            [
                RewardResult(s, error=e, clipped=c)
                for s, e, c in (self.outcomes[k % len(self.outcomes)] for k in range(self.count))
            ],
            0.0,
        )

    def update_actor(self, batch):
        self.updates += 1
        return {"pg_loss": 0.0}

    def call(self, method, *args):  # the trainer's DP-split calls go through `call`
        return getattr(self, method)(*args)

    def memory_stats(self):
        return [{"rss_gib": 1.0}]

    def sync_weights(self):
        pass


class CharTokenizer:
    eos_token_id = pad_token_id = 0


def _trainer(tmp_path, outcomes, *overrides):
    from tephra.controller.loop.trainer import Trainer
    from tephra.controller.run.flops import ModelShape
    from tephra.controller.step.rounds import Prompts
    from tephra.episodes.prompt import Prompt

    reward = _file(tmp_path, "reward.py", "def compute_score(**kw):\n    return 0.0\n")
    # no mismatch probe: these workers compute no log-probs (nothing here is about them)
    cfg = _parse(
        f"reward.custom_function_path={reward}",
        f"trainer.run_dir={tmp_path}",
        "algorithm.mismatch_probe_rows=0",
        *overrides,
    )
    train = Prompts(
        [[i] for i in range(8)],
        [Prompt([{"role": "user", "content": str(i)}], f"task{i}", "4") for i in range(8)],
    )
    wg = CannedWorkers(outcomes)
    shape = ModelShape(matmul_params=1, layers=1, attn_width=1)
    return Trainer(cfg, wg, CharTokenizer(), train, Prompts([], []), tmp_path, shape, 0.0), wg


def test_trainer_stops_on_an_absurd_reward_before_the_update(tmp_path):
    from tephra.controller.step.scoring import RewardRangeError

    # the step's 2 x 4 samples: the sixth (group 1, sample 1) scored 1e308
    trainer, wg = _trainer(
        tmp_path, [(0.0, None, False)] * 5 + [(1e308, None, False)] + [(1.0, None, False)] * 2
    )
    # the second prompt of step 0; its row's data_source is task<row> (built below)
    with pytest.raises(
        RewardRangeError,
        match=r"^the reward of sample 5 of the step \(prompt "
        r"'step0-1', dataset row (\d), data_source 'task\1'\) is 1e\+308, beyond "
        r"reward.max_abs=1e\+06",
    ):
        trainer.train_step()
    assert wg.updates == 0  # no update was made on it


def test_trainer_stops_on_non_finite_advantages_before_the_update(tmp_path):
    from tephra.controller.step.scoring import RewardRangeError

    # a raised max_abs lets 1e308 through; in float32 it is inf, and GRPO's mean is NaN
    trainer, wg = _trainer(
        tmp_path, [(1e308, None, False), (0.0, None, False)], "reward.max_abs=1e308"
    )
    with pytest.raises(
        RewardRangeError,
        match=r"^the advantage of sample 0 of the step "
        r"\(prompt 'step0-0', dataset row (\d), data_source 'task\1'\) is nan, and 8 of 8 "
        r"samples",
    ):
        trainer.train_step()
    assert wg.updates == 0


def test_trainer_counts_reward_timeouts_and_clipped_scores(tmp_path):
    late = "RewardTimeout: scorer 'custom' did not return within reward.timeout_s=90 s"
    trainer, wg = _trainer(
        tmp_path,
        [(0.0, late, False), (1.0, None, True), (0.0, None, False), (0.5, "ValueError: x", False)],
    )
    metrics = trainer.train_step()
    assert wg.updates == 1
    # 8 samples cycling through the 4 outcomes: 2 timeouts among 4 errors, 2 clipped
    assert (metrics["reward/errors"], metrics["reward/timeouts"], metrics["reward/clipped"]) == (
        4.0,
        2.0,
        2.0,
    )


def _raising(error: BaseException) -> Callable:
    def run(cfg):
        raise error

    return run


@pytest.mark.parametrize("app", ["ppo", "sft", "eval"])
def test_a_workers_tephra_error_is_one_line_of_the_app(app, monkeypatch, capsys):
    """Ray re-raises a worker's error in the driver as a RayTaskError whose text is the
    worker's traceback; the apps print the tephra error's own line (exit 2), whether Ray made
    the subclass of both or not, and leave other errors as they are."""
    import importlib

    from ray.exceptions import RayTaskError

    from tephra.episodes.agent.environment_guard import EnvironmentFailure

    main = importlib.import_module(f"tephra.apps.{app}.main")
    cause = EnvironmentFailure(
        "environment 'fragile' raised in step at turn 2 of row 2 of train.parquet (sample "
        "'step0-2-0'): ValueError: no square 'Z9'; fix the environment, or set "
        "rollout.agent.environment_errors=drop"
    )
    traceback = 'Traceback (most recent call last):\n  File "rl_worker.py", line 1\n' + str(cause)
    subclass = RayTaskError("RLWorker.generate", traceback, cause).as_instanceof_cause()
    assert isinstance(subclass, EnvironmentFailure) and "rl_worker.py" in str(subclass)
    plain = RayTaskError("RLWorker.generate", traceback, cause)  # no subclass of the cause
    for error in (subclass, plain):
        monkeypatch.setattr(main, "run", _raising(error))
        with pytest.raises(SystemExit) as info:
            main.main(["-p", "smoke"])
        assert info.value.code == 2
        assert capsys.readouterr().err == f"error: {cause}\n"
    other = RayTaskError("RLWorker.generate", traceback, ValueError("a bug")).as_instanceof_cause()
    monkeypatch.setattr(main, "run", _raising(other))
    with pytest.raises(ValueError) as raised:
        main.main(["-p", "smoke"])
    assert raised.value is other


class _Health(http.server.BaseHTTPRequestHandler):
    """A judge server's /health: 200 on /health, 404 elsewhere."""

    def do_GET(self):  # noqa: N802 (the stdlib's name)
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def health_server():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_the_judge_url_probe(health_server):
    """A running server passes the probe (also several, comma-separated); a port nothing
    listens on is refused at once; an address that never answers is refused within the
    probe's timeout, not the operating system's."""
    import time

    from tephra.controller.launch.server_probes import check_server_url, check_server_urls

    cfg = _parse(
        "reward.judge.model_path=" + str(_tiny_judge()),
        "reward.judge.backend=vllm",
        f"reward.judge.vllm.url={health_server},{health_server}/",
    )
    check_server_urls(cfg)  # answers: no error
    dead = f"http://127.0.0.1:{_free_port()}"
    with pytest.raises(ConfigError, match=r"^reward.judge.vllm.url=.*nothing answers at "):
        check_server_url("reward.judge.vllm.url", f"{health_server},{dead}")
    with socket.socket() as silent:  # listens, never accepts: a request waits for its timeout
        silent.bind(("127.0.0.1", 0))
        silent.listen(0)
        filler = socket.create_connection(silent.getsockname())  # fills the backlog
        try:
            start = time.perf_counter()
            with pytest.raises(ConfigError, match=r"within 0.5 s \((timeout|TimeoutError)"):
                check_server_url(
                    "rollout.vllm.url", f"http://127.0.0.1:{silent.getsockname()[1]}", 0.5
                )
            assert time.perf_counter() - start < 3
        finally:
            filler.close()
    with pytest.raises(ConfigError, match=r"'ftp://h:1' is not an http\(s\) URL"):
        check_server_url("reward.judge.vllm.url", "ftp://h:1")


def _tiny_judge() -> str:
    from tephra.controller.run.models import resolve_model_path

    return resolve_model_path("tiny")
