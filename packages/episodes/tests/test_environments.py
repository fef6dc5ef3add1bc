"""Environments: a user's environment from a file with per-turn rewards (tokens checked
against the chat template's rendering, rewards against hand sums), verl-style scripted users,
and deadlines (a tool that never returns ends its trajectory at the deadline while the others
finish; zero and drop policies)."""

from __future__ import annotations

import asyncio
import time

import pytest
from transformers import AutoTokenizer

from tephra.core.errors import ConfigError
from tephra.episodes.agent import TOOL_CHAT_TEMPLATE, AgentLoopConfig, Prompt
from tephra.episodes.agent.environment_guard import EnvironmentFailure
from tephra.episodes.environments.registry import get_environment
from tephra.episodes.episode import run_episodes
from tephra.episodes.registry import EPISODES
from tephra.episodes.tools import Tool, ToolResult
from tephra.rollout.base import SamplingParams
from tephra.rollout.testing import ScriptedRollout

GREEDY = SamplingParams(temperature=0.0, max_tokens=64)

COUNTER_ENV = '''
from tephra.episodes.environments import Environment, StepResult


class Counter(Environment):
    """Rewards each turn with `step_reward`; the user says "again" until `turns` turns."""

    async def reset(self, item):
        self.left = self.kwargs["turns"]
        return [{"role": "system", "content": "Count."}, *item.messages]

    async def step(self, action):
        self.left -= 1
        reward = self.kwargs["step_reward"] * len(action.split())
        if self.left == 0:
            return StepResult(reward=reward, done=True)
        return StepResult([{"role": "user", "content": "again"}], reward=reward)
'''


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    tok = AutoTokenizer.from_pretrained(tiny_model.path)
    tok.chat_template = TOOL_CHAT_TEMPLATE
    return tok


def test_a_users_environment_from_a_file_owns_per_turn_rewards(tokenizer, tmp_path):
    path = tmp_path / "counter_env.py"
    path.write_text(COUNTER_ENV)
    cfg = AgentLoopConfig(
        max_turns=5,
        environment=f"{path}:Counter",
        environment_kwargs={"turns": 3, "step_reward": 0.5},
    )
    answers = ["one", "one two", "one two three"]
    model = ScriptedRollout(tokenizer, lambda s, k: answers[k])
    loop = EPISODES.get("environment")(tokenizer, cfg)
    item = Prompt([{"role": "user", "content": "Go."}], sample_id="c0", prompt_ids=[1, 2])
    traj = asyncio.run(loop.run(model, item, GREEDY))
    # per-turn rewards: 0.5 per word of each turn, summed into the sample's reward
    assert traj.extra_info["turn_rewards"] == [0.5, 1.0, 1.5]
    assert traj.env_reward == 3.0
    assert (traj.num_turns, traj.finish_reason) == (3, "done")
    # reset changed the messages, so the prompt is rendered from them (not the item's ids)
    assert traj.messages[0] == {"role": "system", "content": "Count."}
    decoded = tokenizer.decode(traj.prompt_ids + traj.response_ids, skip_special_tokens=False)
    assert tokenizer.apply_chat_template(traj.messages, tokenize=False) == decoded + "\n"
    gen_ids = [ids for _, _, g in model.requests for ids in g.response_ids]
    assert [t for t, m in zip(traj.response_ids, traj.response_mask) if m] == gen_ids


def test_answer_check_interaction_is_a_scripted_user(tokenizer):
    model = ScriptedRollout(tokenizer, lambda s, k: ["It is 41.", "Sorry: 42."][k])
    loop = EPISODES.get("environment")(
        tokenizer, AgentLoopConfig(max_turns=4, environment="answer_check")
    )
    item = Prompt(
        [{"role": "user", "content": "6 * 7?"}], interaction_kwargs={"ground_truth": "42"}
    )
    traj = asyncio.run(loop.run(model, item, GREEDY))
    assert traj.extra_info["turn_rewards"] == [0.0, 1.0] and traj.env_reward == 1.0
    assert [m["role"] for m in traj.messages] == ["user", "assistant", "user", "assistant"]
    assert traj.messages[2]["content"].startswith("That is not right")
    # reset's KeyError is one line naming the environment, the item and the turn
    with pytest.raises(
        EnvironmentFailure,
        match=r"^environment 'answer_check' raised in reset at turn 0 of sample '.*': "
        r"KeyError: .*interaction_kwargs\['ground_truth'\]",
    ):
        asyncio.run(loop.run(model, Prompt([{"role": "user", "content": "?"}]), GREEDY))


def test_bad_environment_specs_name_the_field(tmp_path):
    with pytest.raises(ConfigError, match="rollout.agent.environment is empty"):
        get_environment("")
    with pytest.raises(ConfigError, match="does not exist"):
        get_environment(f"{tmp_path}/none.py:Env")
    (tmp_path / "empty_env.py").write_text("X = 1\n")
    with pytest.raises(ConfigError, match="no Environment subclass 'Env'"):
        get_environment(f"{tmp_path}/empty_env.py:Env")
    with pytest.raises(Exception, match="environment 'nope'"):
        get_environment("nope")


class Sleeper(Tool):
    """`wait` sleeps forever; `echo` answers at once."""

    name = "wait"
    description = "wait"
    parameters = {"type": "object", "properties": {}}

    def __init__(self):
        self.released = []

    async def execute(self, instance_id, arguments):
        if arguments.get("forever"):
            await asyncio.sleep(3600)
        return ToolResult("done")

    async def release(self, instance_id):
        self.released.append(instance_id)


def call(forever: bool) -> str:
    return '<tool_call>{"name": "wait", "arguments": {"forever": %s}}</tool_call>' % (
        "true" if forever else "false"
    )


@pytest.mark.parametrize(
    ("deadline", "finish"),
    [("tool_timeout_s", "tool_timeout"), ("trajectory_timeout_s", "trajectory_timeout")],
)
def test_a_tool_that_never_returns_ends_its_trajectory_at_the_deadline(tokenizer, deadline, finish):
    script = {"hang": [call(True)], "ok0": [call(False), "42"], "ok1": ["42"]}
    model = ScriptedRollout(tokenizer, lambda s, k: script[s][k])
    tool = Sleeper()
    cfg = AgentLoopConfig(max_turns=3, **{deadline: 1.0})
    loop = EPISODES.get("tool_agent")(tokenizer, cfg, {"wait": tool})
    items = [Prompt([{"role": "user", "content": "?"}], sample_id=s) for s in script]
    start = time.monotonic()
    hang, ok0, ok1 = asyncio.run(run_episodes(loop, model, items, GREEDY))
    elapsed = time.monotonic() - start
    assert elapsed < 1.0 + 10.0  # bounded by the deadline (slack for a loaded machine)
    assert hang.finish_reason == finish and hang.env_reward == 0.0  # policy `zero`
    assert sum(hang.response_mask) == len(model.requests[0][2].response_ids)  # still trained
    assert (ok0.finish_reason, ok1.finish_reason) == ("stop", "stop")
    assert ok0.env_reward is None  # the scorer judges the tool agent's answer
    assert sorted(tool.released) == ["hang", "ok0"]  # released after the deadline too


def test_drop_policy_and_turn_deadline(tokenizer):
    class SlowModel(ScriptedRollout):
        async def agenerate(self, prompt_ids, sampling, session_id=None):
            if session_id == "slow":
                await asyncio.sleep(3600)
            return await super().agenerate(prompt_ids, sampling, session_id)

    model = SlowModel(tokenizer, lambda s, k: "42")
    cfg = AgentLoopConfig(max_turns=2, turn_timeout_s=0.5, timeout_reward="drop")
    loop = EPISODES.get("tool_agent")(tokenizer, cfg, {})
    items = [Prompt([{"role": "user", "content": "?"}], sample_id=s) for s in ("slow", "ok")]
    slow, ok = asyncio.run(run_episodes(loop, model, items, GREEDY))
    assert (slow.finish_reason, slow.dropped, slow.response_ids) == ("turn_timeout", True, [])
    expected = len(tokenizer.encode("42", add_special_tokens=False)) + 1  # + its EOS
    assert (ok.finish_reason, ok.dropped, sum(ok.response_mask)) == ("stop", False, expected)
    with pytest.raises(ConfigError, match="timeout_reward='never'"):
        AgentLoopConfig(timeout_reward="never")
    with pytest.raises(ConfigError, match="turn_timeout_s=0"):
        AgentLoopConfig(turn_timeout_s=0)
