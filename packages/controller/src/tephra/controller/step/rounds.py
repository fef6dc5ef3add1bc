"""A step's rounds of generation: the prompts they draw from, their samples and kept groups,
their sampling seeds, and their JSON form in a checkpoint (the batch generated ahead)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from tephra.controller.samples import Prompt, Sample, sample_from_dict, sample_to_dict
from tephra.engine_api.multimodal import MultimodalInputs
from tephra.episodes.rewards import is_timeout


@dataclass
class Prompts:
    """A prompt set: its prompts as loaded and their token ids (same order)."""

    ids: list[list[int]]
    records: list[Prompt]
    """The prompts as the data set's rows gave them."""
    multimodal: list[MultimodalInputs | None] | None = None
    """Each prompt's images (pixel values and grids), or None for text prompts."""

    def item(self, i: int, sample_id: str) -> Prompt:
        """Prompt `i` as the workers get it: tokenised, with its images, named `sample_id`."""
        mm = self.multimodal[i] if self.multimodal is not None else None
        return replace(self.records[i], prompt_ids=self.ids[i], sample_id=sample_id, multimodal=mm)


@dataclass
class Round:
    """One round of generation in a step: its samples (prompt-major, `n` per prompt, scored)
    and which prompt groups the step trains on."""

    items: list[Prompt]
    samples: list[Sample]
    n: int
    kept_groups: list[int] = field(default_factory=list)
    informative: int = 0
    """Groups whose samples did not all score the same (dynamic sampling)."""
    filler: int = 0
    """How many of the kept groups are flat ones added to fill the batch."""
    indices: list[int] = field(default_factory=list)
    """The prompts' indices in the training set (the items are rebuilt from them)."""
    tag: str = ""
    """Prefix of the items' sample ids."""
    scored: bool = False
    """Whether the samples' scores were collected from the workers."""

    @property
    def scores(self) -> list[float]:
        return [s.reward.score for s in self.samples]

    @property
    def errors(self) -> int:
        return sum(s.reward.error is not None for s in self.samples)

    @property
    def timeouts(self) -> int:
        """Samples whose scorer did not return within `reward.timeout_s` (among `errors`)."""
        return sum(is_timeout(s.reward.error) for s in self.samples)

    @property
    def clipped(self) -> int:
        """Samples whose score `reward.clip` moved into its range."""
        return sum(s.reward.clipped for s in self.samples)

    def kept_names(self) -> list[str]:
        """Each kept sample as an error message names it: prompt id, dataset row, data_source."""
        names = []
        for g in self.kept_groups:
            item = self.items[g]
            row = f", dataset row {self.indices[g]}" if self.indices else ""
            names += [f"prompt {item.sample_id!r}{row}, data_source {item.data_source!r}"] * self.n
        return names

    @property
    def n_groups(self) -> int:
        return len(self.samples) // self.n

    def keep(self, groups: list[int], filler: bool = False) -> None:
        self.kept_groups = sorted(set(self.kept_groups) | set(groups))
        self.filler += len(groups) if filler else 0

    @property
    def kept(self) -> list[Sample]:
        return [self.samples[g * self.n + k] for g in self.kept_groups for k in range(self.n)]


PENDING_FILE = "pending_batch.json"
"""The batch generated ahead (trainer.mode=one_step_off), in a checkpoint folder."""


def round_to_dict(rnd: Round) -> dict[str, Any]:
    """A round as JSON data; its items are rebuilt from `indices` and `tag` on load."""
    return {
        "indices": rnd.indices,
        "tag": rnd.tag,
        "n": rnd.n,
        "kept_groups": rnd.kept_groups,
        "informative": rnd.informative,
        "filler": rnd.filler,
        "scored": rnd.scored,
        "samples": [sample_to_dict(s) for s in rnd.samples],
    }


def round_from_dict(data: dict[str, Any], items: list[Prompt]) -> Round:
    """The inverse of `round_to_dict`, given the items rebuilt from its `indices`."""
    samples = [sample_from_dict(s) for s in data["samples"]]
    for k, s in enumerate(samples):  # images are not in the JSON: they come from the prompts
        s.multimodal = items[k // data["n"]].multimodal
    return Round(
        items,
        samples,
        data["n"],
        kept_groups=list(data["kept_groups"]),
        informative=data["informative"],
        filler=data["filler"],
        indices=list(data["indices"]),
        tag=data["tag"],
        scored=data["scored"],
    )


def round_seed(run_seed: int, step: int, r: int) -> int:
    """The sampling seed of round `r` of step `step`: a 62-bit hash of the three, so that
    rounds' seed ranges never meet (sample j of the batch's prompt i samples from seed +
    i * n + j, `SamplingParams.seed`; consecutive seeds per step would replay one step's
    random stream in the next)."""
    digest = hashlib.blake2b(f"{run_seed}/{step}/{r}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2


def write_pending(folder: Path, rounds: list[Round]) -> None:
    """Save the batch generated ahead into a checkpoint folder (the samples themselves:
    resuming needs no old weights)."""
    (folder / PENDING_FILE).write_text(json.dumps([round_to_dict(r) for r in rounds]))


def read_pending(
    folder: Path, rebuild: Callable[[list[int], str], list[Prompt]]
) -> list[Round] | None:
    """The batch generated ahead saved in a checkpoint folder, or None; `rebuild(indices,
    tag)` gives each round's items back from the training prompts."""
    path = folder / PENDING_FILE
    if not path.exists():
        return None
    return [
        round_from_dict(r, rebuild(r["indices"], r["tag"])) for r in json.loads(path.read_text())
    ]
