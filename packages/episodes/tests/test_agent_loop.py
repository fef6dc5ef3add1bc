"""Agent-loop tests: token-in-token-out bookkeeping (scripted model turns, checked against
hand-written token deltas and transcripts), tool errors and budgets, concurrency, and the real
`hf` backend (its generations compared with `Rollout.generate` on the same context)."""

from __future__ import annotations

import asyncio
import json

import pytest
from transformers import AutoTokenizer

from tephra.engine_api.errors import ConfigError
from tephra.episodes.agent import (
    TOOL_CHAT_TEMPLATE,
    AgentLoopConfig,
    Prompt,
)
from tephra.episodes.episode import run_episodes
from tephra.episodes.registry import EPISODES
from tephra.episodes.tools import PythonTool, Tool, ToolResult
from tephra.rollout.backends.hf import HFRollout
from tephra.rollout.base import RolloutConfig, SamplingParams
from tephra.rollout.samples import to_batch
from tephra.rollout.testing import ScriptedRollout

GREEDY = SamplingParams(temperature=0.0, max_tokens=160)


def tool_call(name: str, **arguments) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


class EchoTool(Tool):
    name = "echo"
    description = "Echo the text."
    parameters = {
        "type": "object",
        "properties": {"text": {"type": "string"}},
        "required": ["text"],
    }

    def __init__(self):
        self.created, self.released = [], []

    async def create(self, instance_id, **kwargs):
        self.created.append((instance_id, kwargs))

    async def execute(self, instance_id, arguments):
        if arguments.get("text") == "raise":
            raise RuntimeError("bug in the tool")
        return ToolResult(arguments["text"], metrics={"calls": 1.0})

    async def calc_reward(self, instance_id):
        return 0.5

    async def release(self, instance_id):
        self.released.append(instance_id)


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    tok = AutoTokenizer.from_pretrained(tiny_model.path)
    tok.chat_template = TOOL_CHAT_TEMPLATE
    return tok


@pytest.fixture(scope="module")
def hf_rollout(tiny_model):
    rollout = HFRollout(RolloutConfig(model_path=tiny_model.path, max_model_len=1024))
    yield rollout
    rollout.close()


def question(i: int = 0) -> list[dict]:
    return [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": f"What is 6 times {7 + i}?"},
    ]


def test_tool_turn_is_exactly_generated_ids_plus_the_template_delta(tokenizer):
    turn0 = "Let me compute." + tool_call("python", code="print(6 * 7)")
    turn1 = "The answer is 42."
    model = ScriptedRollout(tokenizer, lambda s, k: [turn0, turn1][k])
    python = PythonTool(timeout_s=5, memory_mb=256)
    loop = EPISODES.get("tool_agent")(tokenizer, AgentLoopConfig(max_turns=4), {"python": python})
    traj = asyncio.run(loop.run(model, Prompt(question(), sample_id="s0"), GREEDY))

    schema = [python.schema()]
    prompt_text = tokenizer.apply_chat_template(
        question(), tools=schema, tokenize=False, add_generation_prompt=True
    )
    assert prompt_text.endswith(
        "<|im_start|>user\nWhat is 6 times 7?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert traj.prompt_ids == tokenizer.encode(prompt_text, add_special_tokens=False)
    (_, ctx0, g0), (_, ctx1, g1) = model.requests
    # the tool turn, written out by hand for this ChatML template (python printed "42\n")
    tool_text = "\n<|im_start|>user\n<tool_response>\n42\n\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    delta = tokenizer.encode(tool_text, add_special_tokens=False)
    assert traj.response_ids == g0.response_ids + delta + g1.response_ids
    assert ctx1 == traj.prompt_ids + g0.response_ids + delta  # the context was never re-tokenised
    assert traj.response_mask == [1] * len(g0.response_ids) + [0] * len(delta) + [1] * len(
        g1.response_ids
    )
    assert traj.log_probs == g0.log_probs + [0.0] * len(delta) + g1.log_probs
    decoded = tokenizer.decode(traj.prompt_ids + traj.response_ids, skip_special_tokens=False)
    assert decoded == prompt_text + turn0 + "<|im_end|>" + tool_text + turn1 + "<|im_end|>"
    # ... which is the chat template's rendering of the transcript
    rendered = tokenizer.apply_chat_template(traj.messages, tools=schema, tokenize=False)
    assert rendered == decoded + "\n"
    assert [m["role"] for m in traj.messages] == [
        "system",
        "user",
        "assistant",
        "tool",
        "assistant",
    ]
    assert traj.messages[3]["content"] == "42\n"
    assert (traj.num_turns, traj.tool_calls, traj.tool_errors, traj.finish_reason) == (
        2,
        1,
        0,
        "stop",
    )
    assert not python._instances  # released


def test_tool_errors_are_reported_to_the_model_and_counted(tokenizer):
    calls = (
        "<tool_call>{not json}</tool_call>"
        + tool_call("nope", x=1)
        + tool_call("echo", text="raise")
        + tool_call("echo", text="fine")
    )
    model = ScriptedRollout(tokenizer, lambda s, k: [calls, "done"][k])
    echo = EchoTool()
    loop = EPISODES.get("tool_agent")(
        tokenizer, AgentLoopConfig(max_tool_calls_per_turn=3), {"echo": echo}
    )
    traj = asyncio.run(
        loop.run(
            model,
            Prompt(question(), sample_id="e", tool_kwargs={"echo": {"answer": 42}}),
            GREEDY,
        )
    )
    tool_msgs = [m["content"] for m in traj.messages if m["role"] == "tool"]
    assert tool_msgs[0].startswith("Error: tool call 0 is not valid JSON")
    assert tool_msgs[1] == "Error: unknown tool 'nope'; available: echo"
    assert tool_msgs[2] == "Error: tool 'echo' raised RuntimeError: bug in the tool"
    assert tool_msgs[3] == "Error: more than 3 calls in one turn; this one was not run"
    assert (traj.tool_calls, traj.tool_errors, traj.finish_reason) == (4, 4, "stop")
    assert echo.created == [("e", {"answer": 42})] and echo.released == ["e"]
    assert traj.tool_rewards == {"echo": 0.5}


def test_max_turns_and_token_budget_end_the_trajectory(tokenizer):
    always_call = lambda s, k: tool_call("echo", text=f"call {k}")  # noqa: E731
    model = ScriptedRollout(tokenizer, always_call)
    echo = EchoTool()
    loop = EPISODES.get("tool_agent")(tokenizer, AgentLoopConfig(max_turns=3), {"echo": echo})
    traj = asyncio.run(loop.run(model, Prompt(question(), sample_id="m"), GREEDY))
    assert (traj.num_turns, traj.tool_calls, traj.finish_reason) == (3, 2, "max_turns")
    assert traj.extra_info["tool_metrics"] == {"echo": {"calls": 2.0}}

    # enough for the first model turn and part of the tool turn after it
    budget = len(tokenizer.encode(always_call("b", 0), add_special_tokens=False)) + 1 + 5
    model = ScriptedRollout(tokenizer, always_call)
    loop = EPISODES.get("tool_agent")(
        tokenizer, AgentLoopConfig(max_turns=5, max_response_tokens=budget), {"echo": echo}
    )
    traj = asyncio.run(loop.run(model, Prompt(question(), sample_id="b"), GREEDY))
    first = model.requests[0][2].response_ids
    assert (
        traj.finish_reason == "length"
        and len(traj.response_ids) == budget
        and len(model.requests) == 1
    )
    assert (
        traj.response_ids[: len(first)] == first
        and traj.response_mask == [1] * len(first) + [0] * 5
    )


def test_sampling_n_and_missing_template_are_refused(tokenizer, tiny_model):
    with pytest.raises(ConfigError, match="sampling.n=4"):
        asyncio.run(
            EPISODES.get("tool_agent")(tokenizer, None, {}).run(
                None, Prompt(question()), SamplingParams(n=4)
            )
        )
    bare = AutoTokenizer.from_pretrained(tiny_model.path)
    bare.chat_template = None
    loop = EPISODES.get("single_turn")(bare)
    with pytest.raises(ConfigError, match="no chat_template"):
        asyncio.run(loop.run(None, Prompt(question()), GREEDY))


def test_real_hf_backend_single_turn_matches_generate(tokenizer, hf_rollout):
    samples = [Prompt(question(i), sample_id=f"q{i}") for i in range(3)]
    for name in ("single_turn", "tool_agent"):
        loop = EPISODES.get(name)(tokenizer, AgentLoopConfig(max_turns=1), {})
        trajs = asyncio.run(run_episodes(loop, hf_rollout, samples, GREEDY))
        for traj in trajs:
            ref = hf_rollout.generate([traj.prompt_ids], GREEDY)  # the same context, alone
            assert traj.response_ids == ref.response_ids[0]
            assert traj.log_probs == pytest.approx(ref.log_probs[0], abs=1e-4)
            assert traj.response_mask == [1] * len(traj.response_ids) and traj.num_turns == 1
            assert tokenizer.decode(
                traj.prompt_ids + traj.response_ids, skip_special_tokens=False
            ) == (
                tokenizer.decode(traj.prompt_ids, skip_special_tokens=False)
                + traj.messages[-1]["content"]
                + ("<|im_end|>" if traj.response_ids[-1] == tokenizer.eos_token_id else "")
            )


def test_many_loops_in_flight_and_a_slow_tool_blocks_nobody(tokenizer, hf_rollout):
    """33 trajectories on the real hf backend: turn 0 is a scripted tool call, turn 1 is
    generated by the model. Trajectory 0's tool waits until every other trajectory has
    finished: if the slow tool blocked generation, it would time out."""
    n = 33
    events: list = []
    others_done = asyncio.Event
    state: dict = {}

    class SlowTool(Tool):
        name = "slow"
        description = "Answers slowly for trajectory 0."
        parameters = {"type": "object", "properties": {}}

        async def execute(self, instance_id, arguments):
            events.append(("tool_start", instance_id, 0))
            if instance_id == "t0":
                await asyncio.wait_for(state["others_done"].wait(), 120)
            events.append(("tool_end", instance_id, 0))
            return ToolResult(f"result for {instance_id}")

    model = ScriptedRollout(
        tokenizer, lambda s, k: tool_call("slow") if k == 0 else None, hf_rollout, events
    )
    loop = EPISODES.get("tool_agent")(tokenizer, AgentLoopConfig(max_turns=2), {"slow": SlowTool()})
    finished: list[str] = []

    async def one(i: int):
        traj = await loop.run(
            model,
            Prompt(question(i), sample_id=f"t{i}"),
            SamplingParams(temperature=0.0, max_tokens=40),
        )
        finished.append(traj.sample_id)
        if len(finished) == n - 1:
            state["others_done"].set()
        return traj

    async def main():
        state["others_done"] = others_done()
        return await asyncio.gather(*(one(i) for i in range(n)))

    trajs = asyncio.run(main())
    assert finished[-1] == "t0" and len(finished) == n
    slow_start = events.index(("tool_start", "t0", 0))
    slow_end = events.index(("tool_end", "t0", 0))
    model_turns_meanwhile = [
        e for e in events[slow_start:slow_end] if e[0] == "gen_end" and e[2] == 1
    ]
    assert len(model_turns_meanwhile) == n - 1  # every other trajectory generated while t0 waited
    assert model.peak_in_flight >= 32
    assert hf_rollout.batches_run < 2 * n  # concurrent requests were batched
    for traj in trajs:
        (_, _, g0), (_, ctx1, g1) = [r for r in model.requests if r[0] == traj.sample_id]
        tool_len = len(traj.response_ids) - len(g0.response_ids) - len(g1.response_ids)
        assert traj.response_ids == ctx1[len(traj.prompt_ids) :] + g1.response_ids
        assert traj.response_mask == [1] * len(g0.response_ids) + [0] * tool_len + [1] * len(
            g1.response_ids
        )
        assert traj.messages[3] == {
            "role": "tool",
            "name": "slow",
            "content": f"result for {traj.sample_id}",
        }
        assert traj.num_turns == 2 and traj.tool_calls == 1 and traj.tool_errors == 0
    # an independent reference for one trajectory's model turn: generate on the same context
    _, ctx1, g1 = next(r for r in model.requests if r[0] == "t5" and r[1] != trajs[5].prompt_ids)
    assert (
        hf_rollout.generate([ctx1], SamplingParams(temperature=0.0, max_tokens=40)).response_ids[0]
        == g1.response_ids
    )

    batch = to_batch(
        trajs, tokenizer.pad_token_id, agent_stats=True, uids=[i // 3 for i in range(n)]
    )
    assert batch["uid"].tolist() == [i // 3 for i in range(n)]
    assert batch["tool_rewards"].tolist() == [0.0] * n
    # row i holds trajectory i: prompt left-padded, response right after it, per-token fields aligned
    p_len = max(len(t.prompt_ids) for t in trajs)
    for i in (0, 7):
        t = trajs[i]
        row = batch["input_ids"][i].tolist()
        assert (
            row[p_len - len(t.prompt_ids) : p_len + len(t.response_ids)]
            == t.prompt_ids + t.response_ids
        )
        assert (
            batch["response_mask"][i, p_len : p_len + len(t.response_ids)].tolist()
            == t.response_mask
        )
        logp = batch["rollout_log_probs"][i, p_len : p_len + len(t.response_ids)].tolist()
        assert logp == pytest.approx(t.log_probs, abs=1e-6)
    assert batch["response_mask"].sum().item() == sum(t.generated_tokens for t in trajs)
    assert batch["attention_mask"].sum().item() == sum(
        len(t.prompt_ids) + len(t.response_ids) for t in trajs
    )
    assert batch["num_turns"].tolist() == [2] * n


def test_token_versions_follow_each_turn_and_tool_tokens_take_their_turns(tokenizer):
    """A backend that tags tokens (partial rollout): a weight update between the turns shows
    as version 0 on turn 0 and on the tool's answer to it, version 1 on turn 1; untagged
    turns give no versions."""
    turns = ["Let me compute." + tool_call("echo", text="42"), "The answer is 42."]

    def script(session, k):
        model.weight_version = k  # an update to version k lands before turn k
        return turns[k]

    model = ScriptedRollout(tokenizer, script)
    loop = EPISODES.get("tool_agent")(tokenizer, AgentLoopConfig(max_turns=4), {"echo": EchoTool()})
    traj = asyncio.run(loop.run(model, Prompt(question(), sample_id="s0"), GREEDY))
    (_, _, g0), (_, ctx1, g1) = model.requests
    tool = len(ctx1) - len(traj.prompt_ids) - len(g0.response_ids)
    assert tool > 0 and traj.response_mask[len(g0.response_ids)] == 0
    assert traj.token_versions == [0] * (len(g0.response_ids) + tool) + [1] * len(g1.response_ids)
    untagged = ScriptedRollout(tokenizer, lambda s, k: turns[k])
    loop = EPISODES.get("tool_agent")(tokenizer, AgentLoopConfig(max_turns=4), {"echo": EchoTool()})
    assert (
        asyncio.run(loop.run(untagged, Prompt(question(), sample_id="s1"), GREEDY)).token_versions
        is None
    )
    single = ScriptedRollout(tokenizer, lambda s, k: turns[1])
    single.weight_version = 3
    loop = EPISODES.get("single_turn")(tokenizer, AgentLoopConfig(), {})
    traj = asyncio.run(loop.run(single, Prompt(question(), sample_id="s2"), GREEDY))
    assert traj.token_versions == [3] * len(traj.response_ids)
