"""Saved training states (`save_state`): their `tinker://` paths and the folders under the
server's workdir that hold them.

A state is saved as `tinker://RUN/weights/NAME` (RUN the training client's model id) in
`<workdir>/checkpoints/RUN/weights/NAME/`:
    engine/       the engine's own checkpoint (`Engine.save_checkpoint`): adapter, optimizer
                  moments and step count, RNG; loading it resumes bitwise
    state.json    base model, LoRA rank, the client it came from, time, user metadata
A server started again on the same `--workdir` loads the states an earlier one saved.
"""

from __future__ import annotations

import json
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from tephra.apps.serve.errors import UserError

SCHEME = "tinker://"
STATE_FILE = "state.json"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]*$")


@dataclass(frozen=True)
class SavedState:
    """One saved state on disk."""

    path: str
    """Its `tinker://RUN/weights/NAME` path."""
    folder: Path
    base_model: str
    lora_rank: int
    time: float
    user_metadata: dict[str, str]

    @property
    def engine_checkpoint(self) -> Path:
        return self.folder / "engine"


def check_name(name: object, call: str) -> str:
    """A state or sampler-weights name: one path segment (letters, digits, `._:-`)."""
    if not isinstance(name, str) or not _NAME.match(name) or ".." in name:
        raise UserError(
            f"{call}: name {name!r} is not a valid checkpoint name; use letters, digits and "
            "'._:-' (one path segment, e.g. 'step-0010')"
        )
    return name


def parse(path: object, call: str) -> tuple[str, str, str]:
    """`tinker://RUN/KIND/NAME` -> (RUN, KIND, NAME), KIND `weights` or `sampler_weights`."""
    parts = path[len(SCHEME) :].split("/") if isinstance(path, str) else []
    if not isinstance(path, str) or not path.startswith(SCHEME) or len(parts) != 3:
        raise UserError(
            f"{call}: path {path!r} is not a tinker path; give the path save_state returned "
            "(tinker://RUN/weights/NAME)"
        )
    run, kind, name = parts
    if kind not in ("weights", "sampler_weights"):
        raise UserError(
            f"{call}: path {path!r} has kind {kind!r}; a saved state is "
            "tinker://RUN/weights/NAME, sampler weights tinker://RUN/sampler_weights/NAME"
        )
    check_name(run, call)
    check_name(name, call)
    return run, kind, name


class StateStore:
    """The saved states under `<workdir>/checkpoints`."""

    def __init__(self, workdir: Path) -> None:
        self.root = workdir / "checkpoints"

    def folder(self, run: str, name: str) -> Path:
        return self.root / run / "weights" / name

    def prepare(self, run: str, name: object, overwrite: bool, call: str) -> tuple[str, Path]:
        """The path and an empty folder for a new state (`overwrite` replaces an old one)."""
        name = check_name(name, call)
        folder = self.folder(run, name)
        path = f"{SCHEME}{run}/weights/{name}"
        if (folder / STATE_FILE).is_file() and not overwrite:
            raise UserError(
                f"{call}: {path} exists; give another name or overwrite=True to replace it"
            )
        if folder.exists():  # replaced, or a save that did not finish
            shutil.rmtree(folder)
        folder.mkdir(parents=True)
        return path, folder

    def record(
        self, path: str, folder: Path, base_model: str, rank: int, metadata: dict | None
    ) -> None:
        """Write `state.json` last: a folder without it is a save that did not finish."""
        meta = {
            "base_model": base_model,
            "lora_rank": rank,
            "time": time.time(),
            "user_metadata": dict(metadata or {}),
            "path": path,
        }
        (folder / STATE_FILE).write_text(json.dumps(meta, indent=1))

    def get(self, path: object, call: str) -> SavedState:
        """The saved state at `path`, or an error saying why it cannot be loaded."""
        run, kind, name = parse(path, call)
        if kind != "weights":
            raise UserError(
                f"{call}: {path} holds sampler weights (save_weights_for_sampler), which only "
                "a sampling client reads; load a save_state path (tinker://RUN/weights/NAME)"
            )
        folder = self.folder(run, name)
        meta_file = folder / STATE_FILE
        if not meta_file.is_file():
            raise UserError(
                f"{call}: no state saved at {path} on this server (looked in {folder}); "
                "save_state returns the path, and a restarted server finds it only with the "
                "same --workdir"
            )
        meta = json.loads(meta_file.read_text())
        return SavedState(
            path=str(path),
            folder=folder,
            base_model=meta["base_model"],
            lora_rank=int(meta["lora_rank"]),
            time=float(meta["time"]),
            user_metadata=meta.get("user_metadata") or {},
        )

    def list(self, run: str) -> list[SavedState]:
        """The states saved from training client `run`, oldest first."""
        states = []
        for meta_file in sorted((self.root / run / "weights").glob(f"*/{STATE_FILE}")):
            name = meta_file.parent.name
            states.append(self.get(f"{SCHEME}{run}/weights/{name}", "list_checkpoints"))
        return sorted(states, key=lambda s: s.time)
