"""The RL example (`apps/serve/examples/rl_loop.py`, the SDK alone) learns its task on the
tiny model: sampling with the server's log-probs, group-centred advantages and
`importance_sampling` steps raise the held-out reward on fresh prompts."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import tinker

from tephra.apps.serve.cli import BackgroundServer, make_service

KEY = "tml-tephra-test"
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "rl_loop.py"


@pytest.fixture(scope="module")
def rl_loop():
    spec = importlib.util.spec_from_file_location("tephra_serve_rl_loop", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


@pytest.fixture(scope="module")
def server():
    with BackgroundServer(make_service(["tiny=tiny"]), KEY) as srv:
        yield srv


@pytest.fixture(scope="module")
def service_client(server):
    return tinker.ServiceClient(base_url=server.url, api_key=KEY)


def test_target_task_reward_distribution(rl_loop):
    task = rl_loop.target_task(seed=0)
    assert len(task.train) == 512 and len(task.heldout) == 32
    assert not {tuple(p) for p in task.heldout} & {tuple(p) for p in task.train}
    assert task.reward(0, [3, 40, 31, 32], False) == 0.5
    assert task.reward(0, [], True) == 0.0


def test_rl_loop_raises_heldout_reward(rl_loop, server, service_client):
    # seeds 0-4 (README, An RL loop): held-out 0.125-0.154 before, 0.94-0.98 after 12 steps
    out = rl_loop.train(
        service_client,
        rl_loop.target_task(seed=0),
        base_model="tiny",
        steps=12,
        prompts_per_step=8,
        samples_per_prompt=8,
        learning_rate=3e-2,
        seed=0,
        log=lambda line: None,
    )
    assert out["heldout_before"] < 0.2, out
    assert out["heldout_after"] > 0.8, out
    assert out["train_rewards"][-1] > out["train_rewards"][0] + 0.4, out

    # the command line runs the same loop: with no steps, before and after are the
    # untrained adapter's held-out reward above (same prompts, same sampling seeds)
    summary = rl_loop.main(["--base-url", server.url, "--api-key", KEY, "--steps", "0"])
    assert summary["heldout_before"] == summary["heldout_after"] == out["heldout_before"]
