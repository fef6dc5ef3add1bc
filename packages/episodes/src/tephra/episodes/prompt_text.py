"""Whether a prompt's messages hold any text: a prompt that is empty once its whitespace is
dropped asks the model nothing, and a data set of them trains on noise."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

SHOWN_ROWS = 10
"""Rows an error lists before it says how many more there are."""


def message_has_content(content: Any) -> bool:
    """Text with a non-space character, or a list of content parts of which one is such a
    text or a non-text part (an image, an audio clip)."""
    if isinstance(content, str):
        return bool(content.strip())
    if isinstance(content, list | tuple):
        for part in content:
            if not isinstance(part, dict):
                return bool(str(part).strip())
            if part.get("type", "text") != "text":
                return True
            if str(part.get("text") or "").strip():
                return True
    return False


def empty_prompt_rows(prompts: Sequence[Sequence[dict[str, Any]]]) -> list[int]:
    """Indices of the prompts (lists of {role, content} messages) none of whose messages has
    content (see `message_has_content`)."""
    return [
        i
        for i, messages in enumerate(prompts)
        if not any(message_has_content(m.get("content")) for m in messages)
    ]


def rows_phrase(rows: Sequence[int]) -> str:
    """'rows 3, 7 and 9' / 'rows 1, 2, ... (and 40 more)': the first `SHOWN_ROWS` of `rows`."""
    shown = ", ".join(str(r) for r in rows[:SHOWN_ROWS])
    more = f" (and {len(rows) - SHOWN_ROWS} more)" if len(rows) > SHOWN_ROWS else ""
    return f"row{'s' if len(rows) > 1 else ''} {shown}{more}"
