"""Environments from the ecosystem, run unchanged: a `verifiers` environment (single-turn,
multi-turn and tool environments, built in the test from the package's own classes) runs its
own rollout through the gateway with its rubric as the reward, and an OpenEnv environment
(`openenv-core`'s `Environment` served by its own `create_app`, reached over HTTP/WebSocket)
gives the model's turns their rewards; each trains two GRPO steps through the PPO app with
every sample's score equal to what the environment's own scoring gives its completion; bad
names and settings are refused when the config loads, before Ray starts."""

from __future__ import annotations

import asyncio
import json
import math
import socket
import sys
import threading
import time

import pytest
from transformers import AutoTokenizer

from tephra.apps.ppo.main import parse_config, run
from tephra.controller.run.trackers import read_jsonl
from tephra.core.errors import ConfigError
from tephra.episodes.agent import TOOL_CHAT_TEMPLATE, AgentLoopConfig, AgentPrompt
from tephra.episodes.registry import EPISODES
from tephra.episodes.user_files import import_file
from tephra.rollout.base import SamplingParams
from tephra.rollout.testing import ScriptedRollout

pytest.importorskip("verifiers")  # tephra-episodes[ecosystem], in the dev group
pytest.importorskip("openenv")

VERIFIERS_ENV = '''
import verifiers as vf
from datasets import Dataset


def odd_length(completion, **kwargs) -> float:
    """1 when the last assistant message has an odd number of characters."""
    last = [m for m in completion if m["role"] == "assistant"][-1]
    return float(len((last.get("content") or "").strip()) % 2)


def says_answer(completion, answer, **kwargs) -> float:
    """1 when the answer appears in an assistant message."""
    said = " ".join(m.get("content") or "" for m in completion if m["role"] == "assistant")
    return float(answer != "" and answer in said)


WEIGHTS = (1.0, 0.5)
DATA = Dataset.from_list([{"question": "6 * 7?", "answer": "42"}])


class AskTwice(vf.MultiTurnEnv):
    """The user asks once more after the first answer: two model turns."""

    async def env_response(self, messages, state, **kwargs):
        return [vf.UserMessage(content="Once more.")]


def multiply(a: int, b: int) -> int:
    """Multiply two integers."""
    return a * b


def load_environment(kind: str = "single"):
    rubric = vf.Rubric(funcs=[odd_length, says_answer], weights=list(WEIGHTS))
    if kind == "single":
        return vf.SingleTurnEnv(dataset=DATA, rubric=rubric)
    if kind == "multi":
        return AskTwice(dataset=DATA, rubric=rubric, max_turns=2)
    return vf.ToolEnv(dataset=DATA, rubric=rubric, tools=[multiply], max_turns=3)
'''

OPENENV_SERVER = '''
from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State


class Say(Action):
    message: str


class Heard(Observation):
    message: str = ""


class TwoTurns(Environment):
    """Turn 1 earns 0.25 and is asked again; turn 2 earns 1 for an odd length, and ends."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        super().__init__()
        self._state = State(episode_id="", step_count=0)

    def reset(self, seed=None, episode_id=None, **kwargs):
        self._state = State(episode_id=episode_id or "", step_count=0)
        return Heard(message=kwargs.get("question", ""), reward=None, done=False)

    def step(self, action, timeout_s=None, **kwargs):
        self._state.step_count += 1
        if self._state.step_count == 1:
            return Heard(message="Once more.", reward=0.25, done=False)
        return Heard(reward=float(len(action.message.strip()) % 2), done=True)

    @property
    def state(self):
        return self._state


app = create_app(TwoTurns, Say, Heard, env_name="two_turns", max_concurrent_envs=64)
'''


def own_score(env_file, completion: list[dict], answer: str) -> float:
    """The rubric's weighted sum, from the environment file's own reward functions."""
    mod = import_file(env_file, "tephra_test_vf_")
    w1, w2 = mod.WEIGHTS
    return w1 * mod.odd_length(completion) + w2 * mod.says_answer(completion, answer)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from tephra.rollout.testing import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture
def openenv_server(tmp_path):
    """The OpenEnv app served by uvicorn on a free loopback port (a thread of this process)."""
    import uvicorn

    (tmp_path / "two_turns_server.py").write_text(OPENENV_SERVER)
    sys.path.insert(0, str(tmp_path))
    try:
        import two_turns_server  # the file above
    finally:
        sys.path.remove(str(tmp_path))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    server = uvicorn.Server(
        uvicorn.Config(two_turns_server.app, host="127.0.0.1", port=port, log_level="critical")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.started
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)
    sys.modules.pop("two_turns_server", None)


CALL = '<tool_call>{"name": "multiply", "arguments": {"a": 6, "b": 7}}</tool_call>'


@pytest.mark.parametrize(
    ("kind", "script", "roles", "tool_calls"),
    [
        ("single", ["It is 42."], ["user", "assistant"], 0),
        ("multi", ["It is 42.", "Yes: 42"], ["user", "assistant", "user", "assistant"], 0),
        ("tool", [CALL, "It is 42"], ["user", "assistant", "tool", "assistant"], 1),
    ],
)
def test_a_verifiers_environment_runs_its_own_rollout_through_the_gateway(
    tmp_path, tiny_model, kind, script, roles, tool_calls
):
    tok = AutoTokenizer.from_pretrained(tiny_model.path)
    tok.chat_template = TOOL_CHAT_TEMPLATE
    env_file = tmp_path / "vf_env.py"
    env_file.write_text(VERIFIERS_ENV)
    model = ScriptedRollout(tok, lambda s, k: script[k])
    cfg = AgentLoopConfig(
        verifiers_environment=f"{env_file}:load_environment",
        environment_kwargs={"kind": kind},
        max_response_tokens=512,
    )
    loop = EPISODES.get("verifiers")(tok, cfg)
    item = AgentPrompt(
        [{"role": "user", "content": "6 * 7?"}],
        sample_id=f"vf-{kind}",
        interaction_kwargs={"answer": "42"},
    )
    traj = asyncio.run(loop.run(model, item, SamplingParams(temperature=1.0, max_tokens=64)))
    assert traj.finish_reason == "stop", traj.extra_info.get("agent_error")
    assert [m["role"] for m in traj.messages] == roles
    assert (traj.num_turns, traj.tool_calls) == (len(script), tool_calls)
    completion = traj.messages[1:]
    assert [m["content"] for m in completion if m["role"] == "assistant"] == script
    if kind == "tool":  # the environment ran the tool: its result is the tool turn
        assert completion[1]["content"] == "42"
    # the rubric's score for these completions: odd length 1.0 (9 chars) or 0 (7, 8), plus 0.5
    # for saying the answer
    assert traj.env_reward == own_score(env_file, completion, "42")
    assert traj.env_reward == {"single": 1.5, "multi": 1.5, "tool": 0.5}[kind]
    # the trained model turns are the served tokens
    served = [gen.response_ids for _, _, gen in model.requests]
    turns, run_ = [], False
    for t, m in zip(traj.response_ids, traj.response_mask):
        if m and not run_:
            turns.append([])
        if m:
            turns[-1].append(t)
        run_ = bool(m)
    assert turns == served


def test_an_openenv_session_gives_each_turn_its_reward(tmp_path, tiny_model, openenv_server):
    tok = AutoTokenizer.from_pretrained(tiny_model.path)
    script = ["first", "odd", "never asked"]
    model = ScriptedRollout(tok, lambda s, k: script[k])
    cfg = AgentLoopConfig(
        environment="openenv",
        environment_kwargs={"url": openenv_server},
        max_turns=4,
        max_response_tokens=512,
    )
    loop = EPISODES.get("environment")(tok, cfg, {})
    item = AgentPrompt(
        [{"role": "user", "content": "Say something."}],
        sample_id="oe-0",
        interaction_kwargs={"question": "Why?"},
    )
    traj = asyncio.run(loop.run(model, item, SamplingParams(temperature=1.0, max_tokens=64)))
    # reset's observation follows the prompt; the server's second observation is the next turn
    assert traj.messages == [
        {"role": "user", "content": "Say something."},
        {"role": "user", "content": "Why?"},
        {"role": "assistant", "content": "first"},
        {"role": "user", "content": "Once more."},
        {"role": "assistant", "content": "odd"},
    ]
    # the server's rewards: 0.25 for turn 1, 1.0 for the odd-length "odd"; done after turn 2
    assert (traj.finish_reason, traj.num_turns, traj.env_reward) == ("done", 2, 1.25)


def rows_of(run_dir, step: int) -> list[dict]:
    path = run_dir / "generations" / f"train_step{step}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.multiproc
def test_a_verifiers_environment_trains_two_steps_through_the_app(tmp_path):
    import ray

    from tephra.controller.cluster.worker_group import ray_init

    env_file = tmp_path / "vf_env.py"
    env_file.write_text(VERIFIERS_ENV)
    cfg = parse_config(
        [
            "-p",
            "smoke",
            "rollout.agent_loop=verifiers",
            f"rollout.agent.verifiers_environment={env_file}:load_environment",
            "rollout.agent.environment_kwargs={kind: multi}",
            "rollout.agent.max_response_tokens=96",
            "trainer.dump_generations=1",
            f"trainer.run_dir={tmp_path / 'run'}",
        ]
    )
    ray_init(num_cpus=2)
    try:
        summary = run(cfg)
    finally:
        ray.shutdown()
    assert summary["steps"] == 2
    train = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "reward/mean" in r]
    assert [r["step"] for r in train] == [1, 2]
    for step, r in zip((1, 2), train):
        rows = rows_of(tmp_path / "run", step)
        assert len(rows) == cfg.batch.samples_per_step
        for row in rows:  # the rubric's score of the served completion (no answer: 0.5 * 0)
            completion = [{"role": "assistant", "content": row["answer"]}]
            assert row["score"] == own_score(env_file, completion, ""), row["finish_reason"]
        assert r["reward/mean"] == pytest.approx(sum(x["score"] for x in rows) / len(rows))
        assert math.isfinite(r["actor/grad_norm"])


@pytest.mark.multiproc
def test_an_openenv_environment_trains_two_steps_through_the_app(tmp_path, openenv_server):
    import ray

    from tephra.controller.cluster.worker_group import ray_init

    cfg = parse_config(
        [
            "-p",
            "smoke",
            "rollout.agent_loop=environment",
            "rollout.agent.environment=openenv",
            f"rollout.agent.environment_kwargs={{url: {openenv_server}}}",
            "rollout.agent.max_turns=3",
            "rollout.agent.max_response_tokens=96",
            "trainer.dump_generations=1",
            f"trainer.run_dir={tmp_path / 'run'}",
        ]
    )
    ray_init(num_cpus=2)
    try:
        summary = run(cfg)
    finally:
        ray.shutdown()
    assert summary["steps"] == 2
    train = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "reward/mean" in r]
    assert [r["step"] for r in train] == [1, 2]
    for step, r in zip((1, 2), train):
        rows = rows_of(tmp_path / "run", step)
        assert len(rows) == cfg.batch.samples_per_step
        for row in rows:  # the server's rewards, summed over the two turns
            assert row["finish_reason"] == "done"
            assert row["score"] == 0.25 + len(row["answer"]) % 2
        assert r["reward/mean"] == pytest.approx(sum(x["score"] for x in rows) / len(rows))
        assert r["agent/turns_mean"] == 2.0 and math.isfinite(r["actor/grad_norm"])


def test_ecosystem_config_errors_come_before_ray(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="verifiers_environment is empty"):
        parse_config(["-p", "smoke", "rollout.agent_loop=verifiers"])
    with pytest.raises(ConfigError, match="no installed module 'no_such_env'"):
        parse_config(
            [
                "-p",
                "smoke",
                "rollout.agent_loop=verifiers",
                "rollout.agent.verifiers_environment=no_such_env",
            ]
        )
    env_file = tmp_path / "vf_env.py"
    env_file.write_text(VERIFIERS_ENV)
    with pytest.raises(ConfigError, match="defines no function 'load_env'"):
        parse_config(
            [
                "-p",
                "smoke",
                "rollout.agent_loop=verifiers",
                f"rollout.agent.verifiers_environment={env_file}:load_env",
            ]
        )
    with pytest.raises(ConfigError, match=r"not a registered agent loop|verifier"):
        parse_config(["-p", "smoke", "rollout.agent_loop=verifier"])
    with pytest.raises(ConfigError, match=r"environment_kwargs.url='': .*http://127.0.0.1:8000"):
        parse_config(
            ["-p", "smoke", "rollout.agent_loop=environment", "rollout.agent.environment=openenv"]
        )
    with pytest.raises(ConfigError, match=r"has \['port'\], which the `openenv` environment"):
        parse_config(
            [
                "-p",
                "smoke",
                "rollout.agent_loop=environment",
                "rollout.agent.environment=openenv",
                "rollout.agent.environment_kwargs={url: 'http://x:1', port: 2}",
            ]
        )
    # the package missing: the error names the extra to install
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda n, *a: None if n in ("verifiers", "openenv") else real(n, *a),
    )
    for args in (
        [
            "rollout.agent_loop=verifiers",
            f"rollout.agent.verifiers_environment={env_file}:load_environment",
        ],
        ["rollout.agent_loop=environment", "rollout.agent.environment=openenv"],
    ):
        with pytest.raises(
            ConfigError, match=r"install the extra: uv add 'tephra-episodes\[ecosystem\]'"
        ):
            parse_config(["-p", "smoke", *args])
