"""Black-box agents through the gateway's Chat Completions API, with the real `openai` client:
the trajectory's tokens are exactly what the gateway served (model turns) and appended (the
template's delta for tool / user messages), compared with the rollout's own records; tool
calls come back as OpenAI tool_calls; history rewrites are refused; the hf backend serves."""

from __future__ import annotations

import asyncio

import pytest
from transformers import AutoTokenizer

from tephra.episodes.agent import TOOL_CHAT_TEMPLATE, AgentLoopConfig, Prompt
from tephra.episodes.registry import EPISODES
from tephra.rollout.backends.hf import HFRollout
from tephra.rollout.base import RolloutConfig, SamplingParams
from tephra.rollout.testing import ScriptedRollout

openai = pytest.importorskip("openai")  # a dev dependency: the agent's client, not tephra's

SAMPLING = SamplingParams(temperature=1.0, max_tokens=48, seed=5)

AGENT = '''
import json
from openai import AsyncOpenAI

TOOLS = [{"type": "function", "function": {"name": "multiply", "description": "a * b",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
    "b": {"type": "integer"}}}}}]


async def agent(gateway, item):
    """Ask; run the tool calls the policy makes locally; ask again; reward 1 for "42"."""
    client = AsyncOpenAI(base_url=gateway.openai_base_url, api_key=gateway.api_key, max_retries=0)
    messages = list(item.messages)
    for _ in range(3):
        reply = await client.chat.completions.create(
            model="policy", messages=messages, tools=TOOLS
        )
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if reply.choices[0].finish_reason != "tool_calls":
            return float("42" in (message.content or ""))
        for call in message.tool_calls:
            args = json.loads(call.function.arguments)
            messages.append(
                {"role": "tool", "tool_call_id": call.id, "content": str(args["a"] * args["b"])}
            )
    return 0.0


def rewriter(gateway, item):
    """A synchronous agent that edits the served answer before sending it back."""
    from openai import OpenAI

    client = OpenAI(base_url=gateway.openai_base_url, api_key=gateway.api_key, max_retries=0)
    messages = list(item.messages)
    reply = client.chat.completions.create(model="policy", messages=messages)
    messages.append({"role": "assistant", "content": "edited"})
    messages.append({"role": "user", "content": "Are you sure?"})
    client.chat.completions.create(model="policy", messages=messages)
'''


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    tok = AutoTokenizer.from_pretrained(tiny_model.path)
    tok.chat_template = TOOL_CHAT_TEMPLATE
    return tok


@pytest.fixture
def agent_file(tmp_path):
    path = tmp_path / "my_agent.py"
    path.write_text(AGENT)
    return path


def test_trained_tokens_are_what_the_gateway_served(tokenizer, agent_file):
    call = '<tool_call>{"name": "multiply", "arguments": {"a": 6, "b": 7}}</tool_call>'
    model = ScriptedRollout(tokenizer, lambda s, k: [f"Let me multiply. {call}", "It is 42."][k])
    loop = EPISODES.get("openai_agent")(
        tokenizer, AgentLoopConfig(openai_agent=f"{agent_file}:agent", max_response_tokens=256)
    )
    item = Prompt([{"role": "user", "content": "6 times 7?"}], sample_id="b0")
    traj = asyncio.run(loop.run(model, item, SAMPLING))
    assert traj.env_reward == 1.0 and traj.finish_reason == "stop"
    assert (traj.num_turns, traj.tool_calls) == (2, 1)
    (_, ctx0, g0), (_, ctx1, g1) = model.requests
    assert ctx0 == traj.prompt_ids  # the first request rendered once, with its tools
    # model turns byte for byte as served; the tool turn is the template's delta
    tool_text = (
        "\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    delta = tokenizer.encode(tool_text, add_special_tokens=False)
    assert traj.response_ids == g0.response_ids + delta + g1.response_ids
    assert ctx1 == traj.prompt_ids + g0.response_ids + delta  # the context was never re-tokenised
    assert traj.response_mask == [1] * len(g0.response_ids) + [0] * len(delta) + [1] * len(
        g1.response_ids
    )
    assert traj.log_probs == g0.log_probs + [0.0] * len(delta) + g1.log_probs
    assert [m["role"] for m in traj.messages] == ["user", "assistant", "tool", "assistant"]


def test_a_rewritten_history_is_refused_and_ends_the_trajectory(tokenizer, agent_file):
    model = ScriptedRollout(tokenizer, lambda s, k: "Fine.")
    loop = EPISODES.get("openai_agent")(
        tokenizer, AgentLoopConfig(openai_agent=f"{agent_file}:rewriter")
    )
    traj = asyncio.run(loop.run(model, Prompt([{"role": "user", "content": "?"}]), SAMPLING))
    assert traj.finish_reason == "agent_error" and traj.env_reward == 0.0
    assert "message 1 ('assistant') differs" in traj.extra_info["agent_error"]
    assert traj.num_turns == 1  # the refused request generated nothing


def test_the_hf_backend_serves_the_openai_client(tokenizer, tiny_model, agent_file):
    rollout = HFRollout(RolloutConfig(model_path=tiny_model.path, max_model_len=1024))
    try:
        loop = EPISODES.get("openai_agent")(
            tokenizer, AgentLoopConfig(openai_agent=f"{agent_file}:agent")
        )
        items = [Prompt([{"role": "user", "content": f"{i} + 1?"}]) for i in range(2)]
        trajs = [asyncio.run(loop.run(rollout, i, SAMPLING)) for i in items]
        for item, traj in zip(items, trajs):
            # the random model rarely calls the tool: one turn, generated by the backend from
            # the rendered prompt, its log-probs those the backend returned for those tokens
            again = asyncio.run(rollout.agenerate(traj.prompt_ids, SAMPLING.replace(max_tokens=48)))
            if traj.num_turns == 1:
                assert traj.response_ids == again.response_ids  # seeded: the same sample
                assert traj.log_probs == pytest.approx(again.log_probs, abs=1e-5)
            prompt = tokenizer.apply_chat_template(
                item.messages,
                tools=[
                    {
                        "type": "function",
                        "function": {
                            "name": "multiply",
                            "description": "a * b",
                            "parameters": {
                                "type": "object",
                                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                            },
                        },
                    }
                ],
                tokenize=False,
                add_generation_prompt=True,
            )
            assert traj.prompt_ids == tokenizer.encode(prompt, add_special_tokens=False)
            assert traj.env_reward in (0.0, 1.0) and sum(traj.response_mask) > 0
    finally:
        rollout.close()
