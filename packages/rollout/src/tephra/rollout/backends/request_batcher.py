"""An in-process batching server: concurrent single requests become batched generate calls.

Agent loops send one request per turn per trajectory; running each alone would waste the
batch dimension. A background thread collects the requests that arrive within
`wait_s` of the first one (up to `max_rows`), groups those that can share one generate call,
runs the group and resolves each request's future. Generation runs on that thread, so the
caller's event loop stays free (a slow tool in one trajectory never blocks another's turn).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass

_STOP = object()


@dataclass
class _Request:
    payload: object
    key: Hashable
    future: concurrent.futures.Future


class RequestBatcher:
    """`await batcher.submit(payload, key)`; `run_batch(payloads) -> results` runs on the
    worker thread with payloads that share one `key`, and must return one result each."""

    def __init__(
        self, run_batch: Callable[[list], list], max_rows: int, wait_s: float, name: str
    ) -> None:
        self._run_batch = run_batch
        self._max_rows = max_rows
        self._wait_s = wait_s
        self._queue: queue.Queue = queue.Queue()
        self.batches_run = 0
        """Number of batched calls made (tests and metrics: fewer than requests = batching)."""
        self.largest_batch = 0
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    async def submit(self, payload: object, key: Hashable) -> object:
        if self._closed:
            raise RuntimeError("the batching server is closed")
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._queue.put(_Request(payload, key, future))
        return await asyncio.wrap_future(future)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._queue.put(_STOP)
            self._thread.join(timeout=60)

    def _collect(self, first: _Request) -> tuple[list[_Request], bool]:
        batch, stop = [first], False
        deadline = time.monotonic() + self._wait_s
        while len(batch) < self._max_rows:
            remaining = deadline - time.monotonic()
            try:
                item = (
                    self._queue.get(timeout=max(remaining, 0))
                    if remaining > 0
                    else (self._queue.get_nowait())
                )
            except queue.Empty:
                break
            if item is _STOP:
                stop = True
                break
            batch.append(item)
        return batch, stop

    def _serve(self) -> None:
        while True:
            first = self._queue.get()
            if first is _STOP:
                break
            batch, stop = self._collect(first)
            groups: dict[Hashable, list[_Request]] = {}
            for request in batch:
                groups.setdefault(request.key, []).append(request)
            for requests in groups.values():
                live = [r for r in requests if r.future.set_running_or_notify_cancel()]
                if not live:
                    continue
                self.batches_run += 1
                self.largest_batch = max(self.largest_batch, len(live))
                try:
                    results = self._run_batch([r.payload for r in live])
                except BaseException as exc:  # noqa: BLE001 - handed to every waiting caller
                    for r in live:
                        r.future.set_exception(exc)
                    continue
                for r, result in zip(live, results):
                    r.future.set_result(result)
            if stop:
                break
        # fail anything still queued so no caller waits forever
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not _STOP and item.future.set_running_or_notify_cancel():
                item.future.set_exception(RuntimeError("the batching server was closed"))
