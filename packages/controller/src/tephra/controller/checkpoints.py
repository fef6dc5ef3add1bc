"""Checkpoints of a whole run: engine state (written by the workers), dataloader position,
RNG state and step, under `run_dir/checkpoints/step_<N>/`. Resume picks the latest complete one.

A checkpoint is complete once `trainer_state.json` exists; it is written last, so a run
killed mid-save never resumes from a half-written folder.
"""

from __future__ import annotations

import json
import random
import re
import shutil
from pathlib import Path
from typing import Any

import torch

STATE_FILE = "trainer_state.json"


class CheckpointManager:
    def __init__(self, root: Path, keep_last: int = 2) -> None:
        self.root = Path(root)
        self.keep_last = keep_last

    def step_dir(self, step: int) -> Path:
        return self.root / f"step_{step}"

    def latest(self) -> Path | None:
        """The newest complete checkpoint folder, or None."""
        if not self.root.exists():
            return None
        done = [(int(m.group(1)), p) for p in self.root.iterdir()
                if (m := re.fullmatch(r"step_(\d+)", p.name)) and (p / STATE_FILE).exists()]
        return max(done)[1] if done else None

    def save_trainer_state(self, step: int, state: dict[str, Any]) -> Path:
        """Write the driver's part (after the workers saved their engines into the folder)."""
        folder = self.step_dir(step)
        folder.mkdir(parents=True, exist_ok=True)
        torch.save({"python": random.getstate(), "torch": torch.get_rng_state()},
                   folder / "driver_rng.pt")
        (folder / STATE_FILE).write_text(json.dumps({"step": step, **state}, indent=1))
        self._prune()
        return folder

    def load_trainer_state(self, folder: Path) -> dict[str, Any]:
        rng = torch.load(folder / "driver_rng.pt", weights_only=False)
        random.setstate(rng["python"])
        torch.set_rng_state(rng["torch"])
        return json.loads((folder / STATE_FILE).read_text())

    def _prune(self) -> None:
        if self.keep_last <= 0:
            return
        done = sorted(int(p.name.split("_")[1]) for p in self.root.iterdir()
                      if re.fullmatch(r"step_\d+", p.name) and (p / STATE_FILE).exists())
        for step in done[: -self.keep_last]:
            shutil.rmtree(self.step_dir(step), ignore_errors=True)
