"""The start-up timeline: how long each phase from the process's start to the first step took."""

from __future__ import annotations

import os
import time


def process_age_s() -> float:
    """Seconds since this process started (Linux: from /proc; elsewhere 0.0, unknown)."""
    try:
        with open("/proc/self/stat") as f:
            # field 22 (after the parenthesised command name, which may hold spaces)
            started = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0.0
    return max(uptime - started / os.sysconf("SC_CLK_TCK"), 0.0)


class Timeline:
    """Phases in order: `lap(name)` closes the phase that ran since the previous lap. The
    first phase, `imports`, is the process's age when the timeline is made."""

    def __init__(self) -> None:
        self.phases: dict[str, float] = {"imports": process_age_s()}
        self._last = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.phases[name] = now - self._last
        self._last = now

    def summary(self) -> dict[str, float]:
        """`{phase}_s` for each phase and `total_s`, the command (process start) to now."""
        out = {f"{name}_s": round(s, 2) for name, s in self.phases.items()}
        out["total_s"] = round(sum(self.phases.values()), 2)
        return out
