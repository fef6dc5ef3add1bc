"""The sample stream of `trainer.mode=async`: admission of prompts, so that no trained sample is
more than `trainer.async_window` weight versions old and no prompt is dropped.

Rollout replicas generate `async_groups_per_request` prompt groups per request, continuously:
`async_in_flight` requests per replica are kept queued, each sent to the least-loaded replica,
so a slow group (long samples, a slow tool) holds up one request, not a batch. More groups per
request decode more rows at once (a replica's step costs about the same for 8 rows as for 32,
where decoding is memory-bound); fewer balance the replicas finer.

Admission bounds the staleness, instead of dropping old samples (which drops the slow prompts
most: long generations are the ones that go stale). With W = `async_window` and P =
`prompts_per_step`:

- a prompt admitted (sent) while the trainer holds version v gets the deadline v + W: it is
  trained in a step whose trainer version is at most v + W. Its samples start under version v
  or newer (a replica takes every update before its next request), so their version lag when
  trained is at most W, queue time included;
- a prompt is admitted only while the steps up to its deadline have a free slot: at most
  (W + 1) x P prompts are admitted and not yet trained before a step takes its batch, W x P
  after (the rest of that step's slots are taken);
- a step trains the earliest-admitted finished groups, provided the groups left over can all
  still meet their deadlines in the steps to come (P a step); otherwise it waits for the
  finish of one that would miss its own (earliest deadline first). A finished group thus
  overtakes slower ones by at most W steps, and a slow one is never crowded out.

Nothing is dropped, so every prompt the loader hands out is trained exactly once. A group found
older than the window when its step takes it is a bug (a replica that did not take the weights
it was sent), not a data condition: the step raises instead of training on it or dropping it.

A checkpoint saves the stream's `state()`: the prompts admitted and not trained yet (finished
and waiting, in flight) in the order they were sent, then those queued from the loader but not
sent. A resumed stream sends those first, again (generated anew under the resumed weights, each
admitted under the same rule), then goes on with the loader from its saved position: no prompt
is lost or repeated by a restart.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tephra.controller.data.prompts import PromptLoader
from tephra.controller.samples import Prompt, Sample


@dataclass
class Admitted:
    """A prompt group sent to a replica, and its samples once they are back."""

    item: Prompt
    index: int
    """The prompt's index in the training set."""
    order: int
    """How many groups were sent before it (the sending order)."""
    deadline: int
    """The last trainer version that may train it: its admission version + the window."""
    samples: list[Sample] | None = None


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
        window: int,
        groups_per_request: int = 1,
    ) -> None:
        self.replicas, self.loader, self.prompts = replicas, loader, prompts
        self.sampling, self.seed = sampling, seed
        self.want, self.window = prompts_per_step, window
        self.per_request = groups_per_request
        self.capacity = in_flight * len(replicas.replicas) * groups_per_request
        """Groups in flight or waiting, at most (memory of the buffer, load of the replicas)."""
        self.last_step = -1
        """The trainer version of the last step that took its batch (-1: none yet)."""
        self.requests: dict[Any, list[Admitted]] = {}
        self.ready: list[Admitted] = []
        """Finished groups not trained yet, in sending order."""
        self.queue: list[int] = []
        self.sent = 0
        self.waits = 0
        """Answers a step waited for beyond the first `prompts_per_step` finished groups, to
        keep a slower group's deadline (cumulative)."""
        self.held_back = 0
        """Times admission held a request back for lack of a slot before its deadline."""
        self.lags: list[int] = []
        """The version lag of every trained group's oldest sample (for the metrics)."""

    @property
    def untrained(self) -> int:
        """Groups admitted and not trained yet (finished or in flight)."""
        return len(self.ready) + sum(len(g) for g in self.requests.values())

    def admit_limit(self, version: int) -> int:
        """Groups that may be admitted and untrained at trainer `version`: the slots of the
        steps from the next one to take a batch up to the deadline `version + window`."""
        first = max(version, self.last_step + 1)
        return (version + self.window - first + 1) * self.want

    def fill(self, version: int) -> None:
        """Send requests while the replicas have room (`capacity`) and the steps up to the
        deadline `version + window` have a free slot (`admit_limit`); a request carries fewer
        than `groups_per_request` groups when only fewer slots are free."""
        while self.per_request * (len(self.requests) + 1) + len(self.ready) <= self.capacity:
            room = min(self.per_request, self.admit_limit(version) - self.untrained)
            if room < 1:
                self.held_back += 1
                return
            groups: list[Admitted] = []
            for _ in range(room):
                if not self.queue:
                    self.queue.extend(self.loader.next_indices())
                index = self.queue.pop(0)
                order = self.sent + len(groups)
                item = self.prompts.item(index, f"async{order}")
                groups.append(Admitted(item, index, order, version + self.window))
            # seeded by the request's first group (one group per request: as before)
            sampling = self.sampling.replace(seed=self.seed * 1_000_003 + 7_919 * self.sent)
            self.requests[self.replicas.submit([g.item for g in groups], sampling)] = groups
            self.sent += len(groups)

    def state(self) -> dict[str, Any]:
        """What a checkpoint saves: the prompt indices owed (admitted, not yet trained) in
        sending order, then the ones queued but not sent; the groups sent so far."""
        taken = self.ready + [g for groups in self.requests.values() for g in groups]
        owed = [g.index for g in sorted(taken, key=lambda g: g.order)]
        return {"owed": owed + list(self.queue), "sent": self.sent}

    def restore(self, state: dict[str, Any]) -> None:
        """Continue from `state()` of a saved stream (before this one sends anything)."""
        if self.requests or self.ready:
            raise RuntimeError("SampleStream.restore: this stream has already sent requests")
        self.queue = [int(i) for i in state["owed"]]
        self.sent = int(state["sent"])

    def next_batch(self, version: int) -> tuple[list[Prompt], list[int], list[Sample]]:
        """The next step's groups (items, training-set indices, samples prompt-major) for a
        trainer at weight `version`."""
        waited = 0
        while True:
            taken = self._pick(version)
            if taken is not None:
                break
            waited += len(self.ready) >= self.want
            self.fill(version)
            if not self.requests:
                raise RuntimeError(
                    "async stream: no request in flight and no batch that keeps every "
                    "admitted group's deadline (an admission bug)"
                )
            ref, samples = self.replicas.wait_any(list(self.requests))
            groups = self.requests.pop(ref)
            n = len(samples) // len(groups)  # prompt-major: each group's samples in turn
            for k, g in enumerate(groups):
                g.samples = samples[k * n : (k + 1) * n]
            self.ready = sorted(self.ready + groups, key=lambda g: g.order)
        self.waits += waited
        self.last_step = version
        chosen = {id(g) for g in taken}
        self.ready = [g for g in self.ready if id(g) not in chosen]
        for g in taken:
            assert g.samples is not None
            lag = version - min(s.weight_version for s in g.samples)
            if lag > self.window:
                raise RuntimeError(
                    f"async stream: prompt {g.item.sample_id!r} (dataset row {g.index}) was "
                    f"generated {lag} weight versions before the trainer's {version}, beyond "
                    f"trainer.async_window={self.window}; its replica did not take the weights "
                    "sent before the prompt was admitted"
                )
            self.lags.append(lag)
        self.fill(version)  # the replicas go on generating while this batch trains
        return (
            [g.item for g in taken],
            [g.index for g in taken],
            [s for g in taken for s in g.samples or []],
        )

    def _pick(self, version: int) -> list[Admitted] | None:
        """The first `want` finished groups in sending order, if every group left over can
        still be trained by its deadline (at most `want` a step from `version + 1` on);
        None: wait for another answer."""
        if len(self.ready) < self.want:
            return None
        taken = self.ready[: self.want]
        left = self.ready[self.want :] + [g for gs in self.requests.values() for g in gs]
        deadlines = sorted(g.deadline for g in left)
        if deadlines and deadlines[0] < version:
            raise RuntimeError(
                f"async stream: a group admitted with deadline version {deadlines[0]} is still "
                f"untrained at trainer version {version} (each step must take one batch)"
            )
        # earliest deadline first: the k-th (1-based) earliest must find a slot by its deadline
        for k, deadline in enumerate(deadlines, start=1):
            if k > (deadline - version) * self.want:
                return None
        return taken

    def metrics(self) -> dict[str, float]:
        """`async/*`: admission and buffer counts; the version lag of the trained groups so far
        (mean, p95, max; the step's own lags are in `staleness/*`)."""
        lags = sorted(self.lags)
        p95 = lags[min(len(lags) - 1, int(0.95 * len(lags)))] if lags else 0
        out = {
            "async/admitted_untrained_groups": float(self.untrained),
            "async/buffered_groups": float(len(self.ready)),
            "async/in_flight_requests": float(len(self.requests)),
            "async/queued_prompts": float(len(self.queue)),
            "async/held_back_requests": float(self.held_back),
            "async/deadline_waits": float(self.waits),
            "async/lag_mean": sum(lags) / len(lags) if lags else 0.0,
            "async/lag_p95": float(p95),
            "async/lag_max": float(lags[-1]) if lags else 0.0,
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
