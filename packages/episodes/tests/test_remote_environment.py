"""The `remote` environment against a real environment server (`python -m
tephra.episodes.environments.serve` in a child process, or the same app in a thread where a
test needs it to start late): a trajectory through it equals the same environment's in
process, token for token; images cross as PNG, pixel for pixel; an unknown served name is
refused naming the ones served; a slow step hits the call's deadline once (not retried); a
server that refuses connections at first is reached by the retries; keys are checked; bad
settings are refused naming the field; the started server leaves nothing behind, even when
the process that started it is SIGKILLed."""

from __future__ import annotations

import asyncio
import contextlib
import json
import multiprocessing
import os
import re
import signal
import socket
import threading
import time
import zlib
from pathlib import Path

import httpx
import pytest
from transformers import AutoTokenizer

from tephra.core.errors import ConfigError
from tephra.episodes.agent import TOOL_CHAT_TEMPLATE, AgentLoopConfig
from tephra.episodes.config import EpisodeRolloutConfig
from tephra.episodes.environments.colour_squares import ColourSquaresEnvironment
from tephra.episodes.environments.remote import (
    EnvironmentServerProcess,
    RemoteEnvironment,
    RemoteEnvironmentError,
    check_remote_server,
)
from tephra.episodes.environments.serve import EnvironmentServer
from tephra.episodes.environments.serve import main as serve_main
from tephra.episodes.episode import run_episodes
from tephra.episodes.prompt import Prompt
from tephra.episodes.registry import EPISODES
from tephra.rollout.base import SamplingParams
from tephra.rollout.testing import ScriptedRollout

GREEDY = SamplingParams(temperature=0.0, max_tokens=64)

COUNTER_ENV = '''
import asyncio
import os
import re
from pathlib import Path

from tephra.episodes.environments import Environment, StepResult


class Counter(Environment):
    """`turns` turns, each rewarded `step_reward` per word; the first context names the
    item's `to`. With `marks`, each reset and step touches a file there named by the
    process, the sample and the call; `step_sleep_s` makes each step that slow."""

    async def reset(self, item):
        self.left, self.sid = self.kwargs["turns"], item.sample_id
        self.mark("reset")
        to = item.interaction_kwargs["to"]
        return [{"role": "system", "content": f"Count to {to}."}, *item.messages]

    def mark(self, what):
        if self.kwargs.get("marks"):
            Path(self.kwargs["marks"], f"{os.getpid()}-{self.sid}-{what}").touch()

    async def step(self, action):
        self.left -= 1
        self.mark(f"step{self.kwargs['turns'] - self.left}")
        await asyncio.sleep(self.kwargs.get("step_sleep_s", 0))
        reward = self.kwargs["step_reward"] * len(action.split())
        if self.left == 0:
            return StepResult(reward=reward, done=True, info={"finish_reason": "counted"})
        return StepResult([{"role": "user", "content": f"again, {self.left} left"}], reward)


def digest(inputs):
    """Each tensor of a prompt's images: its dtype, shape and the sha256 of its raw bytes."""
    import hashlib
    from dataclasses import fields

    import torch

    out = []
    for f in fields(inputs):
        t = getattr(inputs, f.name)
        if t is not None:
            raw = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            out.append(f"{f.name} {t.dtype} {list(t.shape)} {hashlib.sha256(raw).hexdigest()}")
    return "\\n".join(out)


class ImageEcho(Environment):
    """Says what it received of the prompt's images (their bytes' digests), and ends."""

    async def reset(self, item):
        return [{"role": "system", "content": digest(item.multimodal)}, *item.messages]

    async def step(self, action):
        return StepResult(reward=1.0, done=True)
'''

SCRIPTS = {
    "a": ["one", "one two", "one two three"],
    "b": ["two words", "x", "a b c d"],
    "c": ["uno", "dos tres", "cuatro"],
}


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    tok = AutoTokenizer.from_pretrained(tiny_model.path)
    tok.chat_template = TOOL_CHAT_TEMPLATE
    return tok


@pytest.fixture(scope="module")
def counter_spec(tmp_path_factory):
    path = tmp_path_factory.mktemp("env") / "counter_env.py"
    path.write_text(COUNTER_ENV)
    return f"{path}:Counter"


def refuses(url: str) -> bool:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    with socket.socket() as sock:
        return sock.connect_ex((host, int(port))) != 0


@pytest.fixture(scope="module")
def server(counter_spec):
    """One server in a child process for the module; stopped, it leaves nothing behind."""
    image_echo = counter_spec.replace(":Counter", ":ImageEcho")
    server = EnvironmentServerProcess([counter_spec, image_echo])
    yield server
    start = time.monotonic()
    server.stop()
    # it closed its sessions and exited on SIGTERM, without sitting through the interpreter's
    # tear-down of torch (4.5-7.6 s measured here) into the SIGKILL 5 s later
    assert server.proc.returncode == 0 and time.monotonic() - start < 3.0
    assert not server.folder.exists()  # its folder (log, ready file) removed
    assert refuses(server.url)  # nothing listens on its port


def items() -> list[Prompt]:
    return [
        Prompt(
            [{"role": "user", "content": f"Go {sid}."}],
            sample_id=sid,
            interaction_kwargs={"to": n, "ground_truth": "42"},
            origin=f"row {n} of train.parquet",
        )
        for n, sid in enumerate(SCRIPTS)
    ]


def run(tokenizer, cfg: AgentLoopConfig, script=None) -> list:
    model = ScriptedRollout(tokenizer, script or (lambda s, k: SCRIPTS[s][k]))
    loop = EPISODES.get("environment")(tokenizer, cfg)
    return asyncio.run(run_episodes(loop, model, items(), GREEDY))


def test_a_remote_trajectory_equals_the_in_process_one(tokenizer, server, counter_spec):
    kwargs = {"turns": 3, "step_reward": 0.5}
    local = run(
        tokenizer, AgentLoopConfig(max_turns=5, environment=counter_spec, environment_kwargs=kwargs)
    )
    remote = run(
        tokenizer,
        AgentLoopConfig(
            max_turns=5,
            environment="remote",
            environment_kwargs={"environment": counter_spec, "kwargs": kwargs, "url": server.url},
        ),
    )
    # hand sums: 0.5 per word of each turn
    assert [s.extra_info["turn_rewards"] for s in local] == [
        [0.5, 1.0, 1.5],
        [1.0, 0.5, 2.0],
        [0.5, 1.0, 0.5],
    ]
    assert [s.env_reward for s in local] == [3.0, 3.5, 2.0]
    assert [s.finish_reason for s in local] == ["counted"] * 3
    assert remote == local  # every field: ids, masks, log-probs, messages, rewards, extra_info
    # a registered environment too (the scripted user who knows the answer)
    cfg = AgentLoopConfig(max_turns=4, environment="answer_check")
    answers = {"a": ["41", "42"], "b": ["42"], "c": ["1", "2", "3", "4"]}
    local = run(tokenizer, cfg, lambda s, k: answers[s][k])
    remote_cfg = AgentLoopConfig(
        max_turns=4,
        environment="remote",
        environment_kwargs={"environment": "answer_check", "url": server.url},
    )
    assert run(tokenizer, remote_cfg, lambda s, k: answers[s][k]) == local
    assert [s.env_reward for s in local] == [1.0, 1.0, 0.0]


def test_images_cross_the_wire_pixel_for_pixel(server):
    item = Prompt([{"role": "user", "content": "<image>Colour?"}], sample_id="img")
    item.interaction_kwargs["ground_truth"] = "red"

    async def episode(env):
        first = await env.reset(item)
        steps = [await env.step("red"), await env.step("blue"), await env.step("green")]
        assert await env.tool_rewards() == {}
        await env.close()
        return first, steps

    kwargs = {"turns": 3, "seed": 7, "image_size": 32}
    local = asyncio.run(episode(ColourSquaresEnvironment(**kwargs)))
    env = RemoteEnvironment(environment="colour_squares", kwargs=kwargs, url=server.url)
    remote = asyncio.run(episode(env))
    # create, three steps, close: no call for tool rewards the environment does not have
    assert env.requests == 5
    assert remote[0] == local[0]
    for mine, theirs in zip(remote[1], local[1], strict=True):
        assert (mine.observation, mine.reward, mine.done, mine.info) == (
            theirs.observation,
            theirs.reward,
            theirs.done,
            theirs.info,
        )
        assert [(i.mode, i.size, i.tobytes()) for i in mine.images] == [
            (i.mode, i.size, i.tobytes()) for i in theirs.images
        ]
    assert sum(len(s.images) for s in local[1]) == 2  # a square after each answer but the last


def test_a_prompts_images_reach_the_served_environment_bit_for_bit(tmp_path, server, counter_spec):
    """The item's images (`Prompt.multimodal`, the tensors a real image processor made of a
    colour square) reach the served environment with the same dtype, shape and bytes as the
    in-process one's; bfloat16 pixels cross exactly too."""
    import random

    import torch

    from tephra.episodes.environments import wire
    from tephra.episodes.environments.colour_squares import colour_square
    from tephra.episodes.user_files import import_file
    from tephra.rollout.multimodal import VisionProcessor, build_tiny_vlm

    proc = VisionProcessor.from_pretrained(build_tiny_vlm(tmp_path / "vlm").path)
    _, image = colour_square(random.Random(3))
    ids, mm = proc(f"{proc.span_text(proc.image_token)}Colour?", [image])
    item = Prompt(
        [{"role": "user", "content": "<image>Colour?"}],
        sample_id="img-prompt",
        prompt_ids=ids,
        multimodal=mm,
    )
    module = import_file(Path(counter_spec.rsplit(":", 1)[0]), "tephra_test_echo_")

    async def first_context(env):
        try:
            return await env.reset(item)
        finally:
            await env.close()

    local = asyncio.run(first_context(module.ImageEcho()))
    echo = counter_spec.replace(":Counter", ":ImageEcho")
    remote = asyncio.run(first_context(RemoteEnvironment(environment=echo, url=server.url)))
    assert remote == local
    assert local[0]["content"] == module.digest(mm)
    assert "pixel_values torch.float32" in local[0]["content"] and mm.pixel_values.numel() > 0
    # every dtype crosses as its bytes: bfloat16 (no numpy type) and NaN included
    half = mm.pixel_values.to(torch.bfloat16)
    half[0, 0] = float("nan")
    back = wire.tensor_from_json(json.loads(wire.dumps({"t": wire.tensor_to_json(half)}))["t"])
    assert back.dtype == torch.bfloat16 and back.shape == half.shape
    assert torch.equal(back.view(torch.int16), half.view(torch.int16))


def test_an_unknown_served_name_is_refused_naming_the_served_ones(tokenizer, server):
    env = RemoteEnvironment(environment="nope", url=server.url)
    with pytest.raises(
        RemoteEnvironmentError,
        match=r"HTTP 404: unknown environment 'nope': this server serves \['answer_check', "
        r"'colour_squares', 'openenv', 'swe', 'tool', '.*counter_env.py:Counter', "
        r"'.*counter_env.py:ImageEcho'\]",
    ):
        asyncio.run(env.reset(items()[0]))
    assert env.requests == 1  # an answer, not a connection error: no retry
    # before any process starts: the run's probe of the server names the field
    with pytest.raises(ConfigError, match=r"environment_kwargs.environment='nope' .* serves"):
        check_remote_server({"environment": "nope", "url": server.url})
    check_remote_server({"environment": "answer_check", "url": server.url})
    # through the loop: one line naming the environment, the item and the turn
    cfg = AgentLoopConfig(
        environment="remote",
        environment_kwargs={"environment": "nope", "url": server.url},
        environment_errors="drop",
    )
    samples = run(tokenizer, cfg)
    assert [s.finish_reason for s in samples] == ["environment_error"] * 3
    assert all(s.dropped and sum(s.response_mask) == 0 for s in samples)
    assert (
        samples[1]
        .extra_info["environment_error"]
        .startswith(
            "environment 'remote' raised in reset at turn 0 of row 1 of train.parquet (sample 'b'): "
            "RemoteEnvironmentError: remote environment 'nope'"
        )
    )


def test_a_slow_step_hits_the_call_deadline_once(tokenizer, server, counter_spec, tmp_path):
    kwargs = {"turns": 2, "step_reward": 1.0, "marks": str(tmp_path), "step_sleep_s": 3.0}
    cfg = AgentLoopConfig(
        environment="remote",
        environment_kwargs={
            "environment": counter_spec,
            "kwargs": kwargs,
            "url": server.url,
            "request_timeout_s": 0.5,
        },
        environment_errors="drop",
    )
    start = time.monotonic()
    samples = run(tokenizer, cfg)
    assert time.monotonic() - start < 0.5 + 10.0  # not the 3 s sleep per retry
    assert [s.finish_reason for s in samples] == ["environment_error"] * 3
    assert "no answer within request_timeout_s=0.5 s" in samples[0].extra_info["environment_error"]
    assert sorted(p.name.split("-", 1)[1] for p in tmp_path.iterdir()) == sorted(
        f"{s}-{w}" for s in SCRIPTS for w in ("reset", "step1")
    )  # each step ran once on the server: a deadline is not retried


def test_every_call_can_be_repeated_safely(server, counter_spec, tmp_path):
    """What makes the retries safe, at the protocol's level: a repeated create is the same
    session (one reset), a repeated step answers the stored result (one step), a turn out of
    order is refused, a repeated close answers `closed: false`."""
    kwargs = {"turns": 2, "step_reward": 1.0, "marks": str(tmp_path)}
    create = {
        "session": "s1",
        "environment": counter_spec,
        "kwargs": kwargs,
        "item": {
            "messages": [{"role": "user", "content": "Go."}],
            "sample_id": "s1",
            "interaction_kwargs": {"to": 3},
        },
    }
    with httpx.Client(base_url=server.url) as http:
        first = http.post("/v1/sessions", json=create).json()
        assert http.post("/v1/sessions", json=create).json() == first
        assert first["observation"][0] == {"role": "system", "content": "Count to 3."}
        step = {"turn": 1, "action": "one two"}
        answer = http.post("/v1/sessions/s1/step", json=step).json()
        assert answer == http.post("/v1/sessions/s1/step", json=step).json()
        assert (answer["reward"], answer["done"]) == (2.0, False)
        late = http.post("/v1/sessions/s1/step", json={"turn": 3, "action": "x"})
        assert late.status_code == 409
        assert late.json()["error"] == "turn 3 out of order: the session has answered 1"
        last = http.post("/v1/sessions/s1/step", json={"turn": 2, "action": "x"}).json()
        assert (last["reward"], last["done"], last["info"]) == (
            1.0,
            True,
            {"finish_reason": "counted"},
        )
        assert http.delete("/v1/sessions/s1").json() == {"closed": True}
        assert http.delete("/v1/sessions/s1").json() == {"closed": False}
        gone = http.post("/v1/sessions/s1/step", json={"turn": 3, "action": "x"})
        assert gone.status_code == 404 and "unknown session 's1'" in gone.json()["error"]
    marks = sorted(p.name.split("-", 1)[1] for p in tmp_path.iterdir())
    assert marks == ["s1-reset", "s1-step1", "s1-step2"]  # each ran once


def serve_in_thread(
    port: int, api_key: str | None, started: threading.Event, stop: threading.Event
):
    async def main():
        server = EnvironmentServer(api_key=api_key)
        async with server.serving("127.0.0.1", port):
            started.set()
            while not stop.is_set():
                await asyncio.sleep(0.02)

    asyncio.run(main())


@contextlib.contextmanager
def late_server(port: int, after_s: float, api_key: str | None = None):
    started, stop = threading.Event(), threading.Event()

    def later():
        time.sleep(after_s)
        serve_in_thread(port, api_key, started, stop)

    thread = threading.Thread(target=later, daemon=True)
    thread.start()
    try:
        yield started
    finally:
        stop.set()
        thread.join(10)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_retries_reach_a_server_that_refuses_at_first(tokenizer):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    answers = {"a": ["42"], "b": ["41", "42"], "c": ["42"]}
    # 6 retries wait 0.1 * (1 + 2 + ... + 32) = 6.3 s in all; the server listens after 1 s
    with late_server(port, 1.0) as started:
        envs: list[RemoteEnvironment] = []

        class Counted(RemoteEnvironment):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                envs.append(self)

        loop = EPISODES.get("environment")(
            tokenizer,
            AgentLoopConfig(
                environment="remote",
                environment_kwargs={"environment": "answer_check", "url": url},
            ),
        )
        loop.make_environment = lambda: Counted(
            environment="answer_check", url=url, retries=6, retry_backoff_s=0.1
        )
        model = ScriptedRollout(tokenizer, lambda s, k: answers[s][k])
        samples = asyncio.run(run_episodes(loop, model, items(), GREEDY))
        assert started.is_set()
    assert [s.env_reward for s in samples] == [1.0, 1.0, 1.0]
    assert [s.finish_reason for s in samples] == ["done"] * 3
    # each session's create was refused at first and retried; then one request each
    # (a create, a step per turn, a close) and at least one refused attempt before them
    assert len(envs) == 3
    assert all(e.requests > 1 + len(answers[e.session[0]]) + 1 for e in envs)
    # the same server down for good: the retries give up, naming the cause and the count
    env = RemoteEnvironment(environment="answer_check", url=url, retries=2, retry_backoff_s=0.05)
    with pytest.raises(
        RemoteEnvironmentError,
        match=r"POST /v1/sessions: ConnectError \(.*\) after 3 attempt\(s\) over .* is the "
        r"server running\?",
    ):
        asyncio.run(env.reset(items()[0]))
    assert env.requests == 3


def test_keys_are_checked_and_required_beyond_loopback(capsys, monkeypatch):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with late_server(port, 0.0, api_key="sesame") as started:
        assert started.wait(30)
        item = items()[0]
        for key, error in ((None, "no key"), ("wrong", "wrong key")):
            env = RemoteEnvironment(environment="answer_check", url=url, api_key=key)
            with pytest.raises(RemoteEnvironmentError, match=f"HTTP 401: {error}"):
                asyncio.run(env.reset(item))
        env = RemoteEnvironment(environment="answer_check", url=url, api_key="sesame")

        async def reset_and_close():
            try:
                return await env.reset(item)
            finally:
                await env.close()

        assert asyncio.run(reset_and_close()) == item.messages
        assert httpx.get(f"{url}/health").json() == {"status": "ok"}  # no key needed
    monkeypatch.delenv("TEPHRA_ENVIRONMENT_SERVER_KEY", raising=False)
    assert serve_main(["--host", "0.0.0.0"]) == 2
    assert "--host 0.0.0.0 lets other machines open sessions; set a key" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"url": "http://x:1"}, r"environment_kwargs.environment=None: name the environment"),
        ({"environment": "remote"}, r"environment='remote': name the environment"),
        ({"environment": "answer_check", "prot": 1}, r"which the `remote` environment does not"),
        ({"environment": "nope"}, r"environment: .*'nope'.*answer_check.*the server the run"),
        ({"environment": "tool"}, r"environment='tool' needs rollout.tools_file"),
        ({"environment": "answer_check", "url": "ftp://h:1"}, r"'ftp://h:1' is not an http"),
        ({"environment": "answer_check", "url": "http://"}, r"url='http://': .* is not an http"),
        ({"environment": "answer_check", "url": "http://h:99999"}, r"is not an http"),
        ({"environment": "answer_check", "retries": -1}, r"retries=-1 .* must be >= 0"),
        ({"environment": "answer_check", "request_timeout_s": 0}, r"request_timeout_s=0 must"),
        ({"environment": "answer_check", "kwargs": [1]}, r"kwargs=\[1\] must be a mapping"),
    ],
)
def test_bad_settings_are_refused_when_the_config_loads(kwargs, error):
    with pytest.raises(ConfigError, match=error):
        EpisodeRolloutConfig(
            agent_loop="environment",
            agent=AgentLoopConfig(environment="remote", environment_kwargs=kwargs),
        )


def running(pid: int) -> bool:
    """Whether `pid` runs (a zombie waiting for its reaper does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _start_and_wait(queue) -> None:
    server = EnvironmentServerProcess()
    queue.put((server.pid, server.url, str(server.folder)))
    time.sleep(600)


def test_a_server_outlives_no_sigkilled_parent():
    """The process that started the server is SIGKILLed (no clean-up of its own runs): the
    server notices within a second or two, exits and removes its folder."""
    context = multiprocessing.get_context("fork")  # a fork: no second interpreter start-up
    queue = context.Queue()
    parent = context.Process(target=_start_and_wait, args=(queue,), daemon=True)
    parent.start()
    try:
        pid, url, folder = queue.get(timeout=120)
        assert httpx.get(f"{url}/health").status_code == 200
        os.kill(parent.pid, signal.SIGKILL)
        parent.join(10)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and running(pid):
            time.sleep(0.1)
        assert not running(pid), "the server outlived the process that started it"
        assert refuses(url)
        assert not Path(folder).exists()  # the server removed its folder on the way out
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(parent.pid, signal.SIGKILL)


def test_the_readme_example_runs(tokenizer, capsys):
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    start = text.index("## Remote environments")
    section = text[start : text.index("\n## ", start + 1)]
    (block,) = re.findall(r"```python\n(.*?)```", section, re.DOTALL)
    exec(compile(block, "README.md", "exec"), {"tok": tokenizer})  # noqa: S102 (our own docs)
    assert capsys.readouterr().out.splitlines()[-1] == "[0.0, 1.0] 1.0 done"


def test_an_environment_raising_in_tool_rewards_is_an_environment_error(tokenizer):
    """tool_rewards goes through the environment guard too (a server that dies after the last
    step fails there): the trajectory is dropped and counted, the others finish."""
    from tephra.episodes.environments import Environment, StepResult

    class Broken(Environment):
        async def step(self, action):
            return StepResult(reward=1.0, done=True)

        async def tool_rewards(self):
            raise ConnectionError("the server is gone")

    loop = EPISODES.get("environment")(tokenizer, AgentLoopConfig(environment_errors="drop"))
    loop.make_environment = lambda: Broken()
    (sample,) = asyncio.run(
        run_episodes(loop, ScriptedRollout(tokenizer, lambda s, k: "42"), items()[:1], GREEDY)
    )
    assert (sample.finish_reason, sample.dropped) == ("environment_error", True)
    assert sample.extra_info["environment_error"].startswith(
        "environment 'Broken' raised in tool_rewards at turn 1 of row 0 of train.parquet "
        "(sample 'a'): ConnectionError: the server is gone"
    )


def test_a_round_trip_does_not_wait_for_a_delayed_ack(server):
    """The server's sockets have TCP_NODELAY: without it every answer waited ~40 ms for the
    client's delayed ACK (measured 44-48 ms per call here, against 0.2-1 ms with it)."""
    with httpx.Client(base_url=server.url) as http:
        http.get("/health")
        times = []
        for _ in range(21):
            start = time.perf_counter()
            http.get("/health")
            times.append(time.perf_counter() - start)
    assert sorted(times)[10] < 0.02  # the median, with room for a loaded machine


def test_a_session_whose_server_is_down_opens_on_the_next(server):
    dead = f"http://127.0.0.1:{free_port()}"
    sid = next(f"s{i}" for i in range(100) if zlib.crc32(f"s{i}".encode()) % 2 == 0)
    env = RemoteEnvironment(
        environment="answer_check",
        url=f"{dead},{server.url}",  # the sample id picks the first, where nothing listens
        retries=1,
        retry_backoff_s=0.05,
    )
    item = Prompt([{"role": "user", "content": "?"}], sample_id=sid)
    item.interaction_kwargs["ground_truth"] = "42"

    async def episode():
        try:
            await env.reset(item)
            return await env.step("42")
        finally:
            await env.close()

    result = asyncio.run(episode())
    assert (result.reward, result.done, env.url) == (1.0, True, server.url)
    assert env.requests == 2 + 3  # two refused creates, then a create, a step, a close
    # one server only, and it is down: the creation fails naming it
    alone = RemoteEnvironment(environment="answer_check", url=dead, retries=0)
    with pytest.raises(RemoteEnvironmentError, match=f"at {dead}: POST /v1/sessions: Connect"):
        asyncio.run(alone.reset(item))
