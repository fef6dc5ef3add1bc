"""A real model drives `tool_agent`: a tiny Qwen2 fine-tuned with apps/sft (through Ray and the
FSDP engine) on the synthetic tool-call transcripts of packages/episodes/examples/tools emits
`<tool_call>{...}</tool_call>`, the real python sandbox runs it, and the trajectory is checked
against independent references: the ids each `agenerate` call returned (mask 1 exactly there),
the chat template's tool-turn text written out by hand (mask 0 exactly there), a plain
transformers forward pass (the rollout log-probs), the transcript the model was trained on
(turns, calls, tool output) and the chat template's rendering of the messages (re-decoding).

The model overfits a few seeded transcripts (greedy decoding), so the run is deterministic."""

from __future__ import annotations

import asyncio
import importlib.util
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tephra.episodes.agent import (
    TOOL_CHAT_TEMPLATE,
    AgentLoopConfig,
    Prompt,
)
from tephra.episodes.episode import run_episodes
from tephra.episodes.registry import EPISODES
from tephra.episodes.tools import PythonTool
from tephra.rollout import RolloutConfig, SamplingParams, get_rollout, to_batch
from tephra.rollout.testing import build_tiny_model

EXAMPLE = (
    Path(__file__).resolve().parents[1]
    / "packages"
    / "episodes"
    / "examples"
    / "tools"
    / "make_tool_sft_data.py"
)
N_TRANSCRIPTS = 4
"""Training transcripts, also the agent's prompts: few enough for a 2-layer model to learn
exactly in a few dozen steps (the point is the agent loop, not generalisation)."""
SFT_STEPS = 60
SFT_LR = 3e-3


def load_example():
    spec = importlib.util.spec_from_file_location("make_tool_sft_data", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def sft_model(tmp_path_factory):
    """(base model folder, exported SFT folder, training transcripts, apps/sft summary)."""
    import ray

    from tephra.apps.sft.main import parse_config, run
    from tephra.controller.cluster.worker_group import ray_init

    root = tmp_path_factory.mktemp("agent_tool_sft")
    base = build_tiny_model(root / "base", seed=0)
    tokenizer = AutoTokenizer.from_pretrained(base.path)
    # SFT and the agent loop must render with the same template: save it with the model
    tokenizer.chat_template = TOOL_CHAT_TEMPLATE
    tokenizer.save_pretrained(base.path)
    transcripts = load_example().tool_call_transcripts(N_TRANSCRIPTS, seed=0)
    data = root / "tool_calls.jsonl"
    data.write_text("".join(json.dumps({"messages": m}) + "\n" for m in transcripts))
    ray_init(num_cpus=2)
    try:
        summary = run(
            parse_config(
                [
                    "-p",
                    "smoke",
                    f"model.path={base.path}",
                    f"data.train_files=[{data}]",
                    f"train.steps={SFT_STEPS}",
                    f"train.sequences_per_step={N_TRANSCRIPTS}",
                    f"policy.optimizer.lr={SFT_LR}",
                    # the loss is measured on the training transcripts themselves
                    f"data.val_files=[{data}]",
                    f"train.run_dir={root / 'sft'}",
                ]
            )
        )
    finally:
        ray.shutdown()
    return base.path, root / "sft" / "hf", transcripts, summary


class RecordingRollout:
    """The real hf rollout, with every generation of each trajectory kept (in call order)."""

    def __init__(self, rollout):
        self.rollout, self.config, self.generations = rollout, rollout.config, {}

    async def agenerate(self, prompt_ids, sampling, session_id=None):
        gen = await self.rollout.agenerate(prompt_ids, sampling, session_id=session_id)
        self.generations.setdefault(session_id, []).append((list(prompt_ids), gen))
        return gen


def tool_turn_text(output: str) -> str:
    """What TOOL_CHAT_TEMPLATE writes after a model turn's <|im_end|> for one tool message,
    up to the next assistant header (written out by hand from the template)."""
    return (
        f"\n<|im_start|>user\n<tool_response>\n{output}\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )


@pytest.mark.multiproc
def test_sft_model_calls_the_python_tool_through_tool_agent(sft_model):
    base, folder, transcripts, summary = sft_model
    assert summary["loss_after"] < 0.05 * summary["loss_before"], summary
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert tokenizer.chat_template == TOOL_CHAT_TEMPLATE  # exported with the model
    eos, call_token = tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<tool_call>")

    python = PythonTool(timeout_s=10, memory_mb=256)
    samples = [Prompt(t[:2], sample_id=f"s{i}") for i, t in enumerate(transcripts)]

    def agent_run(model_path, samples):
        rollout = RecordingRollout(
            get_rollout("hf", RolloutConfig(model_path=str(model_path), max_model_len=1024))
        )
        loop = EPISODES.get("tool_agent")(
            tokenizer,
            AgentLoopConfig(max_turns=3, max_response_tokens=384, render_tool_schemas=False),
            {"python": python},
        )
        try:
            return rollout, asyncio.run(
                run_episodes(loop, rollout, samples, SamplingParams(temperature=0.0, max_tokens=96))
            )
        finally:
            rollout.rollout.close()

    # baseline: before SFT the same loop gets no working tool call out of the model
    _, before = agent_run(base, samples[:1])
    assert before[0].tool_calls == before[0].tool_errors, before[0].messages

    rollout, trajectories = agent_run(folder, samples)

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    for transcript, traj in zip(transcripts, trajectories):
        sid = traj.sample_id
        messages = [{k: m[k] for k in ("role", "content")} for m in traj.messages]
        # the model learned the transcript: a python call, its printed result, the answer
        assert messages == transcript, (sid, messages)
        assert (traj.num_turns, traj.tool_calls, traj.tool_errors) == (2, 1, 0), sid
        assert traj.num_turns == sum(m["role"] == "assistant" for m in messages[2:])
        assert traj.tool_calls == sum(m["role"] == "tool" for m in messages)
        assert traj.finish_reason == "stop"
        # independent reference of the expected tool output: evaluate the training expression
        expression = transcript[1]["content"].removeprefix("Calculate ").removesuffix(".")
        output = f"{eval(expression)}\n"  # noqa: S307 - our own seeded "a op b"
        assert messages[3]["content"] == output

        # mask 1 exactly on the ids the rollout generated, 0 exactly on the tool turn's ids
        gens = rollout.generations[sid]
        assert len(gens) == traj.num_turns
        first, second = gens[0][1].response_ids, gens[1][1].response_ids
        assert call_token in first and first[-1] == eos and second[-1] == eos
        tool_ids = traj.response_ids[len(first) : len(traj.response_ids) - len(second)]
        assert traj.response_ids == first + tool_ids + second
        assert traj.response_mask == [1] * len(first) + [0] * len(tool_ids) + [1] * len(second)
        assert tokenizer.decode(tool_ids, skip_special_tokens=False) == tool_turn_text(output)
        # token in, token out: the second turn was prompted with exactly the earlier ids
        assert gens[1][0] == traj.prompt_ids + first + tool_ids
        assert traj.log_probs[len(first) : len(first) + len(tool_ids)] == [0.0] * len(tool_ids)

        # re-decoding the ids gives the chat template's rendering of the messages
        decoded = tokenizer.decode(traj.prompt_ids + traj.response_ids, skip_special_tokens=False)
        assert decoded + "\n" == tokenizer.apply_chat_template(traj.messages, tokenize=False)
        assert output in decoded

        # rollout log-probs of the generated tokens == a plain transformers forward pass
        ids = torch.tensor([traj.prompt_ids + traj.response_ids])
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
        ref = logp.gather(-1, ids[0, 1:, None])[len(traj.prompt_ids) - 1 :, 0]
        got = torch.tensor(traj.log_probs)
        on = torch.tensor(traj.response_mask, dtype=torch.bool)
        torch.testing.assert_close(got[on], ref[on], atol=2e-4, rtol=0)
        # greedy: each generated token is the argmax of the reference distribution
        argmax = logp.argmax(-1)[len(traj.prompt_ids) - 1 :]
        assert torch.equal(argmax[on], ids[0, len(traj.prompt_ids) :][on])

    # the padded training batch keeps the masks and counts
    batch = to_batch(trajectories, pad_token_id=tokenizer.pad_token_id, agent_stats=True)
    assert batch["num_turns"].tolist() == [2] * N_TRANSCRIPTS
    assert batch["tool_calls"].tolist() == [1] * N_TRANSCRIPTS
    assert int(batch["response_mask"].sum()) == sum(sum(t.response_mask) for t in trajectories)
