"""Prompt data: verl-format parquet, Hugging Face datasets, reasoning-gym tasks.

Every source becomes a list of `Prompt` (`tephra.episodes.prompt`, the one prompt type of the
plain and the agent path), from the verl row format:
    prompt        list of chat messages [{"role": ..., "content": ...}] (`Prompt.messages`)
    data_source   name that selects the reward scorer (e.g. "gsm8k", "reasoning_gym/basic_arithmetic")
    ground_truth  the answer the scorer compares with (`reward_model.ground_truth` in parquet)
    extra_info    anything else the scorer may need (a dict); verl's agentic fields inside it:
                  `tools_kwargs` ({tool: {"create_kwargs": {...}}}: per-row arguments of the
                  tool's `create`, e.g. a ground truth for its reward) and `interaction_kwargs`
                  (the environment's per-row arguments)
    agent_name    (optional) the episode that runs the row, a name in EPISODES
Prompts are tokenized with the tokenizer's chat template; prompts longer than the budget are
dropped and counted. `PromptLoader` walks the records in a seeded order, `prompts_per_step` at
a time, and its position is part of a checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tephra.engine_api.errors import ConfigError, TephraError
from tephra.episodes.prompt import Prompt
from tephra.episodes.prompt_text import empty_prompt_rows, rows_phrase
from tephra.episodes.registry import EPISODES
from tephra.episodes.rewards import reasoning_gym_rows


class DatasetError(TephraError, ValueError):
    """A data file or row cannot be used; the message names the row, the field and the fix."""


_UNUSED_TOOL_KWARGS = ("execute_kwargs", "calc_reward_kwargs", "release_kwargs")


def agentic_fields(
    row: dict[str, Any], extra: dict[str, Any], fail: Callable[[str, str], DatasetError]
) -> tuple[dict[str, dict[str, Any]], dict[str, Any], str | None]:
    """verl's per-row agentic fields: (tool create kwargs by tool, interaction kwargs, agent
    name). A parquet struct column fills absent keys with None; those count as absent."""
    tools_kwargs = extra.get("tools_kwargs") or {}
    if not isinstance(tools_kwargs, dict):
        raise fail("extra_info.tools_kwargs", f"is {tools_kwargs!r}, not a dict by tool name")
    tool_kwargs: dict[str, dict[str, Any]] = {}
    for tool, spec in tools_kwargs.items():
        if spec is None:
            continue
        where = f"extra_info.tools_kwargs.{tool}"
        if not isinstance(spec, dict):
            raise fail(where, f'is {spec!r}, not {{"create_kwargs": {{...}}}}')
        unknown = sorted(set(spec) - {"create_kwargs", *_UNUSED_TOOL_KWARGS})
        if unknown:
            raise fail(where, f"has keys {unknown}; tephra reads 'create_kwargs'")
        used = [k for k in _UNUSED_TOOL_KWARGS if spec.get(k)]
        if used:
            raise fail(
                where,
                f"sets {used}; tephra passes per-row arguments to the tool's create only: "
                "move them into 'create_kwargs' and keep them in the tool's state",
            )
        create = spec.get("create_kwargs") or {}
        if not isinstance(create, dict):
            raise fail(f"{where}.create_kwargs", f"is {create!r}, not a dict")
        tool_kwargs[tool] = {k: v for k, v in create.items() if v is not None}
    interaction = extra.get("interaction_kwargs") or {}
    if not isinstance(interaction, dict):
        raise fail("extra_info.interaction_kwargs", f"is {interaction!r}, not a dict")
    agent = row.get("agent_name")
    if agent is not None:
        if not isinstance(agent, str) or agent not in EPISODES.names():
            raise fail("agent_name", f"is {agent!r}, not an episode in {EPISODES.names()}")
    return tool_kwargs, {k: v for k, v in interaction.items() if v is not None}, agent or None


def record_from_row(row: dict[str, Any], index: int, where: str) -> Prompt:
    """Validate one verl-format row; errors name the row and the missing field."""

    def fail(field_name: str, why: str) -> DatasetError:
        return DatasetError(
            f"row {index} of {where}: field {field_name!r} {why}; each row needs 'prompt' "
            "(list of {role, content} messages), 'data_source' (string) and "
            "'reward_model.ground_truth' (see the controller README, Data format)"
        )

    prompt = _text(row.get("prompt"), fail, "prompt")
    if prompt is None:
        raise fail("prompt", "is missing")
    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    if not isinstance(prompt, list | tuple) or not prompt:
        raise fail("prompt", f"is {prompt!r}, not a non-empty list of messages")
    messages = []
    for m in prompt:
        # a struct column fills a missing key with None, so None counts as missing
        if (
            not isinstance(m, dict)
            or not isinstance(m.get("role"), str)
            or m.get("content") is None
        ):
            raise fail("prompt", f"holds {m!r}, not a {{role, content}} message")
        content = _text(m.get("content"), fail, "prompt.content")
        if not isinstance(content, str | list):  # a list: multimodal content parts
            raise fail("prompt.content", f"is {content!r}, not text")
        messages.append({**m, "content": content})
    source = row.get("data_source")
    if not isinstance(source, str) or not source:
        raise fail("data_source", "is missing" if source is None else f"is {source!r}, not a name")
    reward_model = row.get("reward_model")
    truth = reward_model.get("ground_truth") if isinstance(reward_model, dict) else None
    truth = _text(truth, fail, "reward_model.ground_truth")
    if truth is None:
        raise fail("reward_model.ground_truth", "is missing")
    if isinstance(truth, str | list | dict) and not (
        truth.strip() if isinstance(truth, str) else truth
    ):
        # an empty answer scores every response wrong (or right): the row trains nothing
        raise fail("reward_model.ground_truth", f"is empty ({truth!r})")
    extra = row.get("extra_info") or {}
    if isinstance(extra, str):
        try:
            extra = json.loads(extra)
        except json.JSONDecodeError as exc:
            raise fail("extra_info", f"is a string but not JSON ({exc})") from None
    if not isinstance(extra, dict):
        raise fail("extra_info", f"is {type(extra).__name__}, not a dict (or a JSON object)")
    tool_kwargs, interaction_kwargs, agent_name = agentic_fields(row, extra, fail)
    return Prompt(
        messages,
        source,
        truth,
        dict(extra),
        tool_kwargs,
        interaction_kwargs,
        agent_name,
        origin=f"row {index} of {where}",
    )


def _text(value: Any, fail: Callable[[str, str], DatasetError], field_name: str) -> Any:
    """`value`, with bytes (a binary column) decoded as UTF-8; other bytes are an error."""
    if not isinstance(value, bytes):
        return value
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise fail(
            field_name,
            f"holds bytes that are not UTF-8 ({exc.reason} at byte "
            f"{exc.start}); re-encode the file as UTF-8",
        ) from None


def load_parquet(path: str | Path) -> list[Prompt]:
    """Rows of a verl-format parquet file."""
    import pyarrow.parquet as pq  # heavy: only parquet data needs it

    path = Path(path)
    if not path.exists():
        raise DatasetError(
            f"data file {path} does not exist; set data.train_files to a parquet file"
        )
    try:
        rows = pq.read_table(path).to_pylist()
    except (OSError, ValueError) as exc:  # pyarrow: not parquet, truncated, bad UTF-8
        raise DatasetError(
            f"data file {path} cannot be read as parquet ({exc}); set "
            "data.train_files to a parquet file (verl row format)"
        ) from None
    if not rows:
        raise DatasetError(
            f"data file {path} has no rows; add rows or remove it from "
            "data.train_files / data.val_files"
        )
    return refuse_empty_prompts(
        [record_from_row(r, i, path.name) for i, r in enumerate(rows)], str(path)
    )


DATA_FILE_BUILDERS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".csv": "csv"}
"""File suffix -> the `datasets` builder that reads it (`load_hf_dataset` of a single file)."""


def load_hf_dataset(name: str, split: str = "train") -> list[Prompt]:
    """Rows of a Hugging Face dataset, each validated as a verl-format row.

    `name` is one of: a folder written by `Dataset.save_to_disk` / `DatasetDict.save_to_disk`
    (read with `load_from_disk`; `split` picks from a DatasetDict); a folder of data files or
    a single .parquet / .jsonl / .json / .csv file (read with `load_dataset`; a single file is
    the split "train"); otherwise a Hub name (`load_dataset(name, split=split)`, which needs
    the network or the local Hub cache). A local path that does not exist is an error here,
    not a Hub lookup.
    """
    import datasets  # heavy (seconds): only Hub data sets need it

    where = f"{name}[{split}]"
    path = Path(name).expanduser()
    if path.is_dir() and ((path / "dataset_dict.json").exists() or (path / "state.json").exists()):
        ds = datasets.load_from_disk(str(path))
        if isinstance(ds, datasets.DatasetDict):
            if split not in ds:
                raise DatasetError(
                    f"hf dataset {name}: no split {split!r}; it has "
                    f"{sorted(ds)} (write data.train_files as 'path:split')"
                )
            ds = ds[split]
    elif path.is_file():
        builder = DATA_FILE_BUILDERS.get(path.suffix)
        if builder is None:
            raise DatasetError(
                f"hf dataset {name}: cannot read {path.suffix!r} files; use one of "
                f"{sorted(DATA_FILE_BUILDERS)}, a save_to_disk folder or a Hub name"
            )
        if split != "train":
            raise DatasetError(
                f"hf dataset {name}: a single file holds only the split 'train', "
                f"not {split!r}; give one file per split"
            )
        ds = datasets.load_dataset(builder, data_files=str(path), split="train")
    elif path.is_dir() or not (path.is_absolute() or name.startswith((".", "~"))):
        try:
            ds = datasets.load_dataset(str(path) if path.is_dir() else name, split=split)
        except ValueError as exc:  # an unknown split names the splits it has
            raise DatasetError(f"hf dataset {where}: {exc}") from exc
    else:
        raise DatasetError(
            f"hf dataset {name} does not exist; set data.train_files to a "
            "save_to_disk folder, a data file or folder, or a Hub name"
        )
    records = []
    try:
        for i, row in enumerate(ds):
            records.append(record_from_row(row, i, where))
    except UnicodeDecodeError as exc:  # pyarrow decodes strings lazily, row by row
        raise DatasetError(
            f"row {len(records)} of {where}: text that is not UTF-8 ({exc}); "
            "re-encode the file as UTF-8"
        ) from None
    return refuse_empty_prompts(records, where)


def refuse_empty_prompts(records: list[Prompt], where: str) -> list[Prompt]:
    """`records`, unless a prompt has no text (only whitespace, or nothing, in every message):
    then a DatasetError naming how many and which rows of `where`."""
    empty = empty_prompt_rows([r.messages for r in records])
    if empty:
        raise DatasetError(
            f"{len(empty)} of {len(records)} prompts of {where} are empty (no text in any "
            f"message): {rows_phrase(empty)}; give each row's 'prompt' a question, or remove "
            "those rows"
        )
    return records


REASONING_GYM_PREFIX = "reasoning_gym/"

DEFAULT_INSTRUCTION = "Answer with just the final number."


def reasoning_gym_records(
    task: str,
    size: int,
    seed: int,
    task_config: dict[str, Any] | None = None,
    instruction: str = DEFAULT_INSTRUCTION,
) -> list[Prompt]:
    """`size` items of a reasoning-gym task, generated offline and reproducibly by `seed`: the
    rows of `tephra.episodes.rewards.reasoning_gym_rows` as prompts, `instruction`
    appended to each question."""
    try:
        # the prompt asks for just the number, so the last number is the answer
        rows = reasoning_gym_rows(
            task, size, seed, task_config, extract="last_number", prefix=REASONING_GYM_PREFIX
        )
    except Exception as exc:  # reasoning-gym raises various types for unknown tasks/options
        raise ConfigError(
            f"data: reasoning-gym task {task!r} with {task_config} failed: {exc}"
        ) from exc
    out = []
    for row in rows:
        question = row["question"]
        content = f"{question}\n{instruction}" if instruction else question
        out.append(
            Prompt(
                messages=[{"role": "user", "content": content}],
                data_source=row["data_source"],
                ground_truth=row["ground_truth"],
                # the entry travels as JSON (the episodes package's reasoning_gym scorer format)
                extra_info={"reasoning_gym": row["extra_info"]["reasoning_gym"]},
            )
        )
    return out


def chat_prompt_ids(tokenizer: Any, messages: list[dict]) -> list[int]:
    """The tokenizer's chat template of `messages`, ending with the assistant header."""
    toks = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if hasattr(toks, "keys"):  # transformers 5 returns a BatchEncoding
        toks = toks["input_ids"]
    return list(toks)


def tokenize_prompts(
    records: list[Prompt],
    tokenizer: Any,
    max_prompt_tokens: int,
    render: Callable[[list[dict]], list[int]] | None = None,
) -> tuple[list[list[int]], list[Prompt], int]:
    """Chat-template token ids of each prompt; returns (ids, kept records, number dropped).

    `render` turns a prompt's messages into ids (default: the tokenizer's chat template; an
    agent loop passes its own, which also lists the tools). A prompt longer than
    `max_prompt_tokens` is dropped (a truncated question is a different question), and the
    count is reported so that a bad budget is visible.
    """
    render = render or (lambda messages: chat_prompt_ids(tokenizer, messages))
    ids, kept, dropped = [], [], 0
    for rec in records:
        toks = render(rec.messages)
        if len(toks) > max_prompt_tokens:
            dropped += 1
            continue
        ids.append(toks)
        kept.append(rec)
    if not kept:
        raise DatasetError(
            f"every one of {len(records)} prompts is longer than data.max_prompt_tokens="
            f"{max_prompt_tokens}; raise it"
        )
    return ids, kept, dropped


def dataset_fingerprint(prompt_ids: list[list[int]]) -> str:
    """A short hash of the tokenised training prompts, in order: what a checkpoint's position
    in the data refers to."""
    digest = hashlib.sha256()
    for ids in prompt_ids:
        digest.update(len(ids).to_bytes(4, "little"))
        digest.update(b"".join(i.to_bytes(4, "little", signed=True) for i in ids))
    return digest.hexdigest()[:16]


class PromptLoader:
    """Seeded epochs over the prompts, `prompts_per_step` at a time; resumable, and only over
    the data its state was saved on (`fingerprint`).

    Every prompt is served exactly once per epoch, also when the number of prompts is not a
    multiple of `prompts_per_step`: the step that reaches the end of an epoch takes the
    epoch's last prompts (carried) and fills up from the next epoch, whose order begins with
    prompts other than the carried ones (so no step holds one prompt twice)."""

    def __init__(
        self, num_prompts: int, prompts_per_step: int, seed: int, fingerprint: str = ""
    ) -> None:
        if num_prompts < prompts_per_step:
            raise ConfigError(
                f"the training set has {num_prompts} prompts after filtering, fewer than "
                f"batch.prompts_per_step={prompts_per_step}; add data or lower prompts_per_step"
            )
        self.num_prompts, self.prompts_per_step, self.seed = num_prompts, prompts_per_step, seed
        self.fingerprint = fingerprint
        self.epoch, self.position = 0, 0
        self.carried: list[int] = []
        """The previous epoch's last prompts, served in the step that began this epoch."""
        self._order = self._shuffle()

    def _shuffle(self) -> list[int]:
        order = list(range(self.num_prompts))
        random.Random(self.seed * 100_003 + self.epoch).shuffle(order)
        if not self.carried:
            return order
        # the epoch's first prompts fill the step the carried ones began: none of those
        carried = set(self.carried)
        fill = [i for i in order if i not in carried][: self.prompts_per_step - len(carried)]
        first = set(fill)
        return fill + [i for i in order if i not in first]

    def next_indices(self) -> list[int]:
        """Indices of the next step's prompts: `prompts_per_step` distinct ones; a step that
        reaches the end of an epoch ends it and begins the next."""
        out = self._order[self.position : self.position + self.prompts_per_step]
        self.position += len(out)
        if len(out) < self.prompts_per_step:
            self.epoch, self.carried = self.epoch + 1, out
            self._order = self._shuffle()
            self.position = self.prompts_per_step - len(out)
            out = out + self._order[: self.position]
        return out

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "carried": list(self.carried),
            "num_prompts": self.num_prompts,
            "fingerprint": self.fingerprint,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue at the saved position (`check_same_data` first, before Ray starts)."""
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self.carried = [int(i) for i in state.get("carried", [])]  # absent before 0.3.0
        self._order = self._shuffle()


def check_same_data(saved: dict[str, Any], fingerprint: str, num_prompts: int, where: str) -> None:
    """Refuse to continue a saved data position (`PromptLoader.state_dict`) over other data:
    the position would point at other prompts, repeating some and skipping others."""
    if saved.get("fingerprint") in (None, "", fingerprint):
        return
    raise ConfigError(
        f"the checkpoint {where} was trained on other data ({saved.get('num_prompts')} prompts, "
        f"fingerprint {saved['fingerprint']}; now {num_prompts} prompts, {fingerprint}): its "
        "position in the data would not match. Restore that data, start a fresh run_dir, or set "
        "trainer.accept_changed_data=true to continue at the saved position anyway"
    )
