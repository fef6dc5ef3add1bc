"""Tool-call formats: each parser reads what its model family's real chat template writes for
an assistant turn with tool calls (templates in tests/data/chat_templates, each naming its
source), the tool agent runs a call in that format end to end, and a template that is not
append-only is refused naming the model and the turn."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from tephra.core.errors import ConfigError
from tephra.episodes.agent import AgentLoopConfig, Prompt
from tephra.episodes.agent.tool_calls import TOOL_CALL_PARSERS, ToolCall
from tephra.episodes.registry import EPISODES
from tephra.episodes.tools import Tool, ToolResult
from tephra.rollout.base import SamplingParams
from tephra.rollout.testing import ScriptedRollout

TEMPLATES = Path(__file__).parent / "data" / "chat_templates"
GREEDY = SamplingParams(temperature=0.0, max_tokens=200)


class Recorder(Tool):
    name = "python"
    description = "Run python code."
    parameters = {
        "type": "object",
        "properties": {"code": {"type": "string"}, "repeat": {"type": "integer"}},
        "required": ["code"],
    }

    def __init__(self):
        self.calls = []

    async def execute(self, instance_id, arguments):
        self.calls.append(arguments)
        return ToolResult("42")


def family_tokenizer(tiny_model, template: str, eos: str, extra: list[str]):
    """The tiny model's tokenizer with a family's template, end-of-turn token and control
    tokens added (a scripted model never reads embeddings, so new ids need no rows)."""
    tok = AutoTokenizer.from_pretrained(tiny_model.path)
    tok.add_special_tokens({"additional_special_tokens": [eos, *extra]})
    tok.eos_token = eos
    tok.chat_template = (TEMPLATES / template).read_text()
    return tok


FAMILIES = {
    # format: (template file, end-of-turn token, control tokens)
    "hermes": ("hermes.jinja", "<|im_end|>", ["<|im_start|>"]),
    "qwen3_coder": ("qwen3_coder.jinja", "<|im_end|>", ["<|im_start|>"]),
    "llama3_json": (
        "llama3_1_json.jinja",
        "<|eot_id|>",
        ["<|start_header_id|>", "<|end_header_id|>", "<|python_tag|>"],
    ),
    "mistral": ("mistral.jinja", "</s>", ["[INST]", "[/INST]", "[TOOL_CALLS]", "[TOOL_RESULTS]"]),
}
CALLS = {
    "hermes": [
        {"name": "python", "arguments": {"code": "print(6 * 7)", "repeat": 2}},
        {"name": "search", "arguments": {"query": "tephra"}},
    ],
    "qwen3_coder": [
        {"name": "python", "arguments": {"code": "x = 6 * 7\nprint(x)", "repeat": 2}},
        {"name": "search", "arguments": {"query": "tephra", "filters": {"year": 2026}}},
    ],
    "llama3_json": [{"name": "python", "arguments": {"code": "print(6 * 7)", "repeat": 2}}],
    "mistral": [
        {"name": "python", "arguments": {"code": "print(6 * 7)", "repeat": 2}},
        {"name": "search", "arguments": {"query": "tephra"}},
    ],
}


@pytest.mark.parametrize("fmt", sorted(FAMILIES))
def test_each_parser_reads_its_templates_own_tool_call_turn(fmt, tiny_model):
    template, eos, extra = FAMILIES[fmt]
    tok = family_tokenizer(tiny_model, template, eos, extra)
    calls = CALLS[fmt]
    user = [{"role": "user", "content": "What is 6 times 7?"}]
    assistant = {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": f"call{i:05d}", "type": "function", "function": c} for i, c in enumerate(calls)
        ],
    }
    before = tok.apply_chat_template(user, tokenize=False, add_generation_prompt=fmt != "mistral")
    full = tok.apply_chat_template([*user, assistant], tokenize=False)
    assert full.startswith(before)
    turn = full[len(before) :]
    turn = turn[: turn.rindex(eos)]  # what the model generates before its stop token
    parsed = TOOL_CALL_PARSERS.get(fmt)(turn)
    assert parsed == [ToolCall(c["name"], c["arguments"]) for c in calls], turn
    # an answer in plain words is no call
    assert TOOL_CALL_PARSERS.get(fmt)("The answer is 42.") == []


def test_malformed_calls_come_back_as_errors_for_the_model():
    assert TOOL_CALL_PARSERS.get("llama3_json")('{"name": "python", "parameters": [1]}')[0].error
    assert TOOL_CALL_PARSERS.get("llama3_json")('{"name": "python", "param')[0].error
    bad = TOOL_CALL_PARSERS.get("mistral")("[TOOL_CALLS] [{oops")
    assert bad[0].name is None and "TOOL_CALLS" in bad[0].error
    v11 = TOOL_CALL_PARSERS.get("mistral")('[TOOL_CALLS]python[ARGS]{"code": "1"}')
    assert v11 == [ToolCall("python", {"code": "1"})]
    xml = TOOL_CALL_PARSERS.get("qwen3_coder")("<tool_call>\n<name>python</name>\n</tool_call>")
    assert xml[0].error and "<function=NAME>" in xml[0].error
    # cut by the length limit: not a call
    assert TOOL_CALL_PARSERS.get("qwen3_coder")("<tool_call>\n<function=python>\n") == []


@pytest.mark.parametrize("fmt", ["hermes", "qwen3_coder", "llama3_json"])
def test_tool_agent_runs_a_call_in_the_family_format_token_in_token_out(fmt, tiny_model):
    template, eos, extra = FAMILIES[fmt]
    tok = family_tokenizer(tiny_model, template, eos, extra)
    call = {
        "qwen3_coder": "<tool_call>\n<function=python>\n<parameter=code>\nprint(6 * 7)\n"
        "</parameter>\n</function>\n</tool_call>",
        "llama3_json": '{"name": "python", "parameters": {"code": "print(6 * 7)"}}',
        "hermes": '<tool_call>\n{"name": "python", "arguments": {"code": "print(6 * 7)"}}\n'
        "</tool_call>",
    }[fmt]
    model = ScriptedRollout(tok, lambda s, k: [call, "It is 42."][k])
    tool = Recorder()
    loop = EPISODES.get("tool_agent")(
        tok, AgentLoopConfig(max_turns=3, tool_call_format=fmt), {"python": tool}
    )
    question = [{"role": "user", "content": "What is 6 times 7?"}]
    traj = asyncio.run(loop.run(model, Prompt(question, sample_id="s0"), GREEDY))
    assert tool.calls == [{"code": "print(6 * 7)"}]
    assert (traj.num_turns, traj.tool_calls, traj.finish_reason) == (2, 1, "stop")
    (_, _, g0), (_, ctx1, g1) = model.requests
    assert ctx1 == traj.prompt_ids + traj.response_ids[: len(ctx1) - len(traj.prompt_ids)]
    assert traj.response_ids[: len(g0.response_ids)] == g0.response_ids
    assert traj.response_ids[-len(g1.response_ids) :] == g1.response_ids
    # the tokens are the template's own rendering of the transcript (the tool turn appended
    # as the template's delta, never re-tokenised)
    schema = [tool.schema()]
    rendered = tok.apply_chat_template(traj.messages, tools=schema, tokenize=False)
    decoded = tok.decode(traj.prompt_ids + traj.response_ids, skip_special_tokens=False)
    assert rendered.startswith(decoded) and rendered[len(decoded) :] in ("", "\n")
    assert [m["role"] for m in traj.messages] == ["user", "assistant", "tool", "assistant"]
    assert traj.messages[2]["content"] == "42"


def test_a_template_that_is_not_append_only_is_refused_naming_model_and_turn(tiny_model):
    # Mistral's template lists the tools before the *last* user message, so a user turn
    # appended by an interaction moves them: earlier turns render differently.
    template, eos, extra = FAMILIES["mistral"]
    tok = family_tokenizer(tiny_model, template, eos, extra)

    class Ask(Tool):
        name = "ask"
        description = "ask"
        parameters = {"type": "object", "properties": {}}

        async def execute(self, instance_id, arguments):
            return ToolResult("")

    loop = EPISODES.get("environment")(
        tok, AgentLoopConfig(environment="answer_check", max_turns=3), {"ask": Ask()}
    )
    loop.make_environment = lambda: _with_tools(loop)
    model = ScriptedRollout(tok, lambda s, k: "It is 41.")
    item = Prompt(
        [{"role": "user", "content": "6 * 7?"}], interaction_kwargs={"ground_truth": "42"}
    )
    with pytest.raises(ConfigError) as err:
        asyncio.run(loop.run(model, item, GREEDY))
    message = str(err.value)
    assert f"model {tiny_model.path}" in message
    assert (
        "not append-only" in message and "turn 4 ('user' after the assistant's turn 3)" in message
    )
    assert "[AVAILABLE_TOOLS]" in message


def _with_tools(loop):
    """The answer_check user, rendering the loop's tools in the prompt (as a tool-using
    interaction would)."""
    from tephra.episodes.environments import AnswerCheckInteraction

    env = AnswerCheckInteraction(loop.tools, loop.config)
    env.tool_schemas = lambda: [t.schema() for t in loop.tools.values()]
    return env
