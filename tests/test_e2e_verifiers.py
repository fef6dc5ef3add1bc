"""A `verifiers` (0.4) environment runs unchanged: single-turn (a plain taskset), multi-turn
(the taskset's own `vf.Env` answering the model once more) and tool (a `vf.Toolset` served over
MCP by verifiers) environments, each built in the test from the package's own classes, run
their own episode with the policy answering through the gateway; the trajectory's reward is
the environment's rubric (`@vf.reward`s, weighted) and equals the rubric's functions applied to
the same completions; two GRPO steps train through the PPO app; bad settings and a missing
package are refused when the config loads, before Ray starts."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest
from transformers import AutoTokenizer

from tephra.apps.ppo.main import parse_config, run
from tephra.controller.launch.testing import run_and_read
from tephra.controller.run.models import resolve_model_path
from tephra.core.errors import ConfigError
from tephra.episodes.agent import TOOL_CHAT_TEMPLATE, AgentLoopConfig, Prompt
from tephra.episodes.registry import EPISODES
from tephra.episodes.testing import model_turns
from tephra.rollout.base import SamplingParams
from tephra.rollout.testing import ScriptedRollout

pytest.importorskip("verifiers")  # tephra-episodes[verifiers], in the dev group

RUBRIC = '''
import verifiers.v1 as vf

WEIGHTS = (1.0, 0.5)


def odd_length(replies: list[str]) -> float:
    """1 when the last reply has an odd number of characters."""
    return float(len(replies[-1].strip()) % 2) if replies else 0.0


def says_answer(replies: list[str], answer: str) -> float:
    """1 when the answer appears in a reply."""
    return float(answer != "" and answer in " ".join(replies))


class QData(vf.TaskData):
    answer: str = ""


class QTask(vf.Task[QData]):
    @vf.reward(weight=WEIGHTS[0])
    async def odd(self, trace) -> float:
        return odd_length([m.content or "" for m in trace.assistant_messages])

    @vf.reward(weight=WEIGHTS[1])
    async def correct(self, task, trace) -> float:
        return says_answer([m.content or "" for m in trace.assistant_messages], task.answer)
{toolsets}

class QTaskset(vf.Taskset[QTask]):
    def load(self):
        yield QTask(QData(prompt="6 * 7?", answer="42"), self.config.task)
'''

KINDS = {
    "single": RUBRIC.format(toolsets="") + '\n__all__ = ["QTaskset"]\n',
    "multi": RUBRIC.format(toolsets="")
    + '''

class AskTwiceConfig(vf.EnvConfig):
    agent: vf.AgentConfig = vf.AgentConfig()


class AskTwice(vf.Env[AskTwiceConfig]):
    """The user asks once more after the first answer: two model turns."""

    async def run(self, task, agents):
        async with agents.agent.interaction(task) as chat:
            await chat.turn()
            await chat.turn("Once more.")


__all__ = ["QTaskset", "AskTwice"]
''',
    "tool": RUBRIC.format(
        toolsets="""
    @classmethod
    def toolsets(cls, config):
        return [Calc(vf.ToolsetConfig())]


class Calc(vf.Toolset[vf.ToolsetConfig]):
    @vf.tool
    async def multiply(self, a: int, b: int) -> int:
        \"\"\"Multiply two integers.\"\"\"
        return a * b
"""
    )
    + """
__all__ = ["QTaskset"]

if __name__ == "__main__":  # verifiers starts the tool server as `python -m <module>`
    Calc.run()
""",
}


def write_env(folder: Path, kind: str) -> Path:
    """The environment's file, named uniquely (verifiers imports it by its module name)."""
    path = folder / f"vf_{kind}_{folder.name.replace('-', '_')}.py"
    path.write_text(KINDS[kind])
    return path


def own_score(env_file: Path, replies: list[str], answer: str) -> float:
    """The rubric's weighted sum, from the environment file's own reward functions."""
    spec = importlib.util.spec_from_file_location(f"own_{env_file.stem}", env_file)
    assert spec is not None and spec.loader is not None
    mod = ModuleType(spec.name)
    spec.loader.exec_module(mod)
    w1, w2 = mod.WEIGHTS
    return w1 * mod.odd_length(replies) + w2 * mod.says_answer(replies, answer)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from tephra.rollout.testing import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny"))


CALL = '<tool_call>{"name": "calc_multiply", "arguments": {"a": 6, "b": 7}}</tool_call>'


@pytest.mark.parametrize(
    ("kind", "script", "roles", "tool_calls", "reward"),
    [
        # odd length 1.0 ("It is 42.": 9 characters) + 0.5 for saying 42
        ("single", ["It is 42."], ["user", "assistant"], 0, 1.5),
        # the last reply counts for the length: "Yes: 42" has 7
        ("multi", ["It is 42.", "Yes: 42"], ["user", "assistant", "user", "assistant"], 0, 1.5),
        # the tool ran (its result is the tool turn); "It is 42" has 8: 0.0 + 0.5
        ("tool", [CALL, "It is 42"], ["user", "assistant", "tool", "assistant"], 1, 0.5),
    ],
)
def test_a_verifiers_environment_runs_its_own_episode_through_the_gateway(
    tmp_path, tiny_model, kind, script, roles, tool_calls, reward
):
    tok = AutoTokenizer.from_pretrained(tiny_model.path)
    tok.chat_template = TOOL_CHAT_TEMPLATE
    env_file = write_env(tmp_path, kind)
    model = ScriptedRollout(tok, lambda s, k: script[k])
    cfg = AgentLoopConfig(verifiers_environment=str(env_file), max_response_tokens=512)
    loop = EPISODES.get("verifiers")(tok, cfg)
    item = Prompt(
        [{"role": "user", "content": "6 * 7?"}],
        sample_id=f"vf-{kind}",
        interaction_kwargs={"answer": "42"},
    )
    traj = asyncio.run(loop.run(model, item, SamplingParams(temperature=1.0, max_tokens=64)))
    assert traj.finish_reason == "stop", traj.extra_info.get("agent_error")
    assert [m["role"] for m in traj.messages] == roles
    assert (traj.num_turns, traj.tool_calls) == (len(script), tool_calls)
    replies = [m["content"] for m in traj.messages if m["role"] == "assistant"]
    assert replies == script
    if kind == "tool":  # verifiers' MCP server ran the tool: 6 * 7
        assert traj.messages[2]["content"] == "42"
    assert traj.env_reward == own_score(env_file, replies, "42") == reward
    # the trained model turns are the served tokens
    served = [gen.response_ids for _, _, gen in model.requests]
    assert model_turns(traj.response_ids, traj.response_mask) == served


@pytest.mark.multiproc
def test_a_verifiers_environment_trains_two_steps_through_the_app(tmp_path, grpo_step_reference):

    env_file = write_env(tmp_path, "multi")
    cfg = parse_config(
        [
            "-p",
            "smoke",
            "rollout.agent_loop=verifiers",
            f"rollout.agent.verifiers_environment={env_file}",
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
        for row in rows:  # the rubric's functions on the two served replies (no answer: 0.5 * 0)
            turns = [
                tok.decode(t[:-1] if t[-1] == tok.eos_token_id else t, skip_special_tokens=False)
                for t in model_turns(row["response_ids"], row["response_mask"])
            ]
            # the last turn ends or is cut by `rollout.max_tokens`: the rubric scores it either way
            assert row["finish_reason"] in ("stop", "length") and len(turns) == 2, row
            assert row["score"] == own_score(env_file, turns, ""), turns
            scores.add(row["score"])
        assert r["reward/mean"] == pytest.approx(sum(x["score"] for x in rows) / len(rows))
        assert r["agent/turns_mean"] == 2.0
        if r["step"] == 1:  # on-policy at the initial weights: recomputed in plain transformers
            want = grpo_step_reference(resolve_model_path("tiny", 0), rows)
            assert [x["advantage"] for x in rows] == pytest.approx(want["advantages"], abs=1e-5)
            assert r["actor/pg_loss"] == pytest.approx(want["pg_loss"], abs=1e-5)
            assert r["actor/grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4)
    assert len(scores) > 1  # the samples' scores differ: the check compares something


def test_verifiers_config_errors_come_before_ray(tmp_path, monkeypatch):
    def load(*args: str) -> None:
        parse_config(["-p", "smoke", "rollout.agent_loop=verifiers", *args])

    with pytest.raises(ConfigError, match="verifiers_environment is empty"):
        load()
    with pytest.raises(ConfigError, match="no installed module 'no_such_taskset'"):
        load("rollout.agent.verifiers_environment=no_such_taskset")
    with pytest.raises(ConfigError, match=r"nope\.py does not exist; give an existing \.py"):
        load(f"rollout.agent.verifiers_environment={tmp_path / 'nope.py'}")
    env_file = write_env(tmp_path, "single")
    with pytest.raises(ConfigError, match=r"verifiers refused it: .*harness 'no_such_harness'"):
        load(
            f"rollout.agent.verifiers_environment={env_file}",
            "rollout.agent.environment_kwargs={agent: {harness: {id: no_such_harness}}}",
        )
    empty = tmp_path / "vf_empty_taskset.py"
    empty.write_text("__all__ = []\n")
    with pytest.raises(ConfigError, match=r"verifiers refused it: .*exports no Taskset"):
        load(f"rollout.agent.verifiers_environment={empty}")
    with pytest.raises(ConfigError, match=r"not a registered agent loop|verifier"):
        parse_config(["-p", "smoke", "rollout.agent_loop=verifier"])
    # the package missing: the error names the extra to install
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "verifiers" else real(n, *a)
    )
    with pytest.raises(
        ConfigError, match=r"install the extra: uv add 'tephra-episodes\[verifiers\]'"
    ):
        load(f"rollout.agent.verifiers_environment={env_file}")
    assert str(tmp_path) in sys.path  # the file's folder: verifiers imports it by name
