"""The `hf` backend against independent references: `model.generate`, a teacher-forced
forward pass, hand-built layouts."""

from __future__ import annotations

import asyncio
from contextlib import contextmanager

import pytest
import torch
from transformers import AutoModelForCausalLM

from tephra.engine_api.errors import ConfigError, RegistryError
from tephra.rollout import (
    RolloutConfig,
    RolloutError,
    RolloutOutput,
    Sample,
    SamplingParams,
    get_rollout,
)
from tephra.rollout.testing import perturbed_weights, reference_greedy, teacher_forced_log_probs

PROMPTS = [[5, 6, 7], [10, 20, 30, 40, 50, 60, 70], [100]]


@pytest.fixture(scope="module")
def hf(tiny_model):
    rollout = get_rollout("hf", RolloutConfig(model_path=tiny_model.path, max_model_len=128))
    yield rollout
    rollout.close()


@pytest.fixture(scope="module")
def reference(tiny_model):
    return AutoModelForCausalLM.from_pretrained(tiny_model.path, dtype=torch.float32).eval()


def test_greedy_equals_model_generate_and_log_probs_equal_recompute(hf, reference, tiny_model):
    out = hf.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=24))
    assert out.prompt_index == [0, 1, 2]
    for i, prompt in enumerate(PROMPTS):
        expected = reference_greedy(reference, prompt, 24, tiny_model.eos_token_id)
        assert out.response_ids[i] == expected
        assert out.finish_reasons[i] == (
            "stop" if expected[-1] == tiny_model.eos_token_id else "length"
        )
        recomputed = teacher_forced_log_probs(reference, prompt, out.response_ids[i], 0.0)
        torch.testing.assert_close(torch.tensor(out.log_probs[i]), recomputed, atol=1e-5, rtol=0)


def test_sampled_log_probs_are_temperature_scaled_and_untruncated(hf, reference):
    sampling = SamplingParams(
        temperature=0.7, top_k=20, top_p=0.9, max_tokens=20, n=2, seed=11, ignore_eos=True
    )
    out = hf.generate(PROMPTS, sampling)
    assert len(out) == 6 and out.prompt_index == [0, 0, 1, 1, 2, 2]
    for i in range(len(out)):
        prompt, response = out.prompt_ids[i], out.response_ids[i]
        assert len(response) == 20 and out.finish_reasons[i] == "length"
        recomputed = teacher_forced_log_probs(reference, prompt, response, 0.7)
        torch.testing.assert_close(torch.tensor(out.log_probs[i]), recomputed, atol=1e-5, rtol=0)
        # every sampled token lies inside the top-k and inside the top-p nucleus
        ids = torch.tensor([prompt + response])
        with torch.no_grad():
            logits = reference(ids).logits[0, len(prompt) - 1 : -1] / 0.7
        probs = logits.softmax(-1)
        for t, token in enumerate(response):
            p_token = probs[t, token]
            assert int((probs[t] > p_token).sum()) < 20
            assert float(probs[t][probs[t] > p_token].sum()) < 0.9


def test_stop_tokens_max_tokens_n_and_seeds(hf):
    greedy = hf.generate(
        [PROMPTS[1]], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    )
    full = greedy.response_ids[0]
    assert len(full) == 16 and greedy.finish_reasons == ["length"]
    stop = full[5]
    cut = full.index(stop) + 1
    stopped = hf.generate(
        [PROMPTS[1]],
        SamplingParams(temperature=0.0, max_tokens=16, stop_token_ids=(stop,), ignore_eos=True),
    )
    assert stopped.response_ids[0] == full[:cut] and stopped.finish_reasons == ["stop"]
    short = hf.generate(
        [PROMPTS[1]], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    )
    assert short.response_ids[0] == full[:3] and short.finish_reasons == ["length"]

    sampling = SamplingParams(temperature=1.0, max_tokens=12, n=3, seed=7, ignore_eos=True)
    a = hf.generate(PROMPTS[:2], sampling)
    b = hf.generate(PROMPTS[:2], sampling)
    c = hf.generate(PROMPTS[:2], sampling.replace(seed=8))
    assert a.prompt_index == [0, 0, 0, 1, 1, 1]
    assert a.prompt_ids == [PROMPTS[0]] * 3 + [PROMPTS[1]] * 3
    assert a.response_ids == b.response_ids and a.log_probs == b.log_probs
    assert a.response_ids != c.response_ids
    assert len({tuple(r) for r in a.response_ids[:3]}) == 3  # n samples differ


def test_to_batch_layout_by_hand():
    out = RolloutOutput(
        [
            Sample([11, 12], [13, 14, 15], log_probs=[-0.1, -0.2, -0.3], finish_reason="length"),
            Sample([21, 22, 23], [24], log_probs=[-0.4], finish_reason="stop", prompt_index=1),
        ]
    )
    batch = out.to_batch(pad_token_id=0)
    assert batch["input_ids"].tolist() == [[0, 11, 12, 13, 14, 15], [21, 22, 23, 24, 0, 0]]
    assert batch["attention_mask"].tolist() == [[0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]]
    assert batch["position_ids"].tolist() == [[0, 0, 1, 2, 3, 4], [0, 1, 2, 3, 3, 3]]
    assert batch["response_mask"].tolist() == [[0, 0, 0, 1, 1, 1], [0, 0, 0, 1, 0, 0]]
    torch.testing.assert_close(
        batch["rollout_log_probs"],
        torch.tensor([[0, 0, 0, -0.1, -0.2, -0.3], [0, 0, 0, -0.4, 0, 0]]),
    )
    assert batch["prompt_index"].tolist() == [0, 1]


def test_agenerate_batches_concurrent_requests(hf):
    """16 concurrent requests (different prompts and max_tokens) give what `generate` gives
    each alone, in fewer generate calls than requests."""
    prompts = [[5 + i, 6, 7 + 2 * i][: 1 + i % 3] for i in range(16)]
    lengths = [4 + i % 5 for i in range(16)]
    before = hf.batches_run

    async def main():
        return await asyncio.gather(
            *(
                hf.agenerate(p, SamplingParams(temperature=0.0, max_tokens=n), session_id=f"s{i}")
                for i, (p, n) in enumerate(zip(prompts, lengths))
            )
        )

    results = asyncio.run(main())
    assert hf.batches_run - before < 16
    for p, n, got in zip(prompts, lengths, results):
        alone = hf.generate([p], SamplingParams(temperature=0.0, max_tokens=n))
        assert got.response_ids == alone.response_ids[0]
        assert got.finish_reason == alone.finish_reasons[0]
        torch.testing.assert_close(
            torch.tensor(got.log_probs), torch.tensor(alone.log_probs[0]), atol=1e-5, rtol=0
        )
    with pytest.raises(RolloutError, match="n=2"):
        asyncio.run(hf.agenerate([1, 2], SamplingParams(n=2)))


def test_agenerate_keeps_the_event_loop_free(hf):
    """32 trajectories in flight: generation runs off the event loop, so other coroutines
    (a tool, a timer) keep running while the batches generate."""
    ticks = 0

    async def ticker(stop: asyncio.Event):
        nonlocal ticks
        while not stop.is_set():
            ticks += 1
            await asyncio.sleep(0.005)

    async def main():
        stop = asyncio.Event()
        timer = asyncio.create_task(ticker(stop))
        loop = asyncio.get_running_loop()
        start = loop.time()
        results = await asyncio.gather(
            *(
                hf.agenerate(
                    [7, i + 1], SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True)
                )
                for i in range(32)
            )
        )
        elapsed = loop.time() - start
        stop.set()
        await timer
        return results, elapsed

    results, elapsed = asyncio.run(main())
    assert all(len(g.response_ids) == 24 for g in results)
    assert ticks >= max(5, 0.1 * elapsed / 0.005)  # blocked, it would tick once


def test_update_weights_follows_new_weights(tiny_model, tiny_tied_model, tmp_path):
    for model in (tiny_model, tiny_tied_model):
        new = perturbed_weights(model.path, seed=5)
        reference = AutoModelForCausalLM.from_pretrained(model.path, dtype=torch.float32).eval()
        if reference.config.tie_word_embeddings:  # the shared matrix comes once, as the embedding
            assert "lm_head.weight" not in dict(new)
        reference.load_state_dict(dict(new), strict=False)
        with get_rollout("hf", RolloutConfig(model_path=model.path)) as rollout:
            before = rollout.generate(
                PROMPTS, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
            )
            rollout.update_weights(iter(new))
            after = rollout.generate(
                PROMPTS, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
            )
            assert after.response_ids != before.response_ids
            for i, prompt in enumerate(PROMPTS):
                assert after.response_ids[i] == reference_greedy(reference, prompt, 10)
            with pytest.raises(RolloutError, match="not a weight of the rollout model"):
                rollout.update_weights([("model.no_such.weight", torch.zeros(1))])
            with pytest.raises(RolloutError, match="shape"):
                rollout.update_weights([("model.norm.weight", torch.zeros(3))])


def test_bad_input_gives_clear_errors(hf, tiny_model, tmp_path):
    with pytest.raises(ConfigError, match="sampling.top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ConfigError, match="sampling.top_k"):
        SamplingParams(top_k=0)
    with pytest.raises(ConfigError, match="sampling.temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ConfigError, match="sampling.n"):
        SamplingParams(n=0)
    with pytest.raises(ConfigError, match="rollout.dtype"):
        RolloutConfig(model_path=tiny_model.path, dtype="fp8")
    with pytest.raises(ConfigError, match="max_model_len=128"):
        hf.generate([[1] * 100], SamplingParams(max_tokens=64))
    with pytest.raises(ConfigError, match="prompt 1 must be a non-empty"):
        hf.generate([[1], []], SamplingParams(max_tokens=4))
    with pytest.raises(ConfigError, match="outside the vocabulary"):
        hf.generate([[1, 10_000]], SamplingParams(max_tokens=4))
    with pytest.raises(RolloutError, match="multimodal has 2 entries for 1 prompts"):
        hf.generate([[1, 2]], SamplingParams(max_tokens=4), multimodal=[None, None])
    with pytest.raises(RegistryError, match="registered: hf, sglang, vllm"):
        get_rollout("vlm", RolloutConfig(model_path=tiny_model.path))
    with pytest.raises(RolloutError, match="could not load rollout.model_path"):
        get_rollout("hf", RolloutConfig(model_path=str(tmp_path / "missing")))


def test_small_batches_and_dict_settings_give_the_same_samples(hf, tiny_model):
    """Cutting 3 prompts x n=2 into generate calls of 2 rows (settings given as a dict, as
    from YAML) changes nothing for greedy decoding."""
    config = RolloutConfig(model_path=tiny_model.path, max_model_len=128, hf={"max_batch_rows": 2})
    assert config.hf.max_batch_rows == 2
    sampling = SamplingParams(temperature=0.0, max_tokens=10, n=2)
    with get_rollout("hf", config) as small:
        a = small.generate(PROMPTS, sampling)
        small.sleep()  # no-op on CPU: generation still works
        small.wake_up()
        b = hf.generate(PROMPTS, sampling)
        assert a.response_ids == b.response_ids and a.finish_reasons == b.finish_reasons
        for x, y in zip(a.log_probs, b.log_probs):
            torch.testing.assert_close(torch.tensor(x), torch.tensor(y), atol=1e-5, rtol=0)
    with pytest.raises(ConfigError, match="hf.max_batch_rows"):
        RolloutConfig(model_path=tiny_model.path, hf={"max_batch_rows": 0})


@contextmanager
def forward_rows(rollout):
    """Within: the number of rows of each forward pass of the rollout's model."""
    rows = []

    def counting(*args, **kwargs):
        rows.append(int(kwargs["input_ids"].shape[0]))
        return type(rollout.model).forward(rollout.model, *args, **kwargs)

    rollout.model.forward = counting
    try:
        yield rows
    finally:
        del rollout.model.forward


def test_finished_rows_leave_decoding(hf, reference, tiny_model):
    """Rows that finished (a stop token or their own budget) are dropped from decoding once a
    quarter of the batch has: greedy outputs equal the keep-every-row path's, sampled tokens'
    log-probs equal a teacher-forced forward, and later forward passes see fewer rows."""
    config = RolloutConfig(
        model_path=tiny_model.path, max_model_len=128, hf={"drop_finished_fraction": 1.0}
    )
    prompts = [[5, 6, 7], [10, 20, 30, 40, 50, 60, 70], [100], [7, 8], [9], [11, 12, 13, 14]]
    full = hf.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    # stop tokens that end rows at different steps
    stops = tuple({full.response_ids[0][2], full.response_ids[3][6], full.response_ids[5][9]})
    greedy = SamplingParams(temperature=0.0, max_tokens=16, stop_token_ids=stops, ignore_eos=True)
    with get_rollout("hf", config) as keep_all, forward_rows(keep_all) as kept_rows:
        want = keep_all.generate(prompts, greedy)
    with forward_rows(hf) as dropped_rows:
        got = hf.generate(prompts, greedy)
    assert got.response_ids == want.response_ids and got.finish_reasons == want.finish_reasons
    assert len(set(map(len, got.response_ids))) > 2  # the rows did finish at different steps
    for x, y in zip(got.log_probs, want.log_probs):
        torch.testing.assert_close(torch.tensor(x), torch.tensor(y), atol=1e-5, rtol=0)
    assert set(kept_rows) == {len(prompts)}  # every forward computes every row
    assert len(dropped_rows) == len(kept_rows)  # one forward per token either way
    assert dropped_rows == sorted(dropped_rows, reverse=True) and dropped_rows[-1] < len(prompts)
    assert sum(dropped_rows) < sum(kept_rows)
    sampled = hf.generate(
        prompts,
        SamplingParams(
            temperature=1.0, max_tokens=16, n=3, seed=4, stop_token_ids=tuple(range(20, 40))
        ),
    )
    assert len(set(map(len, sampled.response_ids))) > 1
    for i in range(len(sampled)):
        recomputed = teacher_forced_log_probs(
            reference, sampled.prompt_ids[i], sampled.response_ids[i], 1.0
        )
        torch.testing.assert_close(
            torch.tensor(sampled.log_probs[i]), recomputed, atol=1e-5, rtol=0
        )
    with pytest.raises(ConfigError, match="hf.drop_finished_fraction"):
        RolloutConfig(model_path=tiny_model.path, hf={"drop_finished_fraction": 0})
    with pytest.raises(ConfigError, match="hf.cpu_linear='mkl'; choose 'auto'"):
        RolloutConfig(model_path=tiny_model.path, hf={"cpu_linear": "mkl"})


def test_inverse_cdf_sampling_draws_the_softmax_distribution():
    """The sampler behind `hf` sampling: 20k draws per row match softmax(logits) within 1.5
    points per token (binomial sd <= 0.35 points), and -inf (truncated) tokens never come."""
    from tephra.rollout.backends.sampling_processor import sample_rows

    inf = float("inf")
    rows = torch.tensor([[0.0, 1.0, -inf, 2.0, -1.0], [5.0, -inf, -inf, 0.0, 0.5]])
    torch.manual_seed(0)
    tokens = sample_rows(rows.repeat(20_000, 1)).view(20_000, 2)
    for r in range(2):
        freq = torch.bincount(tokens[:, r], minlength=5).double() / 20_000
        torch.testing.assert_close(freq, torch.softmax(rows[r].double(), -1), atol=0.015, rtol=0)
        assert freq[rows[r] == -inf].sum() == 0


def test_sampling_at_a_49k_vocabulary_with_a_long_tail():
    """At SmolLM2's vocabulary size (49,152: 192 blocks) with a Zipf-like row whose tail
    beyond the top 1000 tokens holds a third of the mass, 40k draws give a mean log-prob of
    the sampled token equal to minus the entropy, and the tail its share, both within 4
    standard errors: the sampler neither favours likely tokens nor drops the long tail."""
    from tephra.rollout.backends.sampling_processor import sample_probs

    vocab, draws = 49_152, 40_000
    gen = torch.Generator().manual_seed(0)
    noise = torch.randn(vocab, generator=gen, dtype=torch.float64)
    logits = -1.05 * torch.arange(1, vocab + 1).double().log() + 0.3 * noise
    logits = logits[torch.randperm(vocab, generator=gen)]  # likely tokens in every block
    logp = torch.log_softmax(logits, -1)
    probs = logp.exp()
    tail = torch.zeros(vocab, dtype=torch.bool)
    tail[probs.argsort(descending=True)[1000:]] = True
    assert 0.25 < probs[tail].sum() < 0.45
    torch.manual_seed(2)
    rows = probs.float().expand(4_000, vocab)
    tokens = torch.cat([sample_probs(rows) for _ in range(draws // 4_000)])
    sampled = logp[tokens]
    entropy = -(probs * logp).sum()
    assert abs(sampled.mean() + entropy) < 4 * sampled.std() / draws**0.5
    share, p_tail = tail[tokens].double().mean(), probs[tail].sum()
    assert abs(share - p_tail) < 4 * (p_tail * (1 - p_tail) / draws) ** 0.5


def test_two_level_sampling_across_blocks():
    """`sample_probs` picks a block of 256 tokens, then a token in it: over a 600-token
    vocabulary (3 blocks, the last one padded) with a whole block at 0 and mass at both
    ends of each block, 40k draws match the probabilities within 1 point, zeros never."""
    from tephra.rollout.backends.sampling_processor import SAMPLE_BLOCK, sample_probs

    assert SAMPLE_BLOCK == 256
    probs = torch.zeros(600)
    probs[[0, 255, 512, 599]] = torch.tensor([0.1, 0.3, 0.2, 0.25])
    probs[513:520] = 0.15 / 7  # block 1 (256..511) stays empty
    torch.manual_seed(1)
    tokens = sample_probs((probs * 3).repeat(40_000, 1))  # unnormalised rows are fine
    freq = torch.bincount(tokens, minlength=600).double() / 40_000
    torch.testing.assert_close(freq, probs.double(), atol=0.01, rtol=0)
    assert freq[probs == 0].sum() == 0


@pytest.mark.parametrize("top", [{}, {"top_k": 20, "top_p": 0.9}])
def test_samples_do_not_depend_on_how_prompts_are_split(hf, tiny_model, top):
    """Sample j of prompt i draws from its own generator (seed + i*n + j): 8 prompts of
    different lengths as one call, as 2 and as 4 shares (`for_share`), and with 3 rows per
    generate call give the same samples; rows finish at different steps,
    so finished rows leave decoding at different points in each split.

    Tokens are compared bitwise; log-probs to 2e-6 (float32 rounding: the softmax reductions
    run over a padded width that depends on the batch's longest prompt)."""
    prompts = [[5 + i, 6, 7 + 2 * i, 9, 11 + i][: 1 + i % 5] for i in range(8)]
    sampling = SamplingParams(
        temperature=1.0, max_tokens=14, n=2, seed=123, stop_token_ids=tuple(range(20, 45)), **top
    )
    whole = hf.generate(prompts, sampling)
    assert len(set(map(len, whole.response_ids))) > 2
    config = RolloutConfig(model_path=tiny_model.path, max_model_len=128, hf={"max_batch_rows": 3})
    with get_rollout("hf", config) as small:
        runs = {"rows3": small.generate(prompts, sampling)}
    for shares in (2, 4):
        size = len(prompts) // shares
        parts = [
            hf.generate(prompts[k * size : (k + 1) * size], sampling.for_share(k * size))
            for k in range(shares)
        ]
        runs[f"{shares} shares"] = RolloutOutput([s for p in parts for s in p.samples])
    for name, run in runs.items():
        assert run.prompt_ids == whole.prompt_ids, name
        assert run.response_ids == whole.response_ids, name
        torch.testing.assert_close(
            torch.tensor(sum(run.log_probs, [])),
            torch.tensor(sum(whole.log_probs, [])),
            atol=2e-6,
            rtol=0,
        )
        assert run.finish_reasons == whole.finish_reasons, name
    # a different seed gives different samples; the two samples of a prompt differ
    other = hf.generate(prompts, sampling.replace(seed=124))
    assert other.response_ids != whole.response_ids
    assert sum(whole.response_ids[2 * i] != whole.response_ids[2 * i + 1] for i in range(8)) >= 4
