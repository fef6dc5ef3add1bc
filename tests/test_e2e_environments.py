"""Environments in the PPO app: a user's environment (a file) with per-turn rewards trains two
GRPO steps through Ray, its rewards (not the reward scorer's) scored each sample, checked
against a hand computation from the dumped transcripts; verl's agentic parquet fields reach
the tool and the episode a row names; a hung tool ends its trajectory at the deadline and the
step finishes with the trajectory dropped from its group."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import threading
import time
import zlib
from dataclasses import replace

import httpx
import pytest
import torch

from tephra.apps.ppo.main import parse_config, run
from tephra.controller.data.prompts import DatasetError, load_parquet
from tephra.controller.launch.testing import run_and_read
from tephra.controller.run.models import resolve_model_path
from tephra.controller.samples import Prompt, agent_metrics, group_ids
from tephra.controller.workers.generation import run_items
from tephra.core.errors import ConfigError
from tephra.episodes.agent import TOOL_CHAT_TEMPLATE, AgentLoopConfig
from tephra.episodes.environments.remote import EnvironmentServerProcess
from tephra.episodes.episode import by_agent_name
from tephra.episodes.registry import EPISODES
from tephra.episodes.tools import Tool, ToolResult
from tephra.rollout.base import SamplingParams
from tephra.rollout.samples import Sample
from tephra.rollout.testing import ScriptedRollout

TWO_TURN_ENV = '''
from tephra.episodes.environments import Environment, StepResult


class TwoTurns(Environment):
    """Turn 1 earns 0.25 and the user asks again; turn 2 earns 1 when its text has an odd
    length, and ends the episode."""  # served by a remote environment server in the test

    async def step(self, action):
        if not hasattr(self, "asked"):
            self.asked = True
            return StepResult([{"role": "user", "content": "Once more."}], reward=0.25)
        return StepResult(reward=float(len(action.strip()) % 2), done=True)
'''


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from tephra.rollout.testing import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny"))


STUCK_ENV = """
import asyncio
from tephra.episodes.environments import Environment, StepResult


class SometimesStuck(Environment):
    \"\"\"Samples 0 and 1 of each prompt never answer; the others end with a parity reward.\"\"\"

    async def reset(self, item):
        self.stuck = item.sample_id.endswith(("-0", "-1"))
        return list(item.messages)

    async def step(self, action):
        if self.stuck:
            await asyncio.sleep(3600)
        return StepResult(reward=float(len(action.strip()) % 2), done=True)
"""

OPENAI_AGENT = """
from openai import AsyncOpenAI


async def agent(gateway, item):
    \"\"\"Two turns through the OpenAI client; reward 1 when the last reply has odd length.\"\"\"
    client = AsyncOpenAI(base_url=gateway.openai_base_url, api_key=gateway.api_key, max_retries=0)
    messages = list(item.messages)
    first = await client.chat.completions.create(model="policy", messages=messages)
    messages += [
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "user", "content": "Once more."},
    ]
    second = await client.chat.completions.create(model="policy", messages=messages)
    return float(len(second.choices[0].message.content.strip()) % 2)
"""

FAILING_REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    raise RuntimeError("the environment scores these samples; the scorer must not run")
"""


@pytest.mark.multiproc
def test_a_users_environment_with_per_turn_rewards_trains_two_steps(tmp_path, grpo_step_reference):

    env = tmp_path / "two_turns.py"
    env.write_text(TWO_TURN_ENV)
    reward = tmp_path / "reward.py"
    reward.write_text(FAILING_REWARD)
    cfg = parse_config(
        [
            "-p",
            "smoke",
            "rollout.agent_loop=environment",
            # served by an environment server the run starts (and stops), one session per
            # trajectory over HTTP
            "rollout.agent.environment=remote",
            f"rollout.agent.environment_kwargs={{environment: {env}:TwoTurns}}",
            "rollout.agent.max_turns=3",
            "rollout.agent.max_response_tokens=96",
            f"reward.custom_function_path={reward}",
            "trainer.dump_generations=1",
            f"trainer.run_dir={tmp_path / 'run'}",
        ]
    )
    summary, trained = run_and_read(run, cfg)
    for r, rows in trained:
        assert len(rows) == cfg.batch.samples_per_step
        for row in rows:  # the environment's rewards, summed over the two turns
            assert row["finish_reason"] == "done"
            assert row["score"] == 0.25 + len(row["answer"]) % 2
        assert r["reward/mean"] == pytest.approx(sum(x["score"] for x in rows) / len(rows))
        assert r["agent/turns_mean"] == 2.0 and r["agent/timeouts"] == 0.0
        assert r["agent/environment_errors"] == 0.0
        if r["step"] == 1:
            _check_first_step(grpo_step_reference, rows, r)
    # the server ran for the run and is gone with it: nothing listens at its URL
    log = (tmp_path / "run" / "environment_server.log").read_text()
    url = re.search(r"serving environments \[.*TwoTurns'\] at (http://\S+)", log).group(1)
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/health")


DOOMED_ENV = """
import asyncio
import os
import pathlib

from tephra.episodes.environments import Environment, StepResult

EVENTS = pathlib.Path({events!r})


class SlowStep(Environment):
    \"\"\"One turn, scored by its parity after 2 s; every reset and step leaves a file named by
    the serving process's pid (the test kills that process while steps sleep).\"\"\"

    async def reset(self, item):
        self.tag = f"{{os.getpid()}}-{{item.sample_id}}"
        (EVENTS / f"{{self.tag}}.reset").touch()
        return list(item.messages)

    async def step(self, action):
        (EVENTS / f"{{self.tag}}.step").touch()
        await asyncio.sleep(2.0)
        return StepResult(reward=float(len(action.strip()) % 2), done=True)
"""


@pytest.mark.multiproc
def test_a_run_started_environment_server_that_dies_is_restarted(tmp_path, capsys):
    """The server the run started is SIGKILLed while step 1's first trajectories sleep in
    their steps: exactly the trajectories whose sessions it held are dropped and counted; the
    run restarts it on the same URL (printing the dead server's log tail), the rest of step 1
    and all of step 2 run on the new server, and the restart is counted."""

    events = tmp_path / "events"
    events.mkdir()
    env = tmp_path / "slow_step.py"
    env.write_text(DOOMED_ENV.format(events=str(events)))
    cfg = parse_config(
        [
            "-p",
            "smoke",
            "rollout.agent_loop=environment",
            "rollout.agent.environment=remote",
            # retries long enough (0.25 * (2**7 - 1) = 32 s) for a restarted server's start:
            # the sessions opened while it restarts reach the new one
            f"rollout.agent.environment_kwargs={{environment: {env}:SlowStep, retries: 7}}",
            "rollout.agent.environment_errors=drop",
            "rollout.max_in_flight=2",  # a kill mid-step catches some, not all, of step 1
            "trainer.dump_generations=1",
            f"trainer.run_dir={tmp_path / 'run'}",
        ]
    )
    killed: dict[str, object] = {}

    def kill_in_first_steps() -> None:
        deadline = time.monotonic() + 600
        while not list(events.glob("*.step")) and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.3)  # the other trajectories in flight reach their (2 s) steps too
        pid = int(next(events.glob("*.step")).name.split("-")[0])
        os.kill(pid, signal.SIGKILL)
        killed["pid"] = pid

    killer = threading.Thread(target=kill_in_first_steps, daemon=True)
    killer.start()
    summary, trained = run_and_read(run, cfg)
    killer.join(timeout=5)
    dead = killed["pid"]
    # no session finished on the dead server (each step sleeps 2 s, the kill came 0.3 s after
    # the first step began): every session it opened was lost with it
    lost = {p.stem.split("-", 1)[1] for p in events.glob(f"{dead}-*.reset")}
    assert 1 <= len(lost) < cfg.batch.samples_per_step
    later = {p.name.split("-")[0] for p in events.glob("*.reset")} - {str(dead)}
    assert len(later) == 1  # one restarted server served every other session
    (new,) = later
    (first, _), (second, _) = trained
    assert first["agent/environment_errors"] == first["agent/dropped"] == len(lost)
    assert second["agent/environment_errors"] == second["agent/dropped"] == 0.0
    assert second["environment_server/restarts"] == 1.0
    for step, (_, rows) in zip((1, 2), trained):
        for row in rows:  # the dropped ones are the lost sessions; the others are scored
            if row["finish_reason"] == "environment_error":
                assert step == 1
            else:
                assert row["finish_reason"] == "done"
                assert row["score"] == float(len(row["answer"].strip()) % 2)
        if step == 1:
            assert sum(r["finish_reason"] == "environment_error" for r in rows) == len(lost)
    out = capsys.readouterr().out
    assert f"(pid {dead}) died with status -9; restarting it (1 of 3)" in out
    assert "serving environments" in out.split("restarting it (1 of 3)", 1)[1]  # the log tail
    assert f"(pid {new}, restarted)" in out


def _check_first_step(grpo_step_reference, rows, record) -> None:
    """Step 1 of a multi-turn GRPO run (on-policy, the initial weights), recomputed from its
    dumped trajectories in plain transformers: the advantages of the scores, and the loss and
    gradient norm over the model's tokens only (mask 1; the user's and tools' tokens are
    context)."""
    want = grpo_step_reference(resolve_model_path("tiny", 0), rows)
    assert [x["advantage"] for x in rows] == pytest.approx(want["advantages"], abs=1e-5)
    assert record["actor/pg_loss"] == pytest.approx(want["pg_loss"], abs=1e-5)
    assert record["actor/grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4)
    assert want["grad_norm"] > 1e-3  # some group's scores differed


@pytest.mark.multiproc
def test_an_openai_client_agent_trains_two_steps(tmp_path, grpo_step_reference):
    pytest.importorskip("openai")

    agent = tmp_path / "agent.py"
    agent.write_text(OPENAI_AGENT)
    reward = tmp_path / "reward.py"
    reward.write_text(FAILING_REWARD)
    cfg = parse_config(
        [
            "-p",
            "smoke",
            "rollout.agent_loop=openai_agent",
            f"rollout.agent.openai_agent={agent}:agent",
            "rollout.agent.max_response_tokens=96",
            f"reward.custom_function_path={reward}",
            "trainer.dump_generations=1",
            f"trainer.run_dir={tmp_path / 'run'}",
        ]
    )
    summary, trained = run_and_read(run, cfg)
    for r, rows in trained:
        for row in rows:  # the agent's reward, from the last served answer
            assert row["finish_reason"] in ("stop", "length")
            assert row["score"] == float(len(row["answer"]) % 2)
            # two served turns (mask 1) around the user's turn (mask 0)
            mask = row["response_mask"]
            runs = [m for k, m in enumerate(mask) if k == 0 or mask[k - 1] != m]
            assert runs == [1, 0, 1]
        assert r["agent/turns_mean"] == 2.0
        if r["step"] == 1:
            _check_first_step(grpo_step_reference, rows, r)


@pytest.mark.multiproc
def test_a_stuck_environment_cannot_hold_the_step(tmp_path):

    env = tmp_path / "stuck.py"
    env.write_text(STUCK_ENV)
    deadline = 20.0  # far above a 16-token turn of the tiny model, so only the stuck ones expire
    cfg = parse_config(
        [
            "-p",
            "smoke",
            "rollout.agent_loop=environment",
            f"rollout.agent.environment={env}:SometimesStuck",
            f"rollout.agent.turn_timeout_s={deadline}",
            "rollout.agent.timeout_reward=drop",
            "rollout.agent.max_response_tokens=64",
            "trainer.dump_generations=1",
            f"trainer.run_dir={tmp_path / 'run'}",
        ]
    )
    summary, trained = run_and_read(run, cfg)
    stuck = 2 * cfg.batch.prompts_per_step
    for r, rows in trained:
        assert (r["agent/timeouts"], r["agent/dropped"]) == (stuck, stuck)
        assert r["time/generate_s"] < deadline + 60.0  # an upper bound only: the deadline held
        reasons = sorted(row["finish_reason"] for row in rows)
        assert reasons == ["done"] * (len(rows) - stuck) + ["turn_timeout"] * stuck
        for row in rows:
            if row["finish_reason"] == "turn_timeout":  # dropped: trains nothing, advantage 0
                assert sum(row["response_mask"]) == 0 and row["advantage"] == 0.0


def test_rows_naming_an_agent_need_an_agent_loop(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tephra.controller.launch.ppo import load_records

    path = tmp_path / "rows.parquet"
    pq.write_table(pa.Table.from_pylist(verl_rows()), path)
    cfg = parse_config(["-p", "smoke", "data.source=parquet", f"data.train_files=[{path}]"])
    with pytest.raises(
        ConfigError, match="agent_name='tool_agent' but rollout.agent_loop is unset"
    ):
        load_records(cfg)
    cfg = parse_config(
        [
            "-p",
            "smoke",
            "data.source=parquet",
            f"data.train_files=[{path}]",
            "rollout.agent_loop=single_turn",
        ]
    )
    assert [r.agent_name for r in load_records(cfg)[0]] == ["tool_agent", "environment"]


def test_environment_config_errors_come_before_ray(tmp_path):
    with pytest.raises(ConfigError, match="rollout.agent.environment is empty"):
        parse_config(["-p", "smoke", "rollout.agent_loop=environment"])
    with pytest.raises(ConfigError, match="does not exist"):
        parse_config(
            ["-p", "smoke", "rollout.agent_loop=environment", "rollout.agent.environment=x.py:E"]
        )
    with pytest.raises(ConfigError, match=r"tools_file \(rollout.agent.environment='tool'\)"):
        parse_config(
            ["-p", "smoke", "rollout.agent_loop=environment", "rollout.agent.environment=tool"]
        )
    with pytest.raises(ConfigError, match="openai_agent='': give path/to/agent.py:function"):
        parse_config(["-p", "smoke", "rollout.agent_loop=openai_agent"])
    with pytest.raises(ConfigError, match="tool_call_format='xml' is not a registered"):
        parse_config(["-p", "smoke_tools", "rollout.agent.tool_call_format=xml"])
    remote = ["-p", "smoke", "rollout.agent_loop=environment", "rollout.agent.environment=remote"]
    with pytest.raises(ConfigError, match=r"environment_kwargs.environment=None: name the"):
        parse_config(remote)
    with pytest.raises(ConfigError, match=r"environment: .*'nope'.* \(the server the run starts"):
        parse_config([*remote, "rollout.agent.environment_kwargs={environment: nope}"])
    with pytest.raises(ConfigError, match=r"url='ftp://x:1': 'ftp://x:1' is not an http\(s\) URL"):
        parse_config(
            [*remote, "rollout.agent.environment_kwargs={environment: tool, url: 'ftp://x:1'}"]
        )
    with pytest.raises(ConfigError, match=r"environment_kwargs.max_restarts=-1 must be >= 0"):
        parse_config(
            [
                *remote,
                "rollout.agent.environment_kwargs={environment: answer_check, max_restarts: -1}",
            ]
        )


def test_a_remote_environment_server_that_is_down_stops_the_run_before_ray(tmp_path):
    import socket

    from tephra.controller.launch.ppo import prepare

    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        served = f"http://127.0.0.1:{sock.getsockname()[1]}"
    cfg = parse_config(
        [
            "-p",
            "smoke",
            "rollout.agent_loop=environment",
            "rollout.agent.environment=remote",
            f"rollout.agent.environment_kwargs={{environment: answer_check, url: '{served}'}}",
            f"trainer.run_dir={tmp_path}",
        ]
    )
    with pytest.raises(ConfigError, match=r"environment_kwargs.url=.*: nothing answers at "):
        prepare(cfg)


KILLABLE_ENV = """
import asyncio
import os
from pathlib import Path

from tephra.episodes.environments import Environment, StepResult


class TwoSlowTurns(Environment):
    \"\"\"Each step takes `sleep_s` and marks its start in `marks` (process and sample);
    turn 1 earns 0.25, turn 2 earns the parity of its text's length and ends.\"\"\"

    async def reset(self, item):
        self.sid, self.turn = item.sample_id, 0
        return list(item.messages)

    async def step(self, action):
        self.turn += 1
        Path(self.kwargs["marks"], f"{os.getpid()}-{self.sid}-step{self.turn}").touch()
        await asyncio.sleep(self.kwargs["sleep_s"])
        if self.turn == 1:
            return StepResult([{"role": "user", "content": "Once more."}], reward=0.25)
        return StepResult(reward=float(len(action.strip()) % 2), done=True)
"""


def test_a_server_killed_mid_step_drops_only_its_trajectories(tmp_path, tiny_model):
    """Two servers share the trajectories of a step (`url` names both); one is SIGKILLed
    while each of its trajectories is inside a step. Those, and only those, are dropped
    and counted in `agent/environment_errors` and `agent/dropped`; the others finish with
    their environment's rewards, and the step returns."""
    from transformers import AutoTokenizer

    spec = tmp_path / "slow_env.py"
    spec.write_text(KILLABLE_ENV)
    marks = tmp_path / "marks"
    marks.mkdir()
    ids = [f"p{i}-{k}" for i in range(4) for k in range(2)]
    with (
        EnvironmentServerProcess([f"{spec}:TwoSlowTurns"]) as doomed,
        EnvironmentServerProcess([f"{spec}:TwoSlowTurns"]) as spared,
    ):
        # a session stays on the server its sample id picks (crc32 modulo the servers)
        on_doomed = {s for s in ids if zlib.crc32(s.encode()) % 2 == 0}
        assert 0 < len(on_doomed) < len(ids)

        def kill_mid_step():
            deadline = time.monotonic() + 120
            wanted = {f"{doomed.pid}-{s}-step1" for s in on_doomed}
            while not wanted <= {p.name for p in marks.iterdir()}:
                if time.monotonic() > deadline:
                    return
                time.sleep(0.02)
            os.killpg(doomed.pid, signal.SIGKILL)  # every one of its trajectories mid-step

        killer = threading.Thread(target=kill_mid_step, daemon=True)
        killer.start()
        tok = AutoTokenizer.from_pretrained(tiny_model.path)
        tok.chat_template = TOOL_CHAT_TEMPLATE
        answers = {s: ["first", "odd" if s.endswith("0") else "even"] for s in ids}
        model = ScriptedRollout(tok, lambda s, k: answers[s][k])
        kwargs = {
            "environment": f"{spec}:TwoSlowTurns",
            "kwargs": {"marks": str(marks), "sleep_s": 1.0},
            "url": f"{doomed.url},{spared.url}",
            "retries": 2,
            "retry_backoff_s": 0.1,
        }
        episode = EPISODES.get("environment")(
            tok,
            AgentLoopConfig(
                environment="remote", environment_kwargs=kwargs, environment_errors="drop"
            ),
        )
        items = [
            Prompt(
                [{"role": "user", "content": "?"}], "gsm8k", "42", sample_id=s, prompt_ids=[1, 2]
            )
            for s in ids
        ]
        start = time.monotonic()
        samples = run_items(episode, model, items, SamplingParams(temperature=0.0, max_tokens=8))
        killer.join(1)
        elapsed = time.monotonic() - start
        assert doomed.proc.poll() == -signal.SIGKILL
    by_id = {s.sample_id: s for s in samples}
    for sid in on_doomed:
        sample = by_id[sid]
        assert (sample.finish_reason, sample.dropped, sample.env_reward) == (
            "environment_error",
            True,
            0.0,
        )
        assert sum(sample.response_mask) == 0
        error = sample.extra_info["environment_error"]
        assert f"at {doomed.url}: POST /v1/sessions/" in error and "step: " in error
        assert "after 3 attempt(s)" in error  # the retries found nobody listening
    for sid in set(ids) - on_doomed:
        sample = by_id[sid]
        assert (sample.finish_reason, sample.dropped) == ("done", False)
        assert sample.extra_info["turn_rewards"] == [0.25, float(len(answers[sid][1]) % 2)]
        assert sample.env_reward == 0.25 + len(answers[sid][1]) % 2
    metrics = agent_metrics(samples)
    assert metrics["agent/environment_errors"] == len(on_doomed)
    assert metrics["agent/dropped"] == len(on_doomed)
    assert elapsed < 2 * 1.0 + 30.0  # two slow turns, plus slack for a loaded machine
    # the killed server's trajectories reached step 1 only; the spared ones both steps
    done = {p.name for p in marks.iterdir()}
    assert {f"{spared.pid}-{s}-step2" for s in set(ids) - on_doomed} <= done
    assert not any(f"{doomed.pid}-{s}-step2" in done for s in on_doomed)


class Checker(Tool):
    """verl's gsm8k-style tool: its reward compares the submitted answer with the row's
    ground truth, given to `create` from the row's `tools_kwargs`."""

    name = "check"
    description = "Submit an answer."
    parameters = {"type": "object", "properties": {"answer": {"type": "string"}}}

    def __init__(self):
        self.truth, self.given = {}, {}

    async def create(self, instance_id, ground_truth=None):
        self.truth[instance_id] = ground_truth

    async def execute(self, instance_id, arguments):
        self.given[instance_id] = arguments.get("answer")
        return ToolResult("recorded")

    async def calc_reward(self, instance_id):
        return float(self.given.get(instance_id) == self.truth[instance_id])


def verl_rows() -> list[dict]:
    base = {"prompt": [{"role": "user", "content": "6 * 7?"}], "data_source": "gsm8k"}
    return [
        {
            **base,
            "reward_model": {"ground_truth": "42"},
            "extra_info": {
                "tools_kwargs": {
                    "check": {"create_kwargs": {"ground_truth": "42"}},
                },
                "interaction_kwargs": {"ground_truth": "42"},
            },
            "agent_name": "tool_agent",
        },
        {
            **base,
            "reward_model": {"ground_truth": "41"},
            "extra_info": {
                "tools_kwargs": {"check": {"create_kwargs": {"ground_truth": "41"}}},
                "interaction_kwargs": {"ground_truth": "41"},
            },
            "agent_name": "environment",
        },
    ]


def test_verl_agentic_parquet_fields_reach_the_tool_and_pick_the_episode(tmp_path, tiny_model):
    import pyarrow as pa
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    path = tmp_path / "agentic.parquet"
    pq.write_table(pa.Table.from_pylist(verl_rows()), path)
    records = load_parquet(path)
    assert records[0].tool_kwargs == {"check": {"ground_truth": "42"}}
    assert records[1].interaction_kwargs == {"ground_truth": "41"}
    assert [r.agent_name for r in records] == ["tool_agent", "environment"]

    tok = AutoTokenizer.from_pretrained(tiny_model.path)
    tok.chat_template = TOOL_CHAT_TEMPLATE
    tool = Checker()
    cfg = AgentLoopConfig(max_turns=3, environment="answer_check")
    call = '<tool_call>{"name": "check", "arguments": {"answer": "42"}}</tool_call>'
    script = {"r0": [call, "42"], "r1": ["It is 41."]}
    model = ScriptedRollout(tok, lambda s, k: script[s][k])
    episode = by_agent_name(
        "single_turn", lambda name: EPISODES.get(name)(tok, cfg, {"check": tool})
    )
    items = [replace(rec, prompt_ids=[1, 2, 3], sample_id=f"r{i}") for i, rec in enumerate(records)]
    r0, r1 = run_items(episode, model, items, SamplingParams(temperature=0.0, max_tokens=64))
    # row 0 ran the tool agent: the tool's reward read the row's ground truth
    assert r0.tool_rewards == {"check": 1.0} and r0.env_reward is None
    assert tool.truth == {"r0": "42"}
    # row 1 ran the answer_check environment with the row's interaction kwargs
    assert r1.env_reward == 1.0 and r1.finish_reason == "done"

    bad = verl_rows()[:1]
    bad[0]["extra_info"]["tools_kwargs"]["check"]["execute_kwargs"] = {"x": 1}
    pq.write_table(pa.Table.from_pylist(bad), path)
    with pytest.raises(DatasetError, match="tools_kwargs.check.*move them into 'create_kwargs'"):
        load_parquet(path)
    bad = verl_rows()[:1]
    bad[0]["agent_name"] = "nope"
    pq.write_table(pa.Table.from_pylist(bad), path)
    with pytest.raises(DatasetError, match="field 'agent_name' is 'nope'"):
        load_parquet(path)


def test_dropped_trajectory_leaves_its_group_and_is_counted():
    keep = Sample(prompt_ids=[1], response_ids=[5, 6], finish_reason="stop")
    cut = Sample(
        prompt_ids=[1],
        response_ids=[5],
        response_mask=[0],
        finish_reason="tool_timeout",
        dropped=True,
        env_reward=0.0,
    )
    samples = [keep, cut, keep, keep, keep, keep]
    assert group_ids(samples, 3).tolist() == [0, 3, 0, 1, 1, 1]
    from tephra.algos import compute_advantages
    from tephra.rollout.samples import to_batch

    batch = to_batch(samples, 0)
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 0.5])
    mask = batch["response_mask"]
    rewards = torch.zeros(mask.shape)
    last = mask.cumsum(-1).argmax(-1)
    rewards[torch.arange(6), last] = scores * (mask.sum(-1) > 0)
    adv, _ = compute_advantages(
        "grpo", token_rewards=rewards, response_mask=mask, group_ids=group_ids(samples, 3)
    )
    # group 0 is samples 0 and 2 only: scores 1 and 0 -> +-1/std (std of [1, 0] = 0.7071)
    per_sample = (adv * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    assert per_sample[0].item() == pytest.approx(1 / (2**0.5 / 2 + 1e-6) / 2, rel=1e-4)
    assert per_sample[1].item() == 0.0 and int(mask[1].sum()) == 0
    metrics = agent_metrics(samples)
    assert (metrics["agent/timeouts"], metrics["agent/dropped"]) == (1.0, 1.0)


@pytest.mark.parametrize("blocks_a_thread", [False, True])
def test_hung_tool_does_not_hold_the_step(tmp_path, tiny_model, blocks_a_thread):
    """A tool that never returns (awaiting, or blocking a thread Python cannot interrupt),
    through the worker's episode path (`run_items`): the trajectory ends at the deadline and
    the call returns without waiting for the thread."""
    import time

    from transformers import AutoTokenizer

    class Hang(Tool):
        name = "hang"
        description = "hang"
        parameters = {"type": "object", "properties": {}}

        async def execute(self, instance_id, arguments):
            if blocks_a_thread:
                await asyncio.to_thread(time.sleep, 30)
            await asyncio.sleep(3600)

    tok = AutoTokenizer.from_pretrained(tiny_model.path)
    tok.chat_template = TOOL_CHAT_TEMPLATE
    call = '<tool_call>{"name": "hang", "arguments": {}}</tool_call>'
    model = ScriptedRollout(tok, lambda s, k: call if s == "p0" else "42")
    episode = EPISODES.get("tool_agent")(
        tok, AgentLoopConfig(tool_timeout_s=0.5, timeout_reward="drop"), {"hang": Hang()}
    )
    items = [
        Prompt(
            [{"role": "user", "content": "?"}], "gsm8k", "42", sample_id=f"p{i}", prompt_ids=[1, 2]
        )
        for i in range(3)
    ]
    start = time.monotonic()
    samples = run_items(episode, model, items, SamplingParams(temperature=0.0, max_tokens=64))
    assert time.monotonic() - start < 0.5 + 15.0  # the deadline, plus slack; not the 30 s sleep
    assert [s.finish_reason for s in samples] == ["tool_timeout", "stop", "stop"]
    assert samples[0].dropped and sum(samples[0].response_mask) == 0
