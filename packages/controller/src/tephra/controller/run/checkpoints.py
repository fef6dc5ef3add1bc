"""Checkpoints of a whole run: engine state (written by the workers), dataloader position,
RNG state and step, under `run_dir/checkpoints/step_<N>/`.

Atomic: a checkpoint is written into `step_<N>.tmp/` (`begin`), then the driver adds its own
state and a manifest of every file's size and SHA-256, and renames the folder to `step_<N>/`
(`commit`). A run killed mid-save leaves only a `.tmp` folder, which is never resumed from.
A committed checkpoint whose files no longer match its manifest (a torn copy, a full disk,
bit rot) is skipped with a warning, and the previous one is used.

A save that runs out of disk (ENOSPC, a full quota) removes its `.tmp` folder and raises a
`CheckpointError` naming the run's checkpoint folder and what to do; the checkpoints before
it are untouched.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import random
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tephra.core.errors import CheckpointError

logger = logging.getLogger(__name__)

STATE_FILE = "trainer_state.json"
MANIFEST = "manifest.json"
RESUME_MODES = ("auto", "off", "must")
DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


def is_disk_full(exc: BaseException) -> bool:
    """Whether `exc` is a full disk or quota, also when a Ray worker raised it (Ray's task
    error subclasses the cause's type but drops its errno; `.cause` holds the original)."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, BaseException) and cause is not exc and is_disk_full(cause):
        return True
    return isinstance(exc, OSError) and (
        exc.errno in DISK_FULL
        or "No space left on device" in str(exc)
        or "Disk quota exceeded" in str(exc)
    )


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_manifest(folder: Path) -> None:
    """Record every file's size and SHA-256 under `folder` (paths relative to it)."""
    files = {
        str(p.relative_to(folder)): {"bytes": p.stat().st_size, "sha256": _sha256(p)}
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != MANIFEST
    }
    (folder / MANIFEST).write_text(json.dumps(files, indent=1))


def check_manifest(folder: Path) -> str | None:
    """Why `folder` does not match its manifest, or None when every file does."""
    manifest = folder / MANIFEST
    if not manifest.exists():
        return f"{MANIFEST} is missing"
    try:
        files = json.loads(manifest.read_text())
    except json.JSONDecodeError:
        return f"{MANIFEST} is not valid JSON"
    for name, expected in files.items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        size = path.stat().st_size
        if size != expected["bytes"]:
            return f"{name} has {size} bytes, the manifest says {expected['bytes']}"
        if _sha256(path) != expected["sha256"]:
            return f"{name} does not match its SHA-256 in the manifest"
    return None


class CheckpointManager:
    def __init__(self, root: Path, keep_last: int = 2) -> None:
        self.root = Path(root)
        self.keep_last = keep_last

    def step_dir(self, step: int) -> Path:
        return self.root / f"step_{step}"

    def begin(self, step: int) -> Path:
        """The temporary folder the workers write step `step`'s state into."""
        tmp = self.root / f"step_{step}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        return tmp

    def save(self, step: int, write: Callable[[Path], None], state: dict[str, Any]) -> Path:
        """`begin`, `write(tmp folder)` (the workers' engine state), `commit`. A full disk
        anywhere in between removes the temporary folder and raises `CheckpointError`."""
        tmp = self.begin(step)
        try:
            write(tmp)
            return self.commit(step, state)
        except OSError as exc:
            if not is_disk_full(exc):
                raise
            shutil.rmtree(tmp, ignore_errors=True)
            free = shutil.disk_usage(self.root).free if self.root.exists() else 0
            cause = getattr(exc, "cause", None) or exc  # a Ray worker's error: the original
            raise CheckpointError(
                f"checkpoint of step {step} failed: the disk under {self.root} is full "
                f"({free / 2**20:.0f} MiB free; {type(cause).__name__}: "
                f"{str(cause).strip().splitlines()[0]}). Free space there, lower "
                "trainer.keep_checkpoints, or set trainer.run_dir to a bigger disk; the "
                f"previous checkpoint ({self.latest()}) is intact"
            ) from exc

    def commit(self, step: int, state: dict[str, Any]) -> Path:
        """Add the driver's state and the manifest to step `step`'s temporary folder and
        rename it into place (after the workers saved their engines into it)."""
        tmp = self.root / f"step_{step}.tmp"
        if not tmp.is_dir():
            raise CheckpointError(f"commit of step {step} without begin: {tmp} does not exist")
        torch.save(
            {"python": random.getstate(), "torch": torch.get_rng_state()}, tmp / "driver_rng.pt"
        )
        (tmp / STATE_FILE).write_text(json.dumps({"step": step, **state}, indent=1))
        write_manifest(tmp)
        final = self.step_dir(step)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        self._prune()
        return final

    def committed(self) -> list[tuple[int, Path]]:
        """Committed checkpoint folders, newest first (not yet checked against manifests)."""
        if not self.root.exists():
            return []
        found = [
            (int(m.group(1)), p)
            for p in self.root.iterdir()
            if (m := re.fullmatch(r"step_(\d+)", p.name)) and p.is_dir()
        ]
        return sorted(found, reverse=True)

    def latest(self) -> Path | None:
        """The newest checkpoint whose files match its manifest; newer broken ones are
        skipped with a warning naming the file."""
        for _, folder in self.committed():
            problem = check_manifest(folder)
            if problem is None:
                return folder
            message = f"checkpoint {folder} is damaged ({problem}); trying the previous one"
            logger.warning(message)
            print(f"warning: {message}", flush=True)
        return None

    def resolve(self, resume: str, resume_from: str | None = None) -> Path | None:
        """The checkpoint to resume from: `resume_from` when given (it must be intact),
        else by mode: `auto` the latest intact one or None, `off` None, `must` the latest
        intact one or a `CheckpointError`."""
        if resume not in RESUME_MODES:
            raise CheckpointError(f"trainer.resume={resume!r}: choose one of {list(RESUME_MODES)}")
        if resume_from:
            folder = Path(resume_from).expanduser()
            problem = check_manifest(folder) if folder.is_dir() else "no such folder"
            if problem is not None:
                raise CheckpointError(
                    f"trainer.resume_from={resume_from!r}: {problem}; give a "
                    "step_<N> folder of a run's checkpoints"
                )
            return folder
        if resume == "off":
            return None
        latest = self.latest()
        if latest is None and resume == "must":
            raise CheckpointError(
                f"trainer.resume='must' but {self.root} holds no intact "
                "checkpoint; run once with trainer.save_every set, or use auto"
            )
        return latest

    def load_trainer_state(self, folder: Path) -> dict[str, Any]:
        rng = torch.load(folder / "driver_rng.pt", weights_only=False)
        random.setstate(rng["python"])
        torch.set_rng_state(rng["torch"])
        return json.loads((folder / STATE_FILE).read_text())

    def _prune(self) -> None:
        if self.keep_last <= 0:
            return
        for _, folder in self.committed()[self.keep_last :]:
            shutil.rmtree(folder, ignore_errors=True)
