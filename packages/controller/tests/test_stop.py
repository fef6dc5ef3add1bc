"""The parts of a graceful stop that need no run: what one and two signals do to a `StopSignal`,
and that processes started under `sigterm_blocked` keep SIGTERM blocked (Ray's daemons)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from tephra.controller.cluster.stop import StopNow, StopSignal, sigterm_blocked

# the child prints its blocked-signal mask; SIGTERM (15) is bit 14 of it, 0x4000
MASK = "print([l for l in open('/proc/self/status') if l.startswith('SigBlk')][0].split()[1])"


def test_one_signal_asks_to_stop_a_second_stops_at_once() -> None:
    stop = StopSignal()
    before = signal.getsignal(signal.SIGINT)
    with stop.installed():
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.requested and stop.name == "SIGTERM" and stop.exit_code == 143
        assert not stop.immediate
        with pytest.raises(StopNow):
            os.kill(os.getpid(), signal.SIGINT)
        assert stop.immediate and stop.exit_code == 143  # the first signal names the exit
    assert signal.getsignal(signal.SIGINT) is before
    fresh = StopSignal()
    with fresh.installed():
        os.kill(os.getpid(), signal.SIGINT)
    assert fresh.exit_code == 130 and not fresh.immediate


def test_processes_started_under_sigterm_blocked_keep_it_blocked() -> None:
    with sigterm_blocked():
        inside = int(
            subprocess.run(
                [sys.executable, "-c", MASK], capture_output=True, text=True, check=True
            ).stdout,
            16,
        )
    after = int(
        subprocess.run(
            [sys.executable, "-c", MASK], capture_output=True, text=True, check=True
        ).stdout,
        16,
    )
    assert inside & 0x4000 and not after & 0x4000
    assert signal.SIGTERM not in signal.pthread_sigmask(signal.SIG_BLOCK, set())
