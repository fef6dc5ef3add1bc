"""The colocated worker's sleep, wake and sync order against a recording stand-in server
(`packages/rollout/tests/weight_receiver.py`; vLLM's CPU build refuses sleep mode): a
sync wakes the weights, loads, then wakes the KV cache; a generation after a level-2 sleep
with no sync since (validation, a dynamic-sampling round) first sends the weights again."""

from __future__ import annotations

import contextlib
import io
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import torch
from safetensors.torch import load_file

from tephra.controller.workers.generation import Generator
from tephra.controller.workers.rl_worker import RLWorker
from tephra.rollout import RolloutConfig, ServerSettings, get_rollout
from tephra.rollout.testing import build_tiny_model

RECEIVER = Path(__file__).parents[1] / "packages" / "rollout" / "tests" / "weight_receiver.py"


class _Actor:
    """The engine side of a sync: fixed weights, exported in one bucket."""

    def __init__(self, weights) -> None:
        self.weights = weights

    def export_weights(self, untie_word_embeddings: bool):
        yield list(self.weights)

    def eval_mode(self):
        return contextlib.nullcontext()


@pytest.fixture
def receiver():
    process = subprocess.Popen(
        [sys.executable, str(RECEIVER), "cpu"], stdout=subprocess.PIPE, text=True
    )
    try:
        yield f"http://127.0.0.1:{int(process.stdout.readline())}"
    finally:
        process.kill()
        process.wait()


@pytest.mark.parametrize("level", [1, 2])
def test_the_worker_syncs_between_waking_weights_and_kv_cache(receiver, tmp_path, level):
    model = build_tiny_model(tmp_path / "model")
    weights = list(load_file(str(Path(model.path) / "model.safetensors")).items())
    worker = RLWorker.__new__(RLWorker)
    rollout = get_rollout(
        "vllm",
        RolloutConfig(
            model_path=model.path,
            max_model_len=64,
            vllm=ServerSettings(url=receiver, sleep_level=level),
        ),
    )
    rollout.transport = "ipc"
    worker.actor, worker._profile_prefix, worker.colocated = _Actor(weights), None, True
    worker.cfg = SimpleNamespace(
        adapter_sync=False,
        rollout=SimpleNamespace(uses_agent_loop=False, sleep_when_training=True),
        resources=SimpleNamespace(rollout=SimpleNamespace(replicas=0)),
    )
    worker.generation = Generator(worker.cfg, model.path, None, rollout)
    worker.generation._generate_plain = lambda items, sampling: []
    prompts = [None]  # one prompt (a rank with an empty share would not wake the server)
    try:
        worker.sync_weights()  # the first sync, awake
        worker.generate(prompts, None, score=False)  # generate, then sleep
        worker.generate(prompts, None, score=False)  # again, no update in between
        worker.sync_weights()  # after an update
        worker.generate(prompts, None, score=False)
        paths = [
            p
            for p, _ in httpx.get(receiver + "/log", timeout=30).json()
            if p
            not in (
                "/update_weights",
                "/start_weight_update",
                "/finish_weight_update",
                "/reset_prefix_cache",
                "/init_weight_transfer_engine",
            )
        ]
        sync_when_asleep = ["/wake_up?tags=weights", "/wake_up?tags=kv_cache"]
        if level == 1:  # the weights were kept: the second generation only wakes the server
            second = ["/wake_up?tags=weights&tags=kv_cache"]
        else:  # dropped: sent again before it generates
            second = sync_when_asleep
        assert paths == (
            [f"/sleep?level={level}"]
            + second
            + [f"/sleep?level={level}"]
            + sync_when_asleep
            + [f"/sleep?level={level}"]
        )
        # every sync delivered the actor's weights
        syncs = 3 if level == 2 else 2
        assert worker.rollout.update_count == syncs
        got = torch.load(io.BytesIO(httpx.get(receiver + "/received").content))
        assert all(torch.equal(got[name], tensor) for name, tensor in weights)
    finally:
        worker.rollout.close()
