"""An agent written with the OpenAI Agents SDK (`openai-agents`, its default Responses model)
calls the policy through the gateway: in process, its function tool round-trips (the call the
policy wrote runs in the SDK, its result reaches the next context) and the trajectory holds
the served tokens; through the PPO app, two GRPO steps train on its turns (each dumped sample's
model turns, decoded, are the texts the agent received); bad gateway settings are refused when
the config loads, before Ray starts."""

from __future__ import annotations

import asyncio
import json
from importlib.metadata import version

import pytest
from packaging.version import Version
from transformers import AutoTokenizer

from tephra.apps.ppo.main import parse_config, run
from tephra.controller.launch.testing import run_and_read
from tephra.controller.run.models import resolve_model_path
from tephra.core.errors import ConfigError
from tephra.episodes.agent import TOOL_CHAT_TEMPLATE, AgentLoopConfig, Prompt
from tephra.episodes.registry import EPISODES
from tephra.episodes.testing import model_turns
from tephra.rollout.backends.hf import HFRollout
from tephra.rollout.base import RolloutConfig, SamplingParams
from tephra.rollout.testing import ScriptedRollout

pytest.importorskip("agents")  # openai-agents: a dev dependency, the agent's, not tephra's
# Releases of the Agents SDK differ on a response the token budget cut (`incomplete`): from
# 0.24 its Responses model raises (ModelBehaviorError), 0.20 takes the cut text as the turn's
# output and the agent goes on (the releases between are not tested here). The gateway serves
# the same either way; the trajectory ends with `length` either way; the reward is the
# scorer's when the SDK raised, the agent's when it returned.
SDK_RAISES_ON_CUT = Version(version("openai-agents")) >= Version("0.24")

AGENT = '''
import json
import pathlib

import httpx
from agents import Agent, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
from openai import AsyncOpenAI

set_tracing_disabled(True)  # no trace export (no network here)
RECORDS = pathlib.Path({records!r})


@function_tool
def multiply(a: int, b: int) -> int:
    """Multiply two integers."""
    return a * b


async def agent(gateway, item):
    """Two runs of an Agents-SDK agent, the second continuing the first's conversation; what
    the gateway served (the response bodies, as they crossed the wire) is written down for the
    test, also when the SDK raises (it does on a turn the token budget cut: `incomplete`)."""
    served = []

    async def keep(response):
        await response.aread()
        if response.request.url.path.endswith("/responses"):
            served.append(response.json())

    client = AsyncOpenAI(base_url=gateway.openai_base_url, api_key=gateway.api_key,
                         max_retries=0,
                         http_client=httpx.AsyncClient(event_hooks={{"response": [keep]}}))
    model = OpenAIResponsesModel(model="policy", openai_client=client)
    bot = Agent(name="calc", model=model, tools=[multiply] if {tools} else [])
    final = None
    try:
        first = await Runner.run(bot, list(item.messages), max_turns=4)
        again = first.to_input_list() + [{{"role": "user", "content": "Once more."}}]
        second = await Runner.run(bot, again, max_turns=4)
        final = second.final_output
    finally:
        RECORDS.mkdir(parents=True, exist_ok=True)
        (RECORDS / f"{{item.sample_id}}.json").write_text(json.dumps({{
            "texts": ["".join(c["text"] for o in r["output"] if o["type"] == "message"
                              for c in o["content"]) for r in served],
            "statuses": [r["status"] for r in served],
            "outputs": [o for r in served for o in r["output"]],
            "final": final,
        }}))
    return float(len(final.strip()) % 2)
'''

SCORER = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return 0.25 + 0.5 * (len(solution_str.strip()) % 2)
"""


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from tephra.rollout.testing import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny"))


def test_an_agents_sdk_tool_call_round_trips_through_the_gateway(tmp_path, tiny_model):
    tok = AutoTokenizer.from_pretrained(tiny_model.path)
    tok.chat_template = TOOL_CHAT_TEMPLATE
    agent = tmp_path / "sdk_agent.py"
    agent.write_text(AGENT.format(records=str(tmp_path / "records"), tools=True))
    call = json.dumps({"name": "multiply", "arguments": {"a": 6, "b": 7}})
    script = [f"<tool_call>{call}</tool_call>", "It is 42.", "Still 42."]
    model = ScriptedRollout(tok, lambda s, k: script[k])
    loop = EPISODES.get("openai_agent")(
        tok, AgentLoopConfig(openai_agent=f"{agent}:agent", max_response_tokens=512)
    )
    item = Prompt([{"role": "user", "content": "6 * 7?"}], sample_id="sdk-0")
    traj = asyncio.run(loop.run(model, item, SamplingParams(temperature=1.0, max_tokens=64)))
    assert traj.finish_reason == "stop", traj.extra_info.get("agent_error")
    record = json.loads((tmp_path / "records" / "sdk-0.json").read_text())
    assert record["final"] == "Still 42." and traj.env_reward == 1.0  # len 9: odd
    assert record["texts"] == script
    calls = [o for o in record["outputs"] if o["type"] == "function_call"]
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        ("multiply", {"a": 6, "b": 7})
    ]
    assert (traj.num_turns, traj.tool_calls) == (3, 1)
    turns = model_turns(traj.response_ids, traj.response_mask)
    assert turns == [gen.response_ids for _, _, gen in model.requests]
    # the SDK ran the tool and sent its output back: the tool turn holds 42
    (_, ctx1, _) = model.requests[1]
    assert "<tool_response>\n42\n</tool_response>" in tok.decode(ctx1[len(traj.prompt_ids) :])
    # the second run re-sent the whole conversation (the SDK's own items), accepted as history
    assert [m["role"] for m in traj.messages] == [
        "user",
        "assistant",
        "tool",
        "assistant",
        "user",
        "assistant",
    ]


def test_an_agents_sdk_agent_whose_turn_the_budget_cuts_ends_with_length(tmp_path, tiny_model):
    """The gateway serves a cut turn as `incomplete` (as the Responses API does) and the SDK
    raises on it; the budget ended the trajectory: `length`, the reward scorer's (None here),
    the SDK's error kept."""
    tok = AutoTokenizer.from_pretrained(tiny_model.path)
    tok.chat_template = TOOL_CHAT_TEMPLATE
    agent = tmp_path / "sdk_agent.py"
    agent.write_text(AGENT.format(records=str(tmp_path / "records"), tools=False))
    loop = EPISODES.get("openai_agent")(
        tok, AgentLoopConfig(openai_agent=f"{agent}:agent", max_response_tokens=512)
    )
    item = Prompt([{"role": "user", "content": "6 * 7?"}], sample_id="sdk-cut")
    sampling = SamplingParams(temperature=1.0, max_tokens=4, seed=5)  # seed 5: no EOS in 4
    rollout = HFRollout(RolloutConfig(model_path=tiny_model.path, max_model_len=1024))
    try:
        traj = asyncio.run(loop.run(rollout, item, sampling))
        again = asyncio.run(rollout.agenerate(traj.prompt_ids, sampling))
    finally:
        rollout.close()
    record = json.loads((tmp_path / "records" / "sdk-cut.json").read_text())
    if SDK_RAISES_ON_CUT:
        assert record["statuses"] == ["incomplete"] and record["final"] is None
        assert (traj.finish_reason, traj.env_reward, traj.num_turns) == ("length", None, 1)
        assert "ModelBehaviorError" in traj.extra_info["agent_error"]
        assert "max_output_tokens" in traj.extra_info["agent_error"]
    else:  # both runs ended on their cut turn; the agent's reward of its final output
        assert record["statuses"] == ["incomplete", "incomplete"]
        assert record["final"] == record["texts"][1] and "agent_error" not in traj.extra_info
        final = float(len(record["final"].strip()) % 2)
        assert (traj.finish_reason, traj.env_reward, traj.num_turns) == ("length", final, 2)
    # the first trained turn is the one served: the backend's sample for this seed, as sent
    first = model_turns(traj.response_ids, traj.response_mask)[0]
    assert first == again.response_ids and len(again.response_ids) == 4
    assert tok.decode(first, skip_special_tokens=False) == record["texts"][0]


@pytest.mark.multiproc
def test_an_agents_sdk_agent_trains_two_steps_through_the_app(tmp_path, grpo_step_reference):
    """The tiny model rarely ends a turn within `rollout.max_tokens`: with an SDK that raises on
    a cut turn most runs end there (`length`, the scorer's reward); a run whose turns both end
    returns the agent's reward. Either way the trained turns are the texts the gateway served."""
    records = tmp_path / "records"
    agent = tmp_path / "sdk_agent.py"
    agent.write_text(AGENT.format(records=str(records), tools=False))
    scorer = tmp_path / "scorer.py"
    scorer.write_text(SCORER)
    cfg = parse_config(
        [
            "-p",
            "smoke",
            "rollout.agent_loop=openai_agent",
            f"rollout.agent.openai_agent={agent}:agent",
            "rollout.agent.max_response_tokens=96",
            f"reward.custom_function_path={scorer}",
            "trainer.dump_generations=1",
            f"trainer.run_dir={tmp_path / 'run'}",
        ]
    )
    summary, steps = run_and_read(run, cfg)
    tok = AutoTokenizer.from_pretrained(resolve_model_path(cfg.model.path, cfg.trainer.seed))
    received = [json.loads(p.read_text()) for p in records.glob("*.json")]
    assert len(received) == 2 * cfg.batch.samples_per_step
    for r, rows in steps:
        assert len(rows) == cfg.batch.samples_per_step
        for row in rows:
            turns = model_turns(row["response_ids"], row["response_mask"])
            if row["finish_reason"] == "length" and SDK_RAISES_ON_CUT:  # the scorer's
                assert row["score"] == 0.25 + 0.5 * (len(row["answer"]) % 2)
            else:  # both runs ended: two served turns around the SDK's user turn, the agent's
                assert row["finish_reason"] in ("stop", "length") and len(turns) == 2
                assert row["score"] == float(len(row["answer"]) % 2)
        assert r["reward/mean"] == pytest.approx(sum(x["score"] for x in rows) / len(rows))
    # step 1 (on-policy, the initial weights) recomputed from the dumped trajectories in plain
    # transformers: GRPO's advantages of the scores, the loss and gradient norm over the
    # served turns' tokens (mask 1)
    first, rows = steps[0]
    want = grpo_step_reference(resolve_model_path("tiny", 0), rows)
    assert [x["advantage"] for x in rows] == pytest.approx(want["advantages"], abs=1e-5)
    assert first["actor/pg_loss"] == pytest.approx(want["pg_loss"], abs=1e-5)
    assert first["actor/grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4)
    rows = [row for _, step_rows in steps for row in step_rows]
    # the runs the SDK ended on a cut turn are the trajectories that ended with `length`
    assert sum(rec["statuses"][-1] == "incomplete" for rec in received) == sum(
        row["finish_reason"] == "length" for row in rows
    )

    # each trained sample is one the agent ran: its model turns decode to the texts served
    def decoded(row: dict) -> list[str]:
        return [
            tok.decode(t[:-1] if t[-1] == tok.eos_token_id else t, skip_special_tokens=False)
            for t in model_turns(row["response_ids"], row["response_mask"])
        ]

    trained = sorted(json.dumps(decoded(row)) for row in rows)
    assert trained == sorted(json.dumps(r["texts"]) for r in received)


def test_bad_gateway_settings_are_refused_when_the_config_loads():
    with pytest.raises(ConfigError, match=r"rollout\.agent\.gateway\.port=70000 must be a TCP"):
        parse_config(["-p", "smoke", "rollout.agent.gateway.port=70000"])
