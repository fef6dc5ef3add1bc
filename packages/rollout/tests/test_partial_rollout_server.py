"""Partial rollout in the client shared by the server backends, driven through the SGLang
protocol against a stand-in server (SGLang needs a GPU; the real-server check is
`test_rollout_vllm.py::test_vllm_partial_rollout_resumes_under_the_new_weights`).

The stand-in speaks SGLang's native JSON: `/generate` emits one token per step, each a fixed
function of the whole sequence so far (so a resumed sample must equal an uninterrupted one
exactly when the client resubmits prompt + tokens), with log-prob -(version + 1) / 10, where
`/update_weights_from_disk` bumps the version; `/abort_request {"abort_all": true}` ends the
running requests with finish reason `abort` and their tokens so far, as SGLang does."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tephra.rollout import RolloutConfig, RolloutError, SamplingParams, ServerSettings, get_rollout

PROMPTS = [[1, 2, 3], [4, 5]]
MAX_TOKENS = 120


def next_token(ids: list[int]) -> int:
    return (sum(ids) * 31 + len(ids) * 7) % 97


def uninterrupted(prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(next_token(ids))
    return ids[len(prompt) :]


class FakeSglang(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.lock = threading.Lock()
        self.version = 0
        self.aborts = 0
        self.running = 0
        self.tokens = 0
        self.requests: list[tuple[list[int], int]] = []
        """(input_ids, max_new_tokens) of every /generate."""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class Handler(BaseHTTPRequestHandler):
    server: FakeSglang

    def log_message(self, *args) -> None:
        pass

    def reply(self, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self.reply({})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
        fake = self.server
        if self.path == "/generate":
            self.reply(self.generate(body))
        elif self.path == "/abort_request":
            assert body == {"abort_all": True}
            with fake.lock:
                fake.aborts += 1
            self.reply({})
        elif self.path == "/update_weights_from_disk":
            with fake.lock:
                assert fake.running == 0, "weights changed while a request was generating"
                fake.version += 1
            self.reply({"success": True})
        else:  # /flush_cache
            self.reply({})

    def generate(self, body: dict) -> dict:
        fake = self.server
        ids, limit = list(body["input_ids"]), body["sampling_params"]["max_new_tokens"]
        with fake.lock:
            fake.requests.append((list(ids), limit))
            fake.running += 1
            aborts, version = fake.aborts, fake.version
        out, reason = [], {"type": "length", "length": limit}
        try:
            while len(out) < limit:
                time.sleep(0.002)
                if fake.aborts != aborts:
                    reason = {"type": "abort"}
                    break
                out.append(next_token(ids + out))
                with fake.lock:
                    fake.tokens += 1
        finally:
            with fake.lock:
                fake.running -= 1
        log_prob = -(version + 1) / 10
        return {
            "text": "",
            "output_ids": out,
            "meta_info": {
                "finish_reason": reason,
                "output_token_logprobs": [[log_prob, t, None] for t in out],
            },
        }


@pytest.fixture
def served(tiny_model):
    fake = FakeSglang()
    thread = threading.Thread(target=fake.serve_forever, daemon=True)
    thread.start()
    config = RolloutConfig(
        model_path=tiny_model.path,
        max_model_len=256,
        sglang=ServerSettings(url=fake.url, weight_sync="disk", request_timeout_s=60),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # weight_sync=disk warns
        rollout = get_rollout("sglang", config)
    yield fake, rollout
    rollout.close()
    fake.shutdown()
    fake.server_close()


def generate_interrupted(fake, rollout, sampling):
    """`generate(PROMPTS)` in a thread; once the server has made 10 tokens per sample, an
    update to version 1 under `paused()`."""
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(rollout.generate, PROMPTS, sampling)
        while fake.tokens < 10 * len(PROMPTS) * sampling.n:
            assert not future.done(), "generation ended before the update could interrupt it"
            time.sleep(0.005)
        with rollout.paused():
            assert fake.running == 0 and fake.aborts >= 1
            rollout.update_weights([])
            rollout.weight_version = 1
        return future.result(timeout=60)


def test_aborted_samples_resume_from_their_tokens_under_the_new_version(served):
    fake, rollout = served
    rollout.weight_version = 0
    sampling = SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, n=2, seed=7, ignore_eos=True)
    out = generate_interrupted(fake, rollout, sampling)
    assert fake.version == 1
    for i in range(len(out)):
        prompt, tokens, versions = out.prompt_ids[i], out.response_ids[i], out.token_versions[i]
        k = versions.count(0)
        assert 0 < k < MAX_TOKENS
        assert versions == [0] * k + [1] * (MAX_TOKENS - k)
        assert tokens == uninterrupted(prompt, MAX_TOKENS)  # resubmitted as prompt + tokens
        assert out.log_probs[i] == [-0.1] * k + [-0.2] * (MAX_TOKENS - k)
        assert out.finish_reasons[i] == "length"
        assert (prompt + tokens[:k], MAX_TOKENS - k) in fake.requests
    # one request per sample (SGLang's n), then one resubmission per sample
    assert len(fake.requests) == 2 * len(out)


def test_agenerate_resumes_and_untagged_without_a_version(served):
    fake, rollout = served

    async def one():
        return await rollout.agenerate(PROMPTS[0], SamplingParams(max_tokens=MAX_TOKENS))

    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(asyncio.run, one())
        while fake.tokens < 10:
            time.sleep(0.005)
        with rollout.paused():
            rollout.update_weights([])
        gen = future.result(timeout=60)
    assert gen.response_ids == uninterrupted(PROMPTS[0], MAX_TOKENS)
    assert gen.token_versions is None  # the owner set no weight_version
    assert sorted(set(gen.log_probs)) == [-0.2, -0.1]


def test_an_abort_the_rollout_did_not_ask_for_is_an_error(served):
    fake, rollout = served
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(rollout.generate, PROMPTS[:1], SamplingParams(max_tokens=MAX_TOKENS))
        while fake.tokens < 10:
            time.sleep(0.005)
        with fake.lock:
            fake.aborts += 1  # as if another client had called /abort_request
        with pytest.raises(
            RolloutError, match="sglang aborted a sample that this rollout did not pause"
        ):
            future.result(timeout=60)
