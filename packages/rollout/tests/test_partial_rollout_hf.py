"""Partial rollout in the `hf` backend: a weight update under `paused()` interrupts generation
after exactly k tokens (forced from a wrapped forward), and the rows resume. References: an
uninterrupted run, and a plain greedy forward loop over the old and the new weights."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from transformers import AutoModelForCausalLM

from tephra.rollout import RolloutConfig, SamplingParams, get_rollout
from tephra.rollout.testing import perturbed_weights

PROMPTS = [[5, 6, 7], [10, 20, 30, 40, 50, 60, 70]]
MAX_TOKENS, K = 12, 5


@pytest.fixture
def hf(tiny_model):
    rollout = get_rollout("hf", RolloutConfig(model_path=tiny_model.path, max_model_len=128))
    rollout.weight_version = 0
    yield rollout
    rollout.close()


def greedy_loop(model, ids, steps):
    """Greedy tokens and their log-probs by full forward passes, no cache, no padding."""
    ids, tokens, log_probs = list(ids), [], []
    with torch.no_grad():
        for _ in range(steps):
            logp = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), -1)
            token = int(logp.argmax())
            ids.append(token)
            tokens.append(token)
            log_probs.append(float(logp[token]))
    return tokens, log_probs


def generate_interrupted(hf, sampling, new_weights=None, version=0):
    """`hf.generate(PROMPTS)` in a thread, paused after the k-th token for an update that
    loads `new_weights` (None: none) and sets `version`. The k-th forward pass (the first is
    the prefill) waits until the update has asked to pause, so the stop comes right after
    token k."""
    forward, calls, reached = hf.model.forward, [0], threading.Event()

    def counting_forward(*args, **kwargs):
        calls[0] += 1
        if calls[0] == K:
            reached.set()
            while hf._running.is_set():  # until paused() asked in-flight generation to stop
                threading.Event().wait(0.001)
        return forward(*args, **kwargs)

    hf.model.forward = counting_forward
    try:
        with ThreadPoolExecutor(1) as pool:
            future = pool.submit(hf.generate, PROMPTS, sampling)
            assert reached.wait(30)
            with hf.paused():
                if new_weights is not None:
                    hf.update_weights(new_weights)
                hf.weight_version = version
            return future.result(timeout=60)
    finally:
        hf.model.forward = forward


def test_resumed_with_the_same_weights_equals_an_uninterrupted_run(hf):
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    plain = hf.generate(PROMPTS, greedy)
    out = generate_interrupted(hf, greedy)
    assert out.response_ids == plain.response_ids
    for got, want in zip(out.log_probs, plain.log_probs):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-5, rtol=0)
    assert out.token_versions == [[0] * MAX_TOKENS] * len(PROMPTS)
    # sampling: the sampler resumes from its state at the interruption, so the same seed
    # gives the same samples (every row was still running, so the draws line up)
    sampled = SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, ignore_eos=True, seed=3)
    assert (
        generate_interrupted(hf, sampled).response_ids == hf.generate(PROMPTS, sampled).response_ids
    )


def test_resumed_with_new_weights_continues_under_them(hf, tiny_model):
    old = AutoModelForCausalLM.from_pretrained(tiny_model.path, dtype=torch.float32).eval()
    new_weights = perturbed_weights(tiny_model.path, seed=5)
    new = AutoModelForCausalLM.from_pretrained(tiny_model.path, dtype=torch.float32).eval()
    new.load_state_dict(dict(new_weights), strict=False)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    out = generate_interrupted(hf, greedy, new_weights, version=1)
    for i, prompt in enumerate(PROMPTS):
        head, head_lp = greedy_loop(old, prompt, K)
        tail, tail_lp = greedy_loop(new, prompt + head, MAX_TOKENS - K)
        assert out.response_ids[i] == head + tail
        torch.testing.assert_close(
            torch.tensor(out.log_probs[i]), torch.tensor(head_lp + tail_lp), atol=1e-5, rtol=0
        )
        assert out.token_versions[i] == [0] * K + [1] * (MAX_TOKENS - K)
        assert out.finish_reasons[i] == "length"
    # the new model's continuation differs from the old one's (the update mattered)
    assert out.response_ids[0] != greedy_loop(old, PROMPTS[0], MAX_TOKENS)[0]


def test_untagged_without_a_weight_version(tiny_model):
    with get_rollout("hf", RolloutConfig(model_path=tiny_model.path, max_model_len=128)) as hf:
        out = hf.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=4))
    assert out.token_versions is None
