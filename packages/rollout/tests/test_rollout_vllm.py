"""The `vllm` backend against a real vLLM CPU server (the environment built by
scripts/build_vllm_env.sh), compared with the `hf` backend on the same weights."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from tephra.rollout import RolloutConfig, RolloutError, SamplingParams, ServerSettings, get_rollout
from tephra.rollout.testing import perturbed_weights

pytestmark = [pytest.mark.vllm, pytest.mark.multiproc]

PROMPTS = [[5, 6, 7], [10, 20, 30, 40, 50, 60, 70], [100]]
LOGPROB_TOL = 1e-4


def server_settings(python: str, **changes) -> ServerSettings:
    return ServerSettings(**{"python": python, "startup_timeout_s": 300, "request_timeout_s": 120,
                             **changes})


@pytest.fixture(scope="module")
def rollouts(tiny_tied_model, vllm_python):
    """One vLLM server for the module (a tied model: the case that needs the untied copy)
    and an `hf` rollout on the same folder."""
    config = RolloutConfig(model_path=tiny_tied_model.path, max_model_len=256,
                           vllm=server_settings(vllm_python))
    vllm = get_rollout("vllm", config)
    hf = get_rollout("hf", config)
    yield vllm, hf
    vllm.close()
    hf.close()


def teacher_forced(model, prompt, response, temperature):
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits / temperature, -1).gather(1, torch.tensor(response)[:, None]).squeeze(1)


def assert_same_greedy(vllm, hf, max_tokens=16):
    sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    a, b = vllm.generate(PROMPTS, sampling), hf.generate(PROMPTS, sampling)
    assert a.response_ids == b.response_ids
    assert a.finish_reasons == b.finish_reasons
    for x, y in zip(a.log_probs, b.log_probs):
        torch.testing.assert_close(torch.tensor(x), torch.tensor(y), atol=LOGPROB_TOL, rtol=0)
    return a


def test_vllm_matches_hf_then_follows_new_weights(rollouts, tiny_tied_model):
    vllm, hf = rollouts
    assert_same_greedy(vllm, hf)

    # sampled tokens: vLLM's log-probs are the temperature-scaled ones HF recomputes
    reference = AutoModelForCausalLM.from_pretrained(tiny_tied_model.path, dtype=torch.float32).eval()
    sampling = SamplingParams(temperature=0.7, max_tokens=12, n=2, seed=3, ignore_eos=True)
    sampled = vllm.generate(PROMPTS, sampling)
    assert sampled.prompt_index == [0, 0, 1, 1, 2, 2]
    assert sampled.response_ids == vllm.generate(PROMPTS, sampling).response_ids  # seeded
    for i in range(len(sampled)):
        assert len(sampled.response_ids[i]) == 12 and sampled.finish_reasons[i] == "length"
        expected = teacher_forced(reference, sampled.prompt_ids[i], sampled.response_ids[i], 0.7)
        torch.testing.assert_close(torch.tensor(sampled.log_probs[i]), expected, atol=LOGPROB_TOL, rtol=0)

    # many requests in flight, sessions pinned: same as the batch call
    async def many():
        return await asyncio.gather(*(
            vllm.agenerate(p, SamplingParams(temperature=0.0, max_tokens=8), session_id=f"t{i % 3}")
            for i, p in enumerate(PROMPTS * 4)
        ))

    singles = asyncio.run(many())
    batch = vllm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=8))
    assert [g.response_ids for g in singles] == batch.response_ids * 4

    # new weights (the trainer exports the tied matrix once, as the embedding)
    new = perturbed_weights(tiny_tied_model.path, seed=9)
    before = batch.response_ids
    start = time.monotonic()
    vllm.update_weights(new)
    reload_s = time.monotonic() - start
    hf.update_weights(new)
    after = assert_same_greedy(vllm, hf, max_tokens=8)
    assert after.response_ids != before
    assert reload_s < 30


def test_vllm_bad_model_path_fails_fast_with_its_log(tmp_path, vllm_python):
    bad = tmp_path / "not-a-model"
    bad.mkdir()
    (bad / "config.json").write_text('{"model_type": "qwen2", "architectures": ["NoSuchForCausalLM"]}')
    config = RolloutConfig(model_path=str(bad), vllm=server_settings(vllm_python, startup_timeout_s=240))
    start = time.monotonic()
    with pytest.raises(RolloutError, match="(?s)vllm server exited during start-up.*Last lines") as info:
        get_rollout("vllm", config)
    assert time.monotonic() - start < 180
    assert "NoSuchForCausalLM" in str(info.value) or "Error" in str(info.value)


def test_vllm_killed_server_gives_an_error_not_a_hang(rollouts):
    vllm, _ = rollouts
    os.killpg(vllm.process.proc.pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(RolloutError, match="vllm server died"):
        vllm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=8))
    with pytest.raises(RolloutError, match="vllm server died"):
        asyncio.run(vllm.agenerate(PROMPTS[0], SamplingParams(max_tokens=4)))
    assert time.monotonic() - start < 10
