"""The `swe` environment: every shipped task fails as declared and passes with its reference
fix (both through the tools and the sandbox); an episode's reward is the hand-computed score
of the repository it leaves; the model's edits cannot leave its copy; copies are independent
and removed. The file runs a second time as uid 65534 when the suite runs as root."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import tempfile
import time
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from tephra.core.errors import ConfigError
from tephra.episodes.agent import TOOL_CHAT_TEMPLATE, AgentLoopConfig, Prompt
from tephra.episodes.config import EpisodeRolloutConfig
from tephra.episodes.environments.swe import TASKS, TRAIN, SweWorkspaces, get_task, score
from tephra.episodes.environments.swe.environment import EditFile, ReadFile, RunTests, WriteFile
from tephra.episodes.environments.swe.workspace import SweSettings
from tephra.episodes.registry import EPISODES
from tephra.episodes.testing import NOBODY, rerun_unprivileged
from tephra.episodes.tools.folder_tree import remove_tree
from tephra.rollout import SamplingParams
from tephra.rollout.testing import ScriptedRollout

UNPRIVILEGED_RUN = "TEPHRA_SWE_TESTS_UNPRIVILEGED"
_SHM = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
ROOT = tempfile.mkdtemp(prefix="tephra-swe-tests-", dir=_SHM)


@pytest.fixture(scope="module", autouse=True)
def _remove_root():
    """This module's copies and templates live under ROOT; it goes with the module."""
    yield
    remove_tree(ROOT)


def call(tool, instance: str, **arguments):
    return asyncio.run(tool.execute(instance, arguments))


def test_every_task_fails_as_declared_and_passes_with_its_reference_fix():
    assert len(TASKS) >= 30 and len({t.name for t in TASKS}) == len(TASKS)
    assert len({t.fix[0][1] for t in TASKS}) == len(TASKS)  # no fix twice
    assert TRAIN == 26
    ws = SweWorkspaces(SweSettings(workdir_root=ROOT))
    edit = EditFile(ws, set())

    async def one(task):
        await ws.create(task.name, task)
        before = await ws.run_tests(task.name)
        for path, old, new in task.fix:
            result = await edit.execute(task.name, {"path": path, "old": old, "new": new})
            assert result.ok, (task.name, result)
        after = await ws.run_tests(task.name)
        await ws.release(task.name)
        return before, after

    async def all_tasks():
        return await asyncio.gather(*(one(t) for t in TASKS))

    try:
        for task, (before, after) in zip(TASKS, asyncio.run(all_tasks())):
            assert set(task.test_ids) - before.passed == set(task.failing), (task.name, before)
            assert score(task, before.passed) == task.noop_score
            assert after.passed == set(task.test_ids), (task.name, after)
            assert score(task, after.passed) == 1.0
    finally:
        ws.close()


def _calls(*calls: tuple[str, dict]) -> list[str]:
    return [
        f"<tool_call>{json.dumps({'name': name, 'arguments': args})}</tool_call>"
        for name, args in calls
    ]


def test_an_episode_scores_the_repository_it_leaves(tiny_model):
    """Hand-computed rewards: clamp has 3 tests, 1 failing; truncate 3 tests, 2 failing
    (test_long, test_fits)."""
    tok = AutoTokenizer.from_pretrained(tiny_model.path)
    tok.chat_template = TOOL_CHAT_TEMPLATE
    clamp, truncate = get_task("clamp"), get_task("truncate")
    (path, old, new) = clamp.fix[0]
    fix_call = ("edit_file", {"path": path, "old": old, "new": new})
    broken = ("edit_file", {"path": path, "old": "    return x\n", "new": "    return None\n"})
    half = ("edit_file", {"path": "display.py", "old": ">= limit", "new": "> limit"})
    rest = ("edit_file", {"path": "display.py", "old": "text[:limit]", "new": "text[: limit - 3]"})
    scripts = {
        "fixed": _calls(fix_call, ("run_tests", {})) + ["Fixed."],
        "noop": ["I cannot fix it."],
        "regression": _calls(fix_call, broken) + ["Done."],
        "steps": _calls(("read_file", {"path": "display.py"}), half, rest) + ["Done."],
    }
    tasks = {"fixed": "clamp", "noop": "clamp", "regression": "clamp", "steps": "truncate"}
    model = ScriptedRollout(tok, lambda session, turn: scripts[session][turn])
    config = AgentLoopConfig(
        max_turns=5,
        max_response_tokens=2048,
        environment="swe",
        environment_kwargs={"workdir_root": ROOT},
    )
    episode = EPISODES.get("environment")(tok, config)

    async def run_all():
        items = [
            Prompt(
                [{"role": "user", "content": "Fix it."}],
                sample_id=name,
                interaction_kwargs={"task": tasks[name]},
            )
            for name in scripts
        ]
        sampling = SamplingParams(temperature=0.0, max_tokens=256)
        return await asyncio.gather(*(episode.run(model, i, sampling) for i in items))

    fixed, noop, regression, steps = asyncio.run(run_all())
    assert fixed.env_reward == 1.0 and fixed.extra_info["turn_rewards"] == [1.0, 0.0, 0.0]
    assert "3 of 3 tests pass" in fixed.messages[4]["content"]
    assert noop.env_reward == pytest.approx(2 / 3) and noop.finish_reason == "stop"
    assert regression.env_reward == 0.0  # the bug fixed, but test_inside broken
    assert regression.extra_info["turn_rewards"] == [1.0, -1.0, 0.0]
    # read (the untouched repository: 1 of 3), half the fix (2 of 3), the rest (3 of 3)
    assert steps.extra_info["turn_rewards"] == pytest.approx([1 / 3, 1 / 3, 1 / 3, 0.0])
    assert steps.env_reward == 1.0  # exactly: pass@k counts a score of 1
    # the turns' rewards are differences of scores; summed in order they end on 1.0 (and on
    # 0.0) exactly from any running sum in [0, 1] (between other scores only nearly)
    sums = {k / n for n in range(1, 11) for k in range(n + 1)} | {i / 997 for i in range(998)}
    assert all(x + (1.0 - x) == 1.0 and x + (0.0 - x) == 0.0 for x in sums)
    assert truncate.noop_score == pytest.approx(1 / 3)
    metrics = steps.extra_info["tool_metrics"]["swe"]
    assert metrics["test_runs"] == 3 and metrics["setup_s"] > 0  # the three scoring runs
    assert not [p for p in Path(ROOT).iterdir() if p.name.startswith("tephra-sandbox-")]


def test_model_edits_cannot_leave_the_trajectory_copy(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    victim = outside / "victim.txt"
    victim.write_text("host")
    ws = SweWorkspaces(SweSettings(workdir_root=ROOT))
    changed: set[str] = set()
    read, write, edit, tests = (c(ws, changed) for c in (ReadFile, WriteFile, EditFile, RunTests))
    task = get_task("clamp")
    try:
        asyncio.run(ws.create("t", task))
        workdir = Path(ws.copy_of("t").workdir)
        beside = workdir.parent / f"beside-{workdir.name}.py"  # a host file next to the copy
        beside.write_text("host")
        for path, why in [
            (f"../{beside.name}", "leaves the repository"),
            (f"a/../../{beside.name}", "leaves the repository"),
            (str(victim), "is absolute"),
            ("", "is missing"),
        ]:
            assert why in call(read, "t", path=path).error
            assert why in call(write, "t", path=path, content="pwned").error
        assert beside.read_text() == "host"
        beside.unlink()
        assert "read-only" in call(edit, "t", path="test_numeric.py", old="0", new="1").error
        assert "read-only" in call(write, "t", path="./test_numeric.py", content="").error
        # code the model wrote plants links to the host and a FIFO when the tests import it
        plant = (
            "import os\n"
            f"os.symlink({str(victim)!r}, 'leak.py')\n"
            f"os.symlink({str(outside)!r}, 'out')\n"
            "os.mkfifo('pipe.py')\n"
        )
        assert call(write, "t", path="numeric.py", content=task.files["numeric.py"] + plant).ok
        assert "2 of 3 tests pass" in call(tests, "t").text
        assert (workdir / "leak.py").is_symlink() and (workdir / "out").is_symlink()
        assert "is a link" in call(read, "t", path="leak.py").error
        assert "link" in call(read, "t", path="out/victim.txt").error
        assert "link" in call(write, "t", path="out/victim.txt", content="pwned").error
        assert "link" in call(edit, "t", path="leak.py", old="host", new="pwned").error
        start = time.perf_counter()
        assert "not a regular file" in call(read, "t", path="pipe.py").error
        assert time.perf_counter() - start < 5  # refused, not blocked on the FIFO
        # writing at a link's name replaces the link in the copy, never its target
        assert call(write, "t", path="leak.py", content="mine").ok
        assert not (workdir / "leak.py").is_symlink()
        assert (workdir / "leak.py").read_text() == "mine"
        assert victim.read_text() == "host" and sorted(os.listdir(outside)) == ["victim.txt"]
        listed = asyncio.run(ws.list_files("t"))
        assert listed == ["leak.py", "numeric.py", "out -> (link)", "pipe.py", "test_numeric.py"]
        # the tests are restored before each run: a run's code that rewrites them (to pass)
        # changes nothing for the next run
        passing = "".join(f"def test_{n}():\n    pass\n\n\n" for n in ("inside", "above", "below"))
        cheat = f"import os\nopen('test_numeric.py', 'w').write({passing!r})\n"
        assert call(write, "t", path="numeric.py", content=task.files["numeric.py"] + cheat).ok
        assert "2 of 3 tests pass" in call(tests, "t").text
        assert (workdir / "test_numeric.py").read_text() == passing  # the run rewrote it
        assert "2 of 3 tests pass" in call(tests, "t").text
        asyncio.run(ws.release("t"))
        assert not workdir.exists() and victim.read_text() == "host"
    finally:
        ws.close()


def test_copies_are_independent_made_once_and_removed():
    ws = SweWorkspaces(SweSettings(workdir_root=ROOT))
    changed: set[str] = set()
    read, edit = ReadFile(ws, changed), EditFile(ws, changed)
    task = get_task("clamp")
    path, old, new = task.fix[0]
    try:
        asyncio.run(ws.create("a", task))
        asyncio.run(ws.create("b", task))
        a, b = ws.copy_of("a"), ws.copy_of("b")
        assert a.workdir != b.workdir
        # as root each copy is a tmpfs of its own (files copied); else hard links to the
        # template, each broken by the first write
        expected_links = 0 if a.mounted else len(task.files)
        assert a.linked == b.linked == expected_links
        assert call(edit, "a", path=path, old=old, new=new).ok
        assert call(read, "a", path=path).text == task.files[path].replace(old, new)
        assert call(read, "b", path=path).text == task.files[path]
        template = Path(ws.template(task))
        assert (template / path).read_text() == task.files[path]
        assert asyncio.run(ws.run_tests("a")).passed == set(task.test_ids)
        assert asyncio.run(ws.run_tests("b")).passed == set(task.test_ids) - set(task.failing)
        asyncio.run(ws.release("a"))
        assert not os.path.exists(a.workdir) and os.path.exists(b.workdir)

        async def cancelled_create() -> None:  # a deadline during reset
            making = asyncio.ensure_future(ws.create("c", task))
            await asyncio.sleep(0.001)
            making.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await making
            await ws.release("c")

        before = set(os.listdir(ROOT))
        asyncio.run(cancelled_create())
        assert set(os.listdir(ROOT)) == before and "c" not in ws._copies
    finally:
        ws.close()
    assert not os.path.exists(b.workdir) and not template.exists()


def test_bad_settings_and_task_names_are_refused_naming_the_field():
    with pytest.raises(ConfigError, match=r"rollout.agent.environment_kwargs has \['tests'\]"):
        SweSettings.from_kwargs({"tests": 1})
    with pytest.raises(ConfigError, match=r"environment_kwargs.workspace='cow'"):
        SweSettings.from_kwargs({"workspace": "cow"})
    with pytest.raises(ConfigError, match=r"environment_kwargs.test_timeout_s=0"):
        SweSettings.from_kwargs({"test_timeout_s": 0})
    with pytest.raises(ConfigError, match=r"interaction_kwargs.task='clmap' is not a shipped"):
        get_task("clmap")
    with pytest.raises(ConfigError, match=r"environment_kwargs has \['nope'\]"):
        EpisodeRolloutConfig(
            agent_loop="environment",
            agent=AgentLoopConfig(environment="swe", environment_kwargs={"nope": 1}),
        )


@pytest.mark.skipif(
    os.geteuid() != 0 or os.environ.get(UNPRIVILEGED_RUN) == "1",
    reason="only a root test run can run the file again as another user",
)
def test_the_same_holds_for_an_unprivileged_user(tmp_path):
    """This file again as uid 65534 (`setpriv`), as the sandbox's own tests do: there the
    copies are plain folders of hard links that each test run copies in and out."""
    home = Path(tempfile.mkdtemp(prefix="tephra-home-"))
    os.chown(home, NOBODY, NOBODY)
    env = dict(os.environ, **{UNPRIVILEGED_RUN: "1"}, HF_HUB_OFFLINE="1")
    done = rerun_unprivileged(
        __file__, tmp_path, home, env, timeout_s=300, pytest_args="-k 'not an_episode'"
    )
    tail = done.stdout[-3000:] + done.stderr[-2000:]
    assert done.returncode == 0, tail
    passed = re.search(r"(\d+) passed", done.stdout)
    assert passed and int(passed.group(1)) == 4, tail
