"""The gateway with the real `openai` and `anthropic` clients, for each of its three APIs
(Chat Completions, Responses, Messages), streamed and not: the trajectory trains exactly the
tokens served (the decoded ids of each model turn equal the text the client got, the log-probs
are the backend's), five turns with tool calls round-trip in each API's own format, a stream
gives what the plain call gives under the same seed, and a wrong or expired key is refused
with 401 and a message."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from tephra.core.errors import ConfigError
from tephra.episodes.agent import TOOL_CHAT_TEMPLATE, AgentLoopConfig, Prompt
from tephra.episodes.gateway import GatewayConfig, shared_gateway
from tephra.episodes.registry import EPISODES
from tephra.rollout.backends.hf import HFRollout
from tephra.rollout.base import RolloutConfig, SamplingParams
from tephra.rollout.testing import ScriptedRollout

openai = pytest.importorskip("openai")  # dev dependencies: the agents' clients, not tephra's
anthropic = pytest.importorskip("anthropic")

SAMPLING = SamplingParams(temperature=1.0, max_tokens=80, seed=11)
TOOL_TURNS = 4  # scripted turns that call the tool; the fifth turn is the real model's

AGENTS = '''
import json
import re
from pathlib import Path

import anthropic
import openai

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}


def record(item, text, calls):
    item.extra_info.setdefault("served", []).append({"text": text, "calls": calls})


async def chat(gateway, item):
    client = openai.AsyncOpenAI(base_url=gateway.openai_base_url, api_key=gateway.api_key,
                                max_retries=0)
    tools = [{"type": "function", "function": {"name": "multiply", "parameters": SCHEMA}}]
    messages = list(item.messages)
    for _ in range(6):
        if item.extra_info["stream"]:  # the deltas joined, as a streaming agent does
            content, raw_calls, finish = "", {}, None
            chunks = await client.chat.completions.create(
                model="policy", messages=messages, tools=tools, stream=True,
                stream_options={"include_usage": True},
            )
            async for chunk in chunks:
                for choice in chunk.choices:
                    content += choice.delta.content or ""
                    for c in choice.delta.tool_calls or []:
                        raw_calls.setdefault(c.index, {"id": c.id, "type": "function",
                            "function": {"name": c.function.name, "arguments": ""}})
                        raw_calls[c.index]["function"]["arguments"] += c.function.arguments
                    finish = choice.finish_reason or finish
            raw_calls = [raw_calls[k] for k in sorted(raw_calls)]
        else:
            reply = await client.chat.completions.create(
                model="policy", messages=messages, tools=tools
            )
            message, finish = reply.choices[0].message, reply.choices[0].finish_reason
            content = message.content
            raw_calls = [c.model_dump() for c in message.tool_calls or []]
        calls = [(c["id"], c["function"]["name"], json.loads(c["function"]["arguments"]))
                 for c in raw_calls]
        record(item, content, calls)
        messages.append({"role": "assistant", "content": content,
                         **({"tool_calls": raw_calls} if raw_calls else {})})
        if finish != "tool_calls":
            return None
        for call_id, _, args in calls:
            messages.append({"role": "tool", "tool_call_id": call_id,
                             "content": str(args["a"] * args["b"])})


async def responses(gateway, item):
    client = openai.AsyncOpenAI(base_url=gateway.openai_base_url, api_key=gateway.api_key,
                                max_retries=0)
    tools = [{"type": "function", "name": "multiply", "parameters": SCHEMA, "strict": False}]
    items = list(item.messages)
    for _ in range(6):
        if item.extra_info["stream"]:
            deltas = []
            async with client.responses.stream(model="policy", input=items, tools=tools) as s:
                async for event in s:  # a turn cut by the length ends "incomplete", as the API's
                    if event.type == "response.output_text.delta":
                        deltas.append(event.delta)
                    if event.type in ("response.completed", "response.incomplete"):
                        reply = event.response
            assert "".join(deltas) == reply.output_text
        else:
            reply = await client.responses.create(model="policy", input=items, tools=tools)
        calls = [(o.call_id, o.name, json.loads(o.arguments))
                 for o in reply.output if o.type == "function_call"]
        record(item, reply.output_text, calls)
        items += [o.model_dump(exclude_none=True) for o in reply.output]
        if not calls:
            return None
        for call_id, _, args in calls:
            items.append({"type": "function_call_output", "call_id": call_id,
                          "output": str(args["a"] * args["b"])})


async def messages(gateway, item):
    client = anthropic.AsyncAnthropic(base_url=gateway.anthropic_base_url,
                                      api_key=gateway.api_key, max_retries=0)
    tools = [{"name": "multiply", "input_schema": SCHEMA}]
    history = list(item.messages)
    for _ in range(6):
        if item.extra_info["stream"]:
            async with client.messages.stream(
                model="policy", max_tokens=512, messages=history, tools=tools
            ) as stream:
                reply = await stream.get_final_message()
        else:
            reply = await client.messages.create(
                model="policy", max_tokens=512, messages=history, tools=tools
            )
        text = "".join(b.text for b in reply.content if b.type == "text")
        calls = [(b.id, b.name, b.input) for b in reply.content if b.type == "tool_use"]
        record(item, text, calls)
        history.append({"role": "assistant", "content": [b.model_dump() for b in reply.content]})
        if reply.stop_reason != "tool_use":
            return None
        history.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": i, "content": str(a["a"] * a["b"])}
            for i, _, a in calls]})


async def keep_key(gateway, item):
    """Answers once and leaves its access behind (for the expired-key check)."""
    client = openai.AsyncOpenAI(base_url=gateway.openai_base_url, api_key=gateway.api_key,
                                max_retries=0)
    await client.chat.completions.create(model="policy", messages=list(item.messages))
    item.extra_info["access"] = gateway


async def keyed(gateway, item):
    """Sends the key in the URL's path, and a header key that is no key (one process-wide
    setting of a client, as verifiers' is)."""
    client = openai.AsyncOpenAI(base_url=gateway.keyed_openai_base_url, api_key="EMPTY",
                                max_retries=0)
    reply = await client.chat.completions.create(model="policy", messages=list(item.messages))
    item.extra_info["reply"] = reply.choices[0].message.content
    item.extra_info["access"] = gateway
'''


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    tok = AutoTokenizer.from_pretrained(tiny_model.path)
    tok.chat_template = TOOL_CHAT_TEMPLATE
    return tok


@pytest.fixture(scope="module")
def hf(tiny_model):
    rollout = HFRollout(RolloutConfig(model_path=tiny_model.path, max_model_len=1024))
    yield rollout
    rollout.close()


@pytest.fixture(scope="module")
def agents(tmp_path_factory):
    path = tmp_path_factory.mktemp("agents") / "agents.py"
    path.write_text(AGENTS)
    return path


def tool_turn(session: str, k: int) -> str | None:
    """Turns 0-3 call the tool (multiply k by 7); turn 4 is left to the real model."""
    if k >= TOOL_TURNS:
        return None
    call = json.dumps({"name": "multiply", "arguments": {"a": k, "b": 7}})
    return f"Step {k}. <tool_call>{call}</tool_call>"


def episode(tokenizer, agents, name, **config):
    cfg = AgentLoopConfig(openai_agent=f"{agents}:{name}", max_response_tokens=700, **config)
    return EPISODES.get("openai_agent")(tokenizer, cfg)


def runs(mask: list[int]) -> list[tuple[int, int, int]]:
    """(value, start, end) of each run of equal values in `mask`."""
    out, start = [], 0
    for k in range(1, len(mask) + 1):
        if k == len(mask) or mask[k] != mask[start]:
            out.append((mask[start], start, k))
            start = k
    return out


@pytest.mark.parametrize("api", ["chat", "responses", "messages"])
def test_five_turns_with_tool_calls_train_exactly_what_each_api_served(api, tokenizer, hf, agents):
    results = {}
    for stream in (False, True):
        model = ScriptedRollout(tokenizer, tool_turn, fallback=hf)
        item = Prompt(
            [{"role": "user", "content": "Multiply."}],
            sample_id=f"{api}-0",  # the same trajectory (its turn seeds come from its id)
            extra_info={"stream": stream},
        )
        traj = asyncio.run(episode(tokenizer, agents, api).run(model, item, SAMPLING))
        served = item.extra_info["served"]  # the agent's notes, on the prompt it was given
        assert traj.finish_reason in ("stop", "length"), traj.extra_info.get("agent_error")
        assert (traj.num_turns, traj.tool_calls, len(served)) == (5, TOOL_TURNS, 5)
        # each model turn (mask 1) is the backend's ids and log-probs, and decodes to the text
        # the client was given; each context was prompt + every id so far, never re-tokenised
        model_runs = [(a, b) for v, a, b in runs(traj.response_mask) if v == 1]
        assert len(model_runs) == 5
        for k, ((a, b), (_, context, gen), got) in enumerate(
            zip(model_runs, model.requests, served)
        ):
            assert traj.response_ids[a:b] == gen.response_ids
            assert traj.log_probs[a:b] == gen.log_probs
            assert context == traj.prompt_ids + traj.response_ids[:a]
            ids = gen.response_ids[:-1] if gen.finish_reason == "stop" else gen.response_ids
            assert tokenizer.decode(ids, skip_special_tokens=False) == got["text"]
            if k < TOOL_TURNS:  # the call came back in the API's own form, and its result went in
                assert [c[1:] for c in got["calls"]] == [("multiply", {"a": k, "b": 7})]
                tool_ids = traj.response_ids[b : model_runs[k + 1][0]]
                assert f"<tool_response>\n{7 * k}\n</tool_response>" in tokenizer.decode(tool_ids)
        results[stream] = (traj.response_ids, traj.log_probs, [s["text"] for s in served])
    assert results[True] == results[False]  # streamed or not: the same seed, the same turns


def test_a_wrong_or_expired_key_is_refused_with_401(tokenizer, agents):
    model = ScriptedRollout(tokenizer, lambda s, k: "Hello.")
    item = Prompt([{"role": "user", "content": "Hi"}], extra_info={"stream": False})
    loop = episode(tokenizer, agents, "keep_key")

    async def scenario():
        async with shared_gateway(GatewayConfig()) as gateway:  # outlives the trajectory
            traj = await loop.run(model, item, SAMPLING)
            access = item.extra_info["access"]
            assert access.url == gateway.url and traj.num_turns == 1
            chat = openai.AsyncOpenAI(
                base_url=access.openai_base_url, api_key=access.api_key, max_retries=0
            )
            claude = anthropic.AsyncAnthropic(
                base_url=access.anthropic_base_url, api_key=access.api_key, max_retries=0
            )
            wrong_chat = chat.with_options(api_key="tephra-not-a-key")
            wrong_claude = claude.with_options(api_key="tephra-not-a-key")
            calls = {
                "chat": lambda c: c.chat.completions.create(
                    model="p", messages=[{"role": "user", "content": "Hi"}]
                ),
                "responses": lambda c: c.responses.create(model="p", input="Hi"),
            }
            for name, call in calls.items():
                for client, message in ((chat, "has expired"), (wrong_chat, "unknown API key")):
                    with pytest.raises(openai.AuthenticationError) as refused:
                        await call(client)
                    assert refused.value.status_code == 401, name
                    assert message in refused.value.message, name
            for client, message in ((claude, "has expired"), (wrong_claude, "unknown API key")):
                with pytest.raises(anthropic.AuthenticationError) as refused:
                    await client.messages.create(
                        model="p", max_tokens=8, messages=[{"role": "user", "content": "Hi"}]
                    )
                assert refused.value.status_code == 401 and message in refused.value.message
                if message == "has expired":  # it names the trajectory that ended
                    assert f"trajectory {item.sample_id!r} has expired" in refused.value.message
            assert len(model.requests) == 1  # nothing refused reached the model

    asyncio.run(scenario())


def test_a_key_in_the_path_routes_the_call_and_wins_over_the_header(tokenizer, agents):
    model = ScriptedRollout(tokenizer, lambda s, k: "Hello.")
    item = Prompt([{"role": "user", "content": "Hi"}], extra_info={"stream": False})
    loop = episode(tokenizer, agents, "keyed")

    async def scenario():
        async with shared_gateway(GatewayConfig()) as gateway:  # outlives the trajectory
            traj = await loop.run(model, item, SAMPLING)
            access = item.extra_info["access"]
            assert access.keyed_openai_base_url == f"{gateway.url}/k/{access.api_key}/v1"
            assert (traj.finish_reason, traj.num_turns, item.extra_info["reply"]) == (
                "stop",
                1,
                "Hello.",
            )
            # the path's key decides: an ended trajectory's keyed URL is refused, and a path
            # key the gateway never gave is refused as unknown, whatever key the header holds
            for base, message in (
                (access.keyed_openai_base_url, "has expired"),
                (f"{gateway.url}/k/tephra-not-a-key/v1", "unknown API key"),
            ):
                client = openai.AsyncOpenAI(base_url=base, api_key=access.api_key, max_retries=0)
                with pytest.raises(openai.AuthenticationError) as refused:
                    await client.chat.completions.create(
                        model="p", messages=[{"role": "user", "content": "Hi"}]
                    )
                assert refused.value.status_code == 401 and message in refused.value.message
            assert len(model.requests) == 1  # nothing refused reached the model

    asyncio.run(scenario())


def test_a_rewritten_history_is_refused_in_the_api_format(tokenizer, agents, tmp_path):
    rewriter = tmp_path / "rewriter.py"
    rewriter.write_text(
        "import anthropic\n"
        "def agent(gateway, item):\n"
        "    client = anthropic.Anthropic(base_url=gateway.anthropic_base_url,\n"
        "                                 api_key=gateway.api_key, max_retries=0)\n"
        "    history = list(item.messages)\n"
        "    client.messages.create(model='p', max_tokens=16, messages=history)\n"
        "    history += [{'role': 'assistant', 'content': 'edited'},\n"
        "                {'role': 'user', 'content': 'Sure?'}]\n"
        "    client.messages.create(model='p', max_tokens=16, messages=history)\n"
    )
    model = ScriptedRollout(tokenizer, lambda s, k: "Fine.")
    loop = EPISODES.get("openai_agent")(
        tokenizer, AgentLoopConfig(openai_agent=f"{rewriter}:agent")
    )
    traj = asyncio.run(loop.run(model, Prompt([{"role": "user", "content": "?"}]), SAMPLING))
    assert traj.finish_reason == "agent_error" and traj.env_reward == 0.0
    error = traj.extra_info["agent_error"]
    assert error.startswith("BadRequestError") and "message 1 ('assistant') differs" in error
    assert traj.num_turns == 1  # the refused request generated nothing


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("port", 70000, "rollout.agent.gateway.port=70000 must be a TCP port"),
        ("host", "", "rollout.agent.gateway.host='' must be an address"),
    ],
)
def test_bad_gateway_settings_are_refused_naming_the_field(field, value, message):
    with pytest.raises(ConfigError, match=message):
        GatewayConfig(**{field: value})


def test_the_readme_gateway_example_runs(tokenizer, capsys):
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    start = text.index("## The gateway")
    section = text[start : text.index("\n## ", start + 1)]
    (block,) = re.findall(r"```python\n(.*?)```", section, re.DOTALL)
    exec(compile(block, "README.md", "exec"), {"tok": tokenizer})  # noqa: S102 (our own docs)
    assert capsys.readouterr().out.splitlines()[-1] == "1.0 True"
