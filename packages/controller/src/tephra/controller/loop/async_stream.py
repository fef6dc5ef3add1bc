"""The sample stream of `trainer.mode=async`.

Rollout replicas generate `async_groups_per_request` prompt groups per request, continuously:
`async_in_flight` requests per replica are kept queued, each sent to the least-loaded replica,
so a slow group (long samples, a slow tool) holds up one request, not a batch. More groups per
request decode more rows at once (a replica's step costs about the same for 8 rows as for 32,
where decoding is memory-bound); fewer balance the replicas finer. Finished groups wait in a
bounded buffer; a step takes the first `prompts_per_step` of them whose weight version is at most
`max_staleness` behind the trainer's, and drops older ones (counted). The replicas keep
generating while the trainer trains; they take each new version between two requests, or,
with `trainer.partial_rollout`, right away: a request in flight then finishes under the new
weights and its samples' `weight_version` is the oldest of their tokens'.

A checkpoint saves the stream's `state()`: the prompts taken from the loader and not trained
yet (finished and waiting, in flight, queued), in the order they were sent. A resumed stream
sends those first, again (generated anew under the resumed weights), then goes on with the
loader from its saved position: no prompt is lost or repeated by a restart.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from tephra.controller.data.prompts import PromptLoader
from tephra.controller.samples import PromptItem, Sample


class SampleStream:
    def __init__(
        self,
        replicas: Any,
        loader: PromptLoader,
        prompts: Any,
        sampling: Any,
        seed: int,
        prompts_per_step: int,
        in_flight: int,
        max_staleness: int,
        groups_per_request: int = 1,
    ) -> None:
        self.replicas, self.loader, self.prompts = replicas, loader, prompts
        self.sampling, self.seed = sampling, seed
        self.want, self.max_staleness = prompts_per_step, max_staleness
        self.per_request = groups_per_request
        self.capacity = in_flight * len(replicas.replicas) * groups_per_request
        """Groups in flight or waiting, at most."""
        self.requests: dict[Any, list[tuple[PromptItem, int]]] = {}
        self.ready: deque[tuple[PromptItem, int, list[Sample]]] = deque()
        self.queue: deque[int] = deque()
        self.sent = 0
        self.dropped = 0
        """Groups dropped for staleness so far."""

    def fill(self) -> None:
        """Keep `capacity` groups in flight (finished groups waiting count against it, so the
        buffer stays bounded)."""
        while (self.per_request * (len(self.requests) + 1) + len(self.ready)) <= self.capacity:
            groups = []
            for _ in range(self.per_request):
                if not self.queue:
                    self.queue.extend(self.loader.next_indices())
                index = self.queue.popleft()
                groups.append(
                    (
                        PromptItem(
                            self.prompts.ids[index],
                            self.prompts.records[index],
                            f"async{self.sent + len(groups)}",
                        ),
                        index,
                    )
                )
            # seeded by the request's first group (one group per request: as before)
            sampling = self.sampling.replace(seed=self.seed * 1_000_003 + 7_919 * self.sent)
            self.requests[self.replicas.submit([g[0] for g in groups], sampling)] = groups
            self.sent += len(groups)

    def state(self) -> dict[str, Any]:
        """What a checkpoint saves: the prompt indices owed (taken, not yet trained) in sending
        order, then the ones queued but not sent; the groups sent and dropped so far."""
        taken = [(item.sample_id, index) for item, index, _ in self.ready] + [
            (item.sample_id, index) for groups in self.requests.values() for item, index in groups
        ]
        sent_order = sorted(taken, key=lambda pair: int(pair[0].removeprefix("async")))
        return {
            "owed": [index for _, index in sent_order] + list(self.queue),
            "sent": self.sent,
            "dropped": self.dropped,
        }

    def restore(self, state: dict[str, Any]) -> None:
        """Continue from `state()` of a saved stream (before this one sends anything)."""
        if self.requests or self.ready:
            raise RuntimeError("SampleStream.restore: this stream has already sent requests")
        self.queue = deque(int(i) for i in state["owed"])
        self.sent, self.dropped = int(state["sent"]), int(state["dropped"])

    def next_batch(self, version: int) -> tuple[list[PromptItem], list[int], list[Sample]]:
        """The next step's groups (items, training-set indices, samples prompt-major) for a
        trainer at weight `version`."""
        while True:
            self._drop_stale(version)
            if len(self.ready) >= self.want:
                break
            self.fill()
            ref, samples = self.replicas.wait_any(list(self.requests))
            groups = self.requests.pop(ref)
            n = len(samples) // len(groups)  # prompt-major: each group's samples in turn
            self.ready.extend(
                (item, index, samples[k * n : (k + 1) * n])
                for k, (item, index) in enumerate(groups)
            )
        taken = [self.ready.popleft() for _ in range(self.want)]
        self.fill()  # the replicas go on generating while this batch trains
        return ([t[0] for t in taken], [t[1] for t in taken], [s for t in taken for s in t[2]])

    def _drop_stale(self, version: int) -> None:
        fresh = [
            g
            for g in self.ready
            if version - min(s.weight_version for s in g[2]) <= self.max_staleness
        ]
        self.dropped += len(self.ready) - len(fresh)
        self.ready = deque(fresh)

    def metrics(self) -> dict[str, float]:
        out = {
            "async/dropped_stale_groups": float(self.dropped),
            "async/buffered_groups": float(len(self.ready)),
            "async/in_flight_requests": float(len(self.requests)),
        }
        for i, served in enumerate(self.replicas.served):
            out[f"async/replica{i}_requests"] = float(served)
        return out


def partial_rollout_metrics(samples: list[Sample]) -> dict[str, float]:
    """`async/partial_samples`: trained samples whose tokens span more than one weight version
    (interrupted by an update and resumed under the new weights; each update brings a new
    version); `async/resumed_tokens`: their tokens produced after the first update."""
    spans = [s.token_versions for s in samples if s.token_versions]
    return {
        "async/partial_samples": float(sum(v[-1] != v[0] for v in spans)),
        "async/resumed_tokens": float(sum(t != v[0] for v in spans for t in v)),
    }
