"""Multi-turn chat data for SFT: conversations -> token ids with a mask on assistant tokens.

A conversation is a list of `{role, content}` messages. The assistant mask is found by
rendering growing prefixes with the chat template: the tokens an assistant message adds after
`apply_chat_template(messages[:i], add_generation_prompt=True)` are that message's own
tokens (content and end-of-turn), so the header the template writes before it is not trained.
This needs a template whose rendering of a prefix is a prefix of the full rendering (true of
ChatML, Llama and most others); a template that is not is detected and refused.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow.parquet as pq
import torch

from tephra.controller.data.colour_squares import colour_square_rows
from tephra.controller.data.multimodal import row_images, with_vision_spans
from tephra.controller.data.prompts import DatasetError
from tephra.engine_api.batch import make_batch
from tephra.engine_api.multimodal import MULTIMODAL, MultimodalInputs, multimodal_column
from tephra.episodes.rewards import reasoning_gym_rows

if TYPE_CHECKING:
    from tensordict import TensorDict


def _ids(tokenizer: Any, messages: list[dict], generation_prompt: bool) -> list[int]:
    out = tokenizer.apply_chat_template(
        messages, add_generation_prompt=generation_prompt, tokenize=True
    )
    if hasattr(out, "keys"):
        out = out["input_ids"]
    return list(out)


def tokenize_conversation(
    tokenizer: Any, messages: list[dict], index: int = 0
) -> tuple[list[int], list[int]]:
    """(token ids, assistant mask) of one conversation."""
    full = _ids(tokenizer, messages, False)
    mask = [0] * len(full)
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        start = len(_ids(tokenizer, messages[:i], True)) if i else 0
        end_ids = _ids(tokenizer, messages[: i + 1], False)
        if full[: len(end_ids)] != end_ids:
            raise DatasetError(
                f"conversation {index}: the chat template renders a prefix of the conversation "
                "differently from the start of the whole conversation, so assistant tokens "
                "cannot be located; use a template without history-dependent rendering"
            )
        for t in range(start, len(end_ids)):
            mask[t] = 1
    if mask and mask[0]:
        mask[0] = 0  # nothing predicts the first token
    if not any(mask):
        raise DatasetError(f"conversation {index} has no assistant message to train on")
    return full, mask


def _rows(path: Path) -> list[dict]:
    if not path.exists():
        raise DatasetError(f"data file {path} does not exist; set data.train_files")
    if path.suffix == ".parquet":
        return pq.read_table(path).to_pylist()
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def load_conversations(path: str | Path) -> list[list[dict]]:
    """`messages` column of a parquet file or `.jsonl` lines; errors name row and field."""
    path = Path(path)
    return _conversations(_rows(path), path.name)


def _conversations(rows: list[dict], where: str) -> list[list[dict]]:
    out = []
    for i, row in enumerate(rows):
        messages = row.get("messages")
        if not isinstance(messages, list) or not messages:
            raise DatasetError(
                f"row {i} of {where}: field 'messages' is missing or empty; "
                "each row needs messages=[{role, content}, ...]"
            )
        for m in messages:
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise DatasetError(
                    f"row {i} of {where}: field 'messages' holds {m!r}, "
                    "not a {role, content} message"
                )
        out.append(messages)
    return out


def arithmetic_conversations(size: int, seed: int) -> list[list[dict]]:
    """Two-turn chats about reasoning-gym basic_arithmetic (the default SFT data)."""

    task = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
    return [
        [
            {"role": "user", "content": f"{row['question']}\nAnswer with just the final number."},
            {"role": "assistant", "content": row["ground_truth"]},
            {"role": "user", "content": "Are you sure?"},
            {"role": "assistant", "content": f"Yes, the answer is {row['ground_truth']}."},
        ]
        for row in reasoning_gym_rows("basic_arithmetic", size, seed, task)
    ]


TOOL_MULTIPLICATION_TASK = {
    "min_terms": 2,
    "max_terms": 2,
    "min_digits": 4,
    "max_digits": 4,
    "allow_negation": False,
    "allow_parentheses": False,
    "operators": ["*"],
}
"""reasoning-gym basic_arithmetic options of the tool demo: one product of two 4-digit numbers
(apps/ppo's tool_demo preset asks the same questions)."""

TOOL_INSTRUCTION = "Use the python tool."
"""Appended to each tool-demo question (apps/ppo's tool_demo `data.instruction`)."""


def tool_call_conversations(size: int, seed: int) -> list[list[dict]]:
    """Transcripts of the tool demo: a 4-digit product asked as the RL trainer asks it, one
    hermes-format `python` call that prints it, the sandbox's output (the printed line), then
    the bare number. The model learns to copy the operands into the call and the tool's output
    into the answer; it never has to multiply."""

    out = []
    for row in reasoning_gym_rows("basic_arithmetic", size, seed, TOOL_MULTIPLICATION_TASK):
        expression = row["question"].removeprefix("Calculate ").rstrip(".")
        call = json.dumps({"name": "python", "arguments": {"code": f"print({expression})"}})
        out.append(
            [
                {"role": "user", "content": f"{row['question']}\n{TOOL_INSTRUCTION}"},
                {"role": "assistant", "content": f"<tool_call>{call}</tool_call>"},
                {"role": "tool", "content": f"{row['ground_truth']}\n"},
                {"role": "assistant", "content": row["ground_truth"]},
            ]
        )
    return out


def pad_batch(examples: list[tuple], pad_id: int) -> TensorDict:
    """Right-padded `[B, T]` batch in the engine layout; examples with images (a third item)
    add the `multimodal` column engine-fsdp reads."""

    width = max(len(e[0]) for e in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.int64)
    attn = torch.zeros_like(ids)
    resp = torch.zeros_like(ids)
    for i, (tok, mask, *_) in enumerate(examples):
        ids[i, : len(tok)] = torch.tensor(tok)
        attn[i, : len(tok)] = 1
        resp[i, : len(tok)] = torch.tensor(mask)
    batch = make_batch(ids, attn, resp)
    images = [e[2] if len(e) > 2 else None for e in examples]
    if any(m is not None for m in images):
        batch[MULTIMODAL] = multimodal_column(images)
    return batch


Example = tuple[list[int], list[int], MultimodalInputs | None]
"""(token ids, assistant mask, images) of one conversation."""


def load_image_conversations(path: str | Path, processor: Any) -> list[Example]:
    """verl multimodal SFT rows: `messages` plus an `images` column (bytes, paths relative to
    the file, `{bytes, path}` structs or PIL images; `<image>` in the messages where each
    goes, as in `tephra.controller.data.multimodal`) -> token ids with each image expanded to
    its run of `<|image_pad|>` tokens (never trained), the assistant mask, and the images."""
    path = Path(path)
    return image_conversations(_rows(path), path.name, processor, path.parent)


def image_conversations(
    rows: list[dict], where: str, processor: Any, base_dir: Path | None = None
) -> list[Example]:
    """`load_image_conversations` of rows already read (`where` names them in errors)."""

    out: list[Example] = []
    for i, (row, messages) in enumerate(zip(rows, _conversations(rows, where), strict=True)):
        images = row_images(row, i, where, base_dir)
        messages = with_vision_spans(messages, i, where, processor, len(images))
        ids, mask = tokenize_conversation(processor.tokenizer, messages, i)
        if not images:
            out.append((ids, mask, None))
            continue
        mm = processor.images(images)
        counts = iter(processor.image_token_counts(mm))
        full, full_mask = [], []
        for t, m in zip(ids, mask, strict=True):
            n = next(counts) if t == processor.image_token_id else 1
            full += [t] * n
            full_mask += [m] * n
        out.append((full, full_mask, mm))
    return out


def colour_square_conversations(size: int, seed: int, processor: Any) -> list[Example]:
    """Transcripts of the synthetic image task (`tephra.controller.data.colour_squares`): `size`
    rows drawn by `seed`, each question answered with the row's ground truth (the colour)."""

    rows = [
        {
            "messages": r["prompt"]
            + [{"role": "assistant", "content": r["reward_model"]["ground_truth"]}],
            "images": r["images"],
        }
        for r in colour_square_rows(size, seed)
    ]
    return image_conversations(rows, "colour_squares", processor)
