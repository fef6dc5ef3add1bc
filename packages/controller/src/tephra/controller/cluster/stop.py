"""Stopping a run on SIGINT / SIGTERM: the first signal asks the driver's loop to stop at its
next safe point (the step in progress finishes and is checkpointed), a second one stops at once.

A terminal's Ctrl-C, and `kill` of a job's process group, reach every process of the group:
the driver and the Ray daemons it started (GCS, raylet, agents; Ray's workers lead groups of
their own). Ray starts its daemons with SIGINT blocked; `sigterm_blocked` blocks SIGTERM too
while they start, so that a SIGTERM to the group reaches only the driver, which then stops its
workers and its Ray session itself (a daemon killed first would fail the step in progress).
The driver's waits on workers are sliced (`wait_sliced`) so that a signal's handler runs
within a second, however long the stage.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import ray

SLICE_S = 1.0
"""The longest the driver waits on Ray without returning to Python (where handlers run)."""

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopNow(BaseException):
    """A second signal: unwinds the driver at once, through every `finally` (workers killed,
    Ray shut down), without a checkpoint of the step in progress."""


@dataclass
class StopSignal:
    """What the driver was asked: nothing yet, to stop at the next safe point, or at once."""

    signum: int | None = None
    """The first signal received (None: keep running)."""
    immediate: bool = False
    """A second signal came: the run unwinds without finishing its step."""

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else ""

    @property
    def exit_code(self) -> int:
        """128 + the signal's number, as a shell reports a job a signal ended (130, 143)."""
        return 128 + (self.signum or 0)

    def summary(self, steps: int, checkpoint: Path | None) -> dict[str, Any]:
        """The head of a stopped run's summary: the signal, the exit code, whether the stop
        was immediate, the steps done and the latest checkpoint (None: none)."""
        return {
            "status": "stopped",
            "signal": self.name,
            "exit_code": self.exit_code,
            "immediate": self.immediate,
            "steps": steps,
            "checkpoint": str(checkpoint) if checkpoint is not None else None,
        }

    def handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is None:
            self.signum = signum
            print(
                f"\n{signal.Signals(signum).name}: stopping after the step in progress (its "
                "checkpoint is written when checkpoints are on); send it again to stop at once",
                file=sys.stderr,
                flush=True,
            )
            return
        self.immediate = True
        print(f"\n{signal.Signals(signum).name} again: stopping now", file=sys.stderr, flush=True)
        raise StopNow(signal.Signals(signum).name)

    @contextmanager
    def installed(self) -> Iterator[StopSignal]:
        """Handle SIGINT and SIGTERM while the block runs (main thread only: Python delivers
        signals there); the previous handlers come back after it."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        previous = {sig: signal.getsignal(sig) for sig in SIGNALS}
        for sig in SIGNALS:
            signal.signal(sig, self.handle)
        try:
            yield self
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


@contextmanager
def sigterm_blocked() -> Iterator[None]:
    """SIGTERM blocked in this thread while the block runs: the processes it starts inherit
    the mask (Ray's daemons keep it), and a SIGTERM that arrives meanwhile is delivered after."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def wait_sliced(
    refs: list[Any], num_returns: int = 1, timeout: float | None = None
) -> tuple[list[Any], list[Any]]:
    """`ray.wait`, in slices of at most `SLICE_S` seconds, so that signal handlers run between
    them; returns as `ray.wait` does once `num_returns` are ready or `timeout` has passed."""
    end = None if timeout is None else time.monotonic() + timeout
    while True:
        left = None if end is None else max(0.0, end - time.monotonic())
        piece = SLICE_S if left is None else min(SLICE_S, left)
        done, pending = ray.wait(refs, num_returns=num_returns, timeout=piece)
        if len(done) >= num_returns or not pending or (left is not None and left <= piece):
            return done, pending


__all__ = ["SLICE_S", "StopNow", "StopSignal", "sigterm_blocked", "wait_sliced"]
