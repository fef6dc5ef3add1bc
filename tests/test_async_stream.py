"""The asynchronous mode's moving parts in one process (no Ray): a replica takes weights
that arrive while a request generates only before its next request, without the trainer
waiting; the sample stream sends several prompt groups per request and splits the answers
back into groups."""

from __future__ import annotations

import json
import threading
from types import SimpleNamespace

import pytest
import torch

from tephra.controller.data.prompts import PromptLoader
from tephra.controller.loop.async_stream import SampleStream
from tephra.controller.samples import Prompt, RewardResult, Sample, Scores
from tephra.controller.step.rounds import Prompts
from tephra.controller.workers import rollout_replicas
from tephra.rollout.base import SamplingParams


class _Engine:
    """The rollout engine's weight side: which versions' tensors it was given."""

    def __init__(self) -> None:
        self.loaded: list[float] = []

    def wake_up(self) -> None:
        pass

    def update_weights(self, named) -> None:
        self.loaded += [float(t) for _, t in named]


def _prompts(n: int) -> Prompts:
    """`n` one-token prompts (ids 100, 101, ...)."""
    return Prompts(
        [[100 + i] for i in range(n)],
        [Prompt([{"role": "user", "content": str(i)}]) for i in range(n)],
    )


def _replica(monkeypatch) -> rollout_replicas.RolloutWorker:
    """A RolloutWorker whose generate blocks until `release` is set, and whose broadcast
    receive yields one weight holding the version number."""
    worker = rollout_replicas.RolloutWorker.__new__(rollout_replicas.RolloutWorker)
    # a replica that joined the weight group (its receive is replaced below)
    worker.device, worker._weights_group = "cpu", object()
    worker.version, worker.partial, worker._staged = 0, False, None
    worker._generating, worker._staging = threading.Lock(), threading.Lock()
    worker.started, worker.release = threading.Event(), threading.Event()

    def generate(items, sampling):
        worker.started.set()
        assert worker.release.wait(10)
        return [
            Sample(
                prompt_ids=[1],
                response_ids=[2],
                response_mask=[1],
                log_probs=None,
                finish_reason="stop",
            )
            for _ in items
        ]

    # the replica's generation part: this engine, the blocking generate, one score per request
    worker.generation = SimpleNamespace(
        rollout=_Engine(),
        generate=generate,
        collect_scores=lambda: Scores([RewardResult(1.0)], 0.0),
    )
    sent = {}
    monkeypatch.setattr(
        rollout_replicas,
        "receive_all",
        lambda group, device: iter([("w", torch.tensor(sent["version"]))]),
    )
    worker.send = lambda version: sent.update(version=version)
    return worker


def test_weights_received_mid_request_wait_for_the_next_one(monkeypatch):
    worker = _replica(monkeypatch)
    worker.send(1)
    worker.release.set()
    assert worker.receive_weights(1) == 1  # idle: straight into the engine
    assert worker.rollout.loaded == [1.0] and worker.version == 1

    worker.release.clear()
    result = {}
    request = threading.Thread(
        target=lambda: result.update(first=worker.generate_scored(["p"], None))
    )
    request.start()
    assert worker.started.wait(10)
    worker.send(2)
    worker.receive_weights(2)  # returns while the request is still generating
    worker.send(3)
    worker.receive_weights(3)  # a newer version kept aside supersedes the older one
    assert request.is_alive() and worker.rollout.loaded == [1.0] and worker.version == 1
    worker.release.set()
    request.join(10)
    assert result["first"][0].weight_version == 1  # finished under the weights it started with
    second = worker.generate_scored(["p"], None)
    assert worker.rollout.loaded == [1.0, 3.0] and worker.version == 3
    assert second[0].weight_version == 3 and worker._staged is None


class _Replicas:
    """Stand-in replicas answering requests in order; each sample's prompt is its group's."""

    def __init__(self) -> None:
        self.replicas, self.served, self.requests = [object()], [0], []

    def submit(self, items, sampling):
        self.requests.append((items, sampling.seed))
        return len(self.requests) - 1

    def wait_any(self, refs):
        ref = min(refs)
        items, _ = self.requests[ref]
        self.served[0] += 1
        return ref, [
            Sample(
                prompt_ids=list(item.prompt_ids),
                response_ids=[k],
                response_mask=[1],
                log_probs=None,
                finish_reason="stop",
                weight_version=0,
            )
            for item in items
            for k in range(2)
        ]


@pytest.mark.parametrize("per_request", [1, 2, 3])
def test_the_stream_sends_several_groups_per_request(per_request):
    prompts = _prompts(10)
    order = iter(range(100))
    loader = SimpleNamespace(next_indices=lambda: [next(order) % 10 for _ in range(4)])
    replicas = _Replicas()
    in_flight = -(-(4 + per_request - 1) // per_request)  # the least the config accepts
    stream = SampleStream(
        replicas,
        loader,
        prompts,
        SamplingParams(n=2, max_tokens=4),
        seed=0,
        prompts_per_step=4,
        in_flight=in_flight,
        window=1,
        groups_per_request=per_request,
    )
    drawn = []
    for _ in range(3):
        items, indices, samples = stream.next_batch(version=0)
        drawn += indices
        assert len(items) == 4 and [it.prompt_ids for it in items] == [[100 + i] for i in indices]
        # prompt-major, the samples of each group after its prompt
        assert [s.prompt_ids for s in samples] == [[100 + i] for i in indices for _ in range(2)]
        assert [s.response_ids for s in samples] == [[0], [1]] * 4
        waiting = len(stream.ready) + per_request * len(stream.requests)
        assert waiting <= stream.capacity == in_flight * per_request
    assert drawn == [i % 10 for i in range(12)]  # the loader's order, nothing skipped
    # a request carries fewer groups only when admission has fewer free slots (async_window)
    sizes = [len(items) for items, _ in replicas.requests]
    assert sizes[0] == per_request and all(1 <= k <= per_request for k in sizes)
    assert sizes.count(per_request) >= len(sizes) // 2
    seeds = [seed for _, seed in replicas.requests]
    assert seeds == [7_919 * sum(sizes[:k]) for k in range(len(seeds))]


def test_a_resumed_stream_trains_the_prompts_of_an_uninterrupted_one():
    """Saved after 3 steps (with groups finished, in flight and queued) and resumed in a fresh
    stream over a fresh loader: the 6 steps train exactly the prompts, in the order, of one
    uninterrupted stream; nothing lost, nothing repeated."""
    prompts = _prompts(40)

    def stream(loader):
        return SampleStream(
            _Replicas(),
            loader,
            prompts,
            SamplingParams(n=2, max_tokens=4),
            seed=3,
            prompts_per_step=3,  # two groups per answer: one waits in `ready` after a step
            in_flight=5,
            window=1,
            groups_per_request=2,
        )

    whole = stream(PromptLoader(40, 4, seed=5))
    uninterrupted = [whole.next_batch(version=0)[1] for _ in range(6)]

    first = stream(PromptLoader(40, 4, seed=5))
    before = [first.next_batch(version=0)[1] for _ in range(3)]
    saved = json.loads(json.dumps({"loader": first.loader.state_dict(), "stream": first.state()}))
    assert first.requests  # groups in flight are owed
    assert len(saved["stream"]["owed"]) == first.untrained + len(first.queue)
    loader = PromptLoader(40, 4, seed=5)
    loader.load_state_dict(saved["loader"])
    resumed = stream(loader)
    resumed.restore(saved["stream"])
    after = [resumed.next_batch(version=0)[1] for _ in range(3)]
    assert before + after == uninterrupted
    trained = [i for step in uninterrupted for i in step]
    assert len(set(trained)) == len(trained) == 18  # within one epoch of 40: none twice
    with pytest.raises(RuntimeError, match="already sent requests"):
        first.restore(saved["stream"])
