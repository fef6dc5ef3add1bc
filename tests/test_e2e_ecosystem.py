"""Environments from the ecosystem, run unchanged: an OpenEnv environment (`openenv-core`'s
`Environment` served by its own `create_app`, reached over HTTP/WebSocket) gives the model's
turns their rewards, in process and through two GRPO steps of the PPO app, every sample's score
equal to what a fresh instance of the same environment class returns when it is stepped with
the same turns; bad settings and a missing package are refused when the config loads, before
Ray starts."""

from __future__ import annotations

import asyncio
import importlib.util
import socket
import sys
import threading
import time
from types import ModuleType

import pytest
from transformers import AutoTokenizer

from tephra.apps.ppo.main import parse_config, run
from tephra.controller.launch.testing import run_and_read
from tephra.controller.run.models import resolve_model_path
from tephra.core.errors import ConfigError
from tephra.episodes.agent import AgentLoopConfig, Prompt
from tephra.episodes.registry import EPISODES
from tephra.episodes.testing import model_turns as episode_turns
from tephra.rollout.base import SamplingParams
from tephra.rollout.testing import ScriptedRollout

pytest.importorskip("openenv")  # tephra-episodes[openenv], in the dev group

OPENENV_SERVER = '''
from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State


class Say(Action):
    message: str


class Heard(Observation):
    message: str = ""


class TwoTurns(Environment):
    """Turn 1 earns 0.25 per character of its length mod 3 and is asked again; turn 2 earns 1
    for an odd length, and ends."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        super().__init__()
        self._state = State(episode_id="", step_count=0)

    def reset(self, seed=None, episode_id=None, **kwargs):
        self._state = State(episode_id=episode_id or "", step_count=0)
        return Heard(message=kwargs.get("question", ""), reward=None, done=False)

    def step(self, action, timeout_s=None, **kwargs):
        self._state.step_count += 1
        n = len(action.message.strip())
        if self._state.step_count == 1:
            return Heard(message="Once more.", reward=0.25 * (n % 3), done=False)
        return Heard(reward=float(n % 2), done=True)

    @property
    def state(self):
        return self._state


app = create_app(TwoTurns, Say, Heard, env_name="two_turns", max_concurrent_envs=64)
'''


def own_score(server: ModuleType, turns: list[str], reset_kwargs: dict) -> float:
    """The environment's own scoring: a fresh `TwoTurns` (no server, no client) stepped with
    the same turns, its rewards summed until it is done."""
    env = server.TwoTurns()
    env.reset(**reset_kwargs)
    total = 0.0
    for text in turns:
        obs = env.step(server.Say(message=text))
        total += obs.reward or 0.0
        if obs.done:
            break
    return total


@pytest.fixture
def openenv_server(tmp_path):
    """The OpenEnv app served by uvicorn on a free loopback port (a thread of this process);
    yields (its URL, the server module)."""
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
    yield f"http://127.0.0.1:{port}", two_turns_server
    server.should_exit = True
    thread.join(timeout=10)
    sys.modules.pop("two_turns_server", None)


def test_an_openenv_session_gives_each_turn_its_reward(tmp_path, openenv_server):
    from tephra.rollout.testing import build_tiny_model

    url, server = openenv_server
    tok = AutoTokenizer.from_pretrained(build_tiny_model(tmp_path / "tiny").path)
    script = ["first", "odd", "never asked"]
    model = ScriptedRollout(tok, lambda s, k: script[k])
    cfg = AgentLoopConfig(
        environment="openenv",
        environment_kwargs={"url": url},
        max_turns=4,
        max_response_tokens=512,
    )
    loop = EPISODES.get("environment")(tok, cfg, {})
    item = Prompt(
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
    # the server's rewards: 0.25 * (5 % 3) for "first", 1.0 for the odd-length "odd"; done
    assert traj.extra_info["turn_rewards"] == [0.5, 1.0]
    assert (traj.finish_reason, traj.num_turns, traj.env_reward) == ("done", 2, 1.5)
    assert traj.env_reward == own_score(server, script[:2], {"question": "Why?"})


def test_an_unreachable_openenv_server_is_an_environment_error(tmp_path):
    """No server at the URL: with environment_errors=drop the trajectory ends with
    `environment_error` (dropped and counted by the trainer), its cause named."""
    from tephra.rollout.testing import build_tiny_model

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now
    tok = AutoTokenizer.from_pretrained(build_tiny_model(tmp_path / "tiny").path)
    cfg = AgentLoopConfig(
        environment="openenv",
        environment_kwargs={"url": f"http://127.0.0.1:{port}", "connect_timeout_s": 2},
        environment_errors="drop",
    )
    loop = EPISODES.get("environment")(tok, cfg, {})
    model = ScriptedRollout(tok, lambda s, k: "never asked")
    item = Prompt([{"role": "user", "content": "Hi."}], sample_id="oe-dead")
    traj = asyncio.run(loop.run(model, item, SamplingParams(temperature=1.0, max_tokens=8)))
    assert (traj.finish_reason, traj.num_turns, model.requests) == ("environment_error", 0, [])
    assert "raised in reset" in traj.extra_info["environment_error"]
    assert (
        f"ConnectionError: Failed to connect to ws://127.0.0.1:{port}/ws"
        in (traj.extra_info["environment_error"])
    )


def model_turns(row: dict, tok) -> list[str]:
    """The texts of a dumped sample's model turns (its runs of response-mask 1), as the
    environment episode sends them: decoded with special tokens, a final EOS left off."""
    runs = episode_turns(row["response_ids"], row["response_mask"])
    return [
        tok.decode(r[:-1] if r[-1] == tok.eos_token_id else r, skip_special_tokens=False)
        for r in runs
    ]


@pytest.mark.multiproc
def test_an_openenv_environment_trains_two_steps_through_the_app(
    tmp_path, openenv_server, grpo_step_reference
):

    url, server = openenv_server
    cfg = parse_config(
        [
            "-p",
            "smoke",
            "rollout.agent_loop=environment",
            "rollout.agent.environment=openenv",
            f"rollout.agent.environment_kwargs={{url: {url}}}",
            "rollout.agent.max_turns=3",
            "rollout.agent.max_response_tokens=96",
            "trainer.dump_generations=1",
            f"trainer.run_dir={tmp_path / 'run'}",
        ]
    )
    summary, trained = run_and_read(run, cfg)
    tok = AutoTokenizer.from_pretrained(resolve_model_path("tiny", cfg.trainer.seed))
    scores = set()
    for r, rows in trained:
        assert len(rows) == cfg.batch.samples_per_step
        for row in rows:  # the environment's own scoring of the same two turns
            turns = model_turns(row, tok)
            assert (row["finish_reason"], len(turns)) == ("done", 2)
            assert row["score"] == own_score(server, turns, {}), turns
            scores.add(row["score"])
        assert r["reward/mean"] == pytest.approx(sum(x["score"] for x in rows) / len(rows))
        assert r["agent/turns_mean"] == 2.0
        if r["step"] == 1:  # on-policy at the initial weights: recomputed in plain transformers,
            # GRPO on the scores, the loss and gradient over the model's turns (mask 1)
            want = grpo_step_reference(resolve_model_path("tiny", 0), rows)
            assert [x["advantage"] for x in rows] == pytest.approx(want["advantages"], abs=1e-5)
            assert r["actor/pg_loss"] == pytest.approx(want["pg_loss"], abs=1e-5)
            assert r["actor/grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4)
    assert len(scores) > 1  # the samples' scores differ: the check compares something


def test_openenv_config_errors_come_before_ray(monkeypatch):
    env = ["-p", "smoke", "rollout.agent_loop=environment", "rollout.agent.environment=openenv"]
    with pytest.raises(ConfigError, match=r"environment_kwargs.url='': .*http://127.0.0.1:8000"):
        parse_config(env)
    with pytest.raises(ConfigError, match=r"has \['port'\], which the `openenv` environment"):
        parse_config([*env, "rollout.agent.environment_kwargs={url: 'http://x:1', port: 2}"])
    # the package missing: the error names the extra to install
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "openenv" else real(n, *a)
    )
    with pytest.raises(
        ConfigError, match=r"install the extra: uv add 'tephra-episodes\[openenv\]'"
    ):
        parse_config([*env, "rollout.agent.environment_kwargs={url: 'http://x:1'}"])
