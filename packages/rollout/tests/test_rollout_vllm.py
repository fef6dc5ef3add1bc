"""The `vllm` backend against a real vLLM CPU server (the environment built by
scripts/build_vllm_env.sh), compared with the `hf` backend on the same weights."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from tephra.engine_api.errors import ConfigError
from tephra.rollout import (
    RolloutConfig,
    RolloutError,
    SamplingParams,
    ServerDiedError,
    ServerSettings,
    get_rollout,
)
from tephra.rollout.testing import perturbed_weights

pytestmark = [pytest.mark.vllm, pytest.mark.multiproc]

PROMPTS = [[5, 6, 7], [10, 20, 30, 40, 50, 60, 70], [100]]
LOGPROB_TOL = 1e-4
BUCKET_MB = 0.05
"""Smaller than the tiny model (~0.5 MB): every update takes several buckets."""


def server_settings(python: str, **changes) -> ServerSettings:
    return ServerSettings(
        **{"python": python, "startup_timeout_s": 300, "request_timeout_s": 120, **changes}
    )


@pytest.fixture(scope="module")
def rollouts(tiny_tied_model, vllm_python):
    """One vLLM server for the module (a tied model: the case that needs the untied copy)
    and an `hf` rollout on the same folder."""
    config = RolloutConfig(
        model_path=tiny_tied_model.path,
        max_model_len=512,
        # a key made for the run: every test below also goes through tephra's route guard
        vllm=server_settings(vllm_python, weight_bucket_mb=BUCKET_MB, api_key="auto"),
    )
    vllm = get_rollout("vllm", config)
    hf = get_rollout("hf", config)
    yield vllm, hf
    vllm.close()
    hf.close()


def teacher_forced(model, prompt, response, temperature):
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1]
    return (
        torch.log_softmax(logits / temperature, -1)
        .gather(1, torch.tensor(response)[:, None])
        .squeeze(1)
    )


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
    reference = AutoModelForCausalLM.from_pretrained(
        tiny_tied_model.path, dtype=torch.float32
    ).eval()
    sampling = SamplingParams(temperature=0.7, max_tokens=12, n=2, seed=3, ignore_eos=True)
    sampled = vllm.generate(PROMPTS, sampling)
    assert sampled.prompt_index == [0, 0, 1, 1, 2, 2]
    assert sampled.response_ids == vllm.generate(PROMPTS, sampling).response_ids  # seeded
    for i in range(len(sampled)):
        assert len(sampled.response_ids[i]) == 12 and sampled.finish_reasons[i] == "length"
        expected = teacher_forced(reference, sampled.prompt_ids[i], sampled.response_ids[i], 0.7)
        torch.testing.assert_close(
            torch.tensor(sampled.log_probs[i]), expected, atol=LOGPROB_TOL, rtol=0
        )

    # many requests in flight, sessions pinned: same as the batch call
    async def many():
        return await asyncio.gather(
            *(
                vllm.agenerate(
                    p, SamplingParams(temperature=0.0, max_tokens=8), session_id=f"t{i % 3}"
                )
                for i, p in enumerate(PROMPTS * 4)
            )
        )

    singles = asyncio.run(many())
    batch = vllm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=8))
    assert [g.response_ids for g in singles] == batch.response_ids * 4

    # new weights in memory, in several buckets (the trainer exports the tied matrix once, as
    # the embedding); nothing is written to the weights folder
    files_before = sorted(p.name for p in vllm.weights_dir.iterdir())
    new = list(perturbed_weights(tiny_tied_model.path, seed=9))
    before = batch.response_ids
    vllm.update_weights(iter(new))
    hf.update_weights(new)
    stats = vllm.last_update_stats
    assert stats["buckets"] >= 4 and stats["max_bucket_bytes"] <= max(
        BUCKET_MB * 1024**2, max(t.numel() * 4 for _, t in new)
    )
    assert stats["bytes"] == sum(t.numel() * 4 for _, t in new) + new[0][1].numel() * 4  # + head
    assert sorted(p.name for p in vllm.weights_dir.iterdir()) == files_before
    key = {"Authorization": f"Bearer {vllm._api_key}"}
    info = httpx.get(vllm.urls[0] + "/weight_info", headers=key).json()
    assert info == {"weight_version": "1"}
    after = assert_same_greedy(vllm, hf, max_tokens=8)
    assert after.response_ids != before

    # the disk fallback reaches the same server (reload from safetensors)
    vllm.settings.weight_sync = "disk"
    try:
        newer = list(perturbed_weights(tiny_tied_model.path, seed=11))
        vllm.update_weights(newer)
        hf.update_weights(newer)
        assert any(p.name.startswith("update-") for p in vllm.weights_dir.iterdir())
        assert assert_same_greedy(vllm, hf, max_tokens=8).response_ids != after.response_ids
    finally:
        vllm.settings.weight_sync = "memory"

    # ipc: each bucket as a handle the server's plugin opens (CPU shared memory here, CUDA
    # IPC on a GPU: the same code), through the same four-phase protocol; nothing on disk
    files_before = sorted(p.name for p in vllm.weights_dir.iterdir())
    vllm.transport = "ipc"
    try:
        newest = list(perturbed_weights(tiny_tied_model.path, seed=13))
        vllm.update_weights(iter(newest))
        hf.update_weights(newest)
        assert vllm.last_update_stats["buckets"] >= 4
        assert sorted(p.name for p in vllm.weights_dir.iterdir()) == files_before
        assert httpx.get(vllm.urls[0] + "/weight_info", headers=key).json() == {
            "weight_version": "3"
        }
        last = assert_same_greedy(vllm, hf, max_tokens=8)
        assert last.response_ids not in (after.response_ids, before)
    finally:
        vllm.transport = "gloo"
    assert vllm.calls["update_weights"] == vllm.update_count == 3


TRIES = 16
"""Delays tried before the partial-rollout test gives up catching every sample mid-way."""


def test_vllm_partial_rollout_resumes_under_the_new_weights(rollouts, tiny_tied_model):
    """A weight update under `paused()` while `generate` runs (sampled, n=2): the server aborts
    the requests, each sample keeps the tokens it had and goes on under the new weights. Each
    token is tagged with the version that produced it, and its log-prob equals a teacher-forced
    forward under that version's weights (fp32, within LOGPROB_TOL = 1e-4, as above)."""
    vllm, _ = rollouts
    weights = {
        v: list(perturbed_weights(tiny_tied_model.path, seed=21 + v)) for v in range(TRIES + 1)
    }
    models = {}
    for version, named in weights.items():
        models[version] = AutoModelForCausalLM.from_pretrained(
            tiny_tied_model.path, dtype=torch.float32
        ).eval()
        models[version].load_state_dict(dict(named), strict=False)
    sampling = SamplingParams(temperature=0.7, max_tokens=400, n=2, seed=5, ignore_eos=True)
    vllm.update_weights(weights[0])
    vllm.weight_version = 0
    tried, delay, early, late = [], 1.0, 0.0, None
    try:
        # The update lands `delay` seconds after the requests went out. The server's token
        # counter (/metrics) lags by seconds, too late on a fast machine, so the delay is
        # searched instead: between the last too early (a sample had not begun) and the last
        # too late (one had finished). Under load the window can be a fraction of a second
        # wide; on an idle machine a fraction of a millisecond (seen: a sample not begun at
        # 0.24 ms, every one finished at 0.61 ms), hence up to TRIES tries.
        for version in range(1, TRIES + 1):
            with ThreadPoolExecutor(1) as pool:
                future = pool.submit(vllm.generate, PROMPTS, sampling)
                while vllm._in_flight < len(PROMPTS) and not future.done():
                    time.sleep(0.001)
                time.sleep(delay)
                with vllm.paused():
                    assert vllm._in_flight == 0  # every request came back before the update
                    vllm.update_weights(weights[version])
                    vllm.weight_version = version
                out = future.result(timeout=300)
            cut = [v.count(version - 1) for v in out.token_versions]
            tried.append((delay, cut))
            if all(0 < k < sampling.max_tokens for k in cut):
                break
            if max(cut) == sampling.max_tokens:
                late = delay
            else:
                early = delay
            delay = delay * 3 if late is None else (early + late) / 2 if early else late / 4
    finally:
        vllm.weight_version = None
    assert all(0 < k < sampling.max_tokens for k in cut), f"not caught mid-way: {tried}"
    old, new = version - 1, version
    assert out.prompt_index == [0, 0, 1, 1, 2, 2]
    for i in range(len(out)):
        tokens, versions, k = out.response_ids[i], out.token_versions[i], cut[i]
        assert versions == [old] * k + [new] * (sampling.max_tokens - k)
        assert len(tokens) == sampling.max_tokens and out.finish_reasons[i] == "length"
        prompt, got = out.prompt_ids[i], torch.tensor(out.log_probs[i])
        under = {v: teacher_forced(models[v], prompt, tokens, 0.7) for v in (old, new)}
        torch.testing.assert_close(got[:k], under[old][:k], atol=LOGPROB_TOL, rtol=0)
        torch.testing.assert_close(got[k:], under[new][k:], atol=LOGPROB_TOL, rtol=0)
        # the resumed tokens were not produced by the old weights
        assert (got[k:] - under[old][k:]).abs().max() > 100 * LOGPROB_TOL
    assert not vllm._in_flight and vllm._open.is_set()  # generation is open again
    untagged = vllm.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=4))
    assert untagged.token_versions is None


def test_vllm_server_demands_the_run_key_on_every_route_but_health(rollouts):
    """vLLM's own --api-key leaves dev routes open; tephra's guard closes all of them. The
    client (which generated above) holds the key; the key is on no command line."""
    vllm, _ = rollouts
    url = vllm.urls[0]
    assert httpx.get(url + "/health", timeout=10).status_code == 200
    for method, path in [
        ("GET", "/is_sleeping"),  # a dev route
        ("POST", "/collective_rpc"),  # a dev route that runs methods on the workers
        ("POST", "/v1/completions"),
        ("GET", "/v1/models"),
    ]:
        assert httpx.request(method, url + path, timeout=10).status_code == 401, path
        wrong = {"Authorization": "Bearer not-the-key"}
        assert httpx.request(method, url + path, headers=wrong, timeout=10).status_code == 401
    right = {"Authorization": f"Bearer {vllm._api_key}"}
    assert httpx.get(url + "/is_sleeping", headers=right, timeout=10).status_code == 200
    assert vllm._api_key not in " ".join(vllm.process.command)
    assert "--middleware" in vllm.process.command


def test_server_host_beyond_loopback_needs_a_key():
    with pytest.raises(ConfigError, match="host='0.0.0.0' lets other machines.*api_key=auto"):
        ServerSettings(host="0.0.0.0")
    with pytest.raises(ConfigError, match="with url, give the key"):
        ServerSettings(url="http://10.0.0.5:8000", api_key="auto")
    with pytest.raises(ConfigError, match="api_key is empty"):
        ServerSettings(api_key=" ")
    assert ServerSettings(host="0.0.0.0", api_key="auto").api_key == "auto"
    assert ServerSettings(host="::1").api_key is None  # loopback: no key needed


def test_vllm_sleep_is_refused_on_cpu_before_start(tiny_tied_model, vllm_python):
    config = RolloutConfig(
        model_path=tiny_tied_model.path, vllm=server_settings(vllm_python, sleep_level=1)
    )
    with pytest.raises(ConfigError, match="vllm.sleep_level=1: vLLM's CPU build"):
        get_rollout("vllm", config)


def test_vllm_bad_model_path_fails_fast_with_its_log(tmp_path, vllm_python):
    bad = tmp_path / "not-a-model"
    bad.mkdir()
    (bad / "config.json").write_text(
        '{"model_type": "qwen2", "architectures": ["NoSuchForCausalLM"]}'
    )
    config = RolloutConfig(
        model_path=str(bad), vllm=server_settings(vllm_python, startup_timeout_s=240)
    )
    start = time.monotonic()
    with pytest.raises(
        RolloutError, match="(?s)vllm server exited during start-up.*Last lines"
    ) as info:
        get_rollout("vllm", config)
    assert time.monotonic() - start < 180
    assert "NoSuchForCausalLM" in str(info.value) or "Error" in str(info.value)


def test_vllm_killed_server_gives_an_error_not_a_hang(rollouts):
    vllm, _ = rollouts
    os.killpg(vllm.process.proc.pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(ServerDiedError, match="vllm server died"):
        vllm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=8))
    with pytest.raises(ServerDiedError, match="vllm server died"):
        asyncio.run(vllm.agenerate(PROMPTS[0], SamplingParams(max_tokens=4)))
    assert time.monotonic() - start < 10
