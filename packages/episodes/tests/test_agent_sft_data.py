"""The synthetic SFT transcripts of examples/tools replay exactly through `tool_agent` with the
real python sandbox: the tool turns a model learns from are the ones it will see in RL, and the
token ids of the replay equal the SFT rendering of the transcript."""

from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path

from transformers import AutoTokenizer

from tephra.episodes.agent import TOOL_CHAT_TEMPLATE, AgentLoopConfig, Prompt
from tephra.episodes.registry import EPISODES
from tephra.episodes.tools import PythonTool
from tephra.rollout import SamplingParams
from tephra.rollout.testing import ReplayRollout

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "tools" / "make_tool_sft_data.py"


def load_example():
    spec = importlib.util.spec_from_file_location("make_tool_sft_data", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_transcripts_replay_exactly_through_the_sandbox(tiny_model):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model.path)
    tokenizer.chat_template = TOOL_CHAT_TEMPLATE
    python = PythonTool(timeout_s=5, memory_mb=256)
    for transcript in load_example().tool_call_transcripts(3, seed=1):
        turns = [m["content"] for m in transcript if m["role"] == "assistant"]
        loop = EPISODES.get("tool_agent")(
            tokenizer, AgentLoopConfig(render_tool_schemas=False), {"python": python}
        )
        traj = asyncio.run(
            loop.run(
                ReplayRollout(tokenizer, turns),
                Prompt(transcript[:2]),
                SamplingParams(temperature=0.0, max_tokens=200),
            )
        )
        replayed = [{k: m[k] for k in ("role", "content")} for m in traj.messages]
        assert replayed == transcript
        sft_text = tokenizer.apply_chat_template(transcript, tokenize=False)
        decoded = tokenizer.decode(traj.prompt_ids + traj.response_ids, skip_special_tokens=False)
        assert decoded + "\n" == sft_text
        # and the same ids as tokenising the SFT text in one piece (no boundary merges)
        sft_ids = tokenizer.encode(sft_text, add_special_tokens=False)
        assert traj.prompt_ids + traj.response_ids == sft_ids[:-1]
        assert (traj.num_turns, traj.tool_calls, traj.tool_errors) == (2, 1, 0)
