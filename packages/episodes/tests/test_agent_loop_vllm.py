"""The tool agent and the LLM judge over the `vllm` backend (one real vLLM CPU server for the
module): a tool turn's follow-up matches the `hf` backend's token for token (nothing
re-tokenised on the server path), and a judge served by that server writes the hf judge's
greedy judgements, with a timeout scoring the counted fallback."""

from __future__ import annotations

import asyncio
import zlib

import pytest
import torch
from transformers import AutoTokenizer

from tephra.episodes.agent import (
    TOOL_CHAT_TEMPLATE,
    AgentLoopConfig,
    Prompt,
)
from tephra.episodes.episode import run_episodes
from tephra.episodes.registry import EPISODES
from tephra.episodes.rewards import RewardInput
from tephra.episodes.rewards.judge import JUDGE_PARSERS, GenerativeJudge, JudgeConfig
from tephra.episodes.tools import PythonTool
from tephra.rollout import RolloutConfig, SamplingParams, ServerLaunch, ServerSettings, get_rollout
from tephra.rollout.testing import ScriptedRollout

pytestmark = [pytest.mark.vllm, pytest.mark.multiproc]

LOGPROB_TOL = 1e-4


@JUDGE_PARSERS.register("test_text_checksum")
def text_checksum(text: str) -> float:
    """A score that is equal for two judgements exactly when their texts are (w.h.p.)."""
    return float(zlib.crc32(text.encode()))


@pytest.fixture(scope="module")
def rollouts(tiny_tied_model, vllm_python):
    """One vLLM server for the module and an `hf` rollout on the same folder."""
    config = RolloutConfig(
        model_path=tiny_tied_model.path,
        max_model_len=512,
        vllm=ServerSettings(python=vllm_python, startup_timeout_s=300, request_timeout_s=120),
    )
    vllm = get_rollout("vllm", config)
    hf = get_rollout("hf", config)
    yield vllm, hf
    vllm.close()
    hf.close()


def test_vllm_agent_loop_tool_turn_matches_hf(rollouts, tiny_tied_model):
    """Turn 0 is a scripted tool call; turn 1 is generated greedily by vLLM and by HF from the
    same token ids (prompt + call + tool-response delta): identical ids and masks, log-probs
    within 1e-4, so nothing was re-tokenised on the server path."""
    vllm, hf = rollouts
    tok = AutoTokenizer.from_pretrained(tiny_tied_model.path)
    tok.chat_template = TOOL_CHAT_TEMPLATE
    call = '<tool_call>{"name": "python", "arguments": {"code": "print(6 * 7)"}}</tool_call>'
    messages = [{"role": "user", "content": "What is 6 times 7?"}]
    trajectories = []
    for backend in (vllm, hf):
        model = ScriptedRollout(tok, lambda s, k: call if k == 0 else None, fallback=backend)
        loop = EPISODES.get("tool_agent")(
            tok, AgentLoopConfig(max_turns=2), {"python": PythonTool(timeout_s=10, memory_mb=256)}
        )
        trajectories.append(
            asyncio.run(
                run_episodes(
                    loop,
                    model,
                    [Prompt(messages, sample_id=f"s{i}") for i in range(3)],
                    SamplingParams(temperature=0.0, max_tokens=96),
                )
            )
        )
    for a, b in zip(*trajectories):
        assert a.num_turns == b.num_turns == 2 and a.tool_calls == 1
        assert a.prompt_ids == b.prompt_ids and a.response_ids == b.response_ids
        assert a.response_mask == b.response_mask and 0 in a.response_mask
        torch.testing.assert_close(
            torch.tensor(a.log_probs),
            torch.tensor(b.log_probs),
            atol=LOGPROB_TOL,
            rtol=0,
        )
        assert "42" in a.messages[2]["content"]


def test_judge_on_the_vllm_server_writes_the_hf_judgements(rollouts, tiny_tied_model):
    """A judge served by the module's running vLLM server (`reward.judge.vllm.url`: no new
    server start) scores as the in-process hf judge: the same greedy judgement texts (their
    checksums), item for item; a timeout below any request's time scores the fallback on
    every item and counts it."""
    vllm, _ = rollouts
    items = [
        RewardInput("chat", f"the answer is {k}", ground_truth=str(k), prompt_str=f"{k} + 0?")
        for k in range(4)
    ]
    common = dict(
        model_path=str(tiny_tied_model.path),
        parser="test_text_checksum",
        max_new_tokens=12,
        max_model_len=512,
        chat_template=False,
    )
    hf_judge = GenerativeJudge(JudgeConfig(**common))
    served = JudgeConfig(
        **common, backend="vllm", vllm=ServerLaunch(url=vllm.urls[0], request_timeout_s=120)
    )
    vllm_judge = GenerativeJudge(served)
    try:
        want = hf_judge.score(items)
        got = vllm_judge.score(items)
        # (the random tiny model writes one text whatever the prompt; not an empty one)
        assert got == want and text_checksum("") not in want
        assert vllm_judge.last_stats.fallbacks == 0
        late = GenerativeJudge(
            JudgeConfig(
                **{**common, "fallback_score": -1.0, "timeout_s": 1e-4},
                backend="vllm",
                vllm=ServerLaunch(url=vllm.urls[0]),
            )
        )
        try:
            assert late.score(items) == [-1.0] * 4
            assert late.last_stats.timeouts == 4 and late.last_status == ["timeout"] * 4
        finally:
            late.close()
        # the judge's server is the module's: closing the judge left it serving
        assert vllm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=2))
    finally:
        hf_judge.close()
        vllm_judge.close()
