"""The `search` tool: BM25 retrieval over a local corpus with the `bm25s` library.

Corpus: a JSON-lines file, one `{"id": ..., "text": ...}` per line. Tokens are lower-cased
words of two or more characters (English stop words dropped by default). Scores are Lucene's
BM25 (bm25s `method="lucene"`; no (k1 + 1) numerator, which does not change the ranking):

    idf(t)      = ln(1 + (N - df_t + 0.5) / (df_t + 0.5))
    score(q, d) = sum over distinct query terms t in d of
                  idf(t) * tf_{t,d} / (tf_{t,d} + k1 * (1 - b + b * |d| / avgdl))
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from tephra.episodes.tools.base import Tool, ToolConfigError, ToolError, ToolResult


def read_corpus(path: str | Path) -> tuple[list[str], list[str]]:
    """(ids, texts) of a jsonl corpus; errors name the line and the fix."""
    path = Path(path)
    if not path.is_file():
        raise ToolConfigError(
            f"search tool: corpus_path {str(path)!r} does not exist (a .jsonl file of {{id, text}})"
        )
    ids, texts = [], []
    with path.open() as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ToolConfigError(
                    f"search tool: line {number} of {str(path)!r} is not JSON: {exc.msg}"
                ) from exc
            if not isinstance(row, dict) or "text" not in row or not isinstance(row["text"], str):
                raise ToolConfigError(
                    f"search tool: line {number} of {str(path)!r} needs a string field 'text' (and an 'id')"
                )
            ids.append(str(row.get("id", number)))
            texts.append(row["text"])
    if not texts:
        raise ToolConfigError(f"search tool: corpus {str(path)!r} holds no passages")
    return ids, texts


class SearchTool(Tool):
    """Returns the `top_k` passages of the corpus that best match the query (score > 0)."""

    description = "Search a local collection of passages and return the best-matching ones."
    parameters = {
        "type": "object",
        "properties": {"query": {"type": "string", "description": "Keywords to search for."}},
        "required": ["query"],
    }

    def __init__(
        self,
        corpus_path: str,
        top_k: int = 3,
        name: str = "search",
        k1: float = 1.5,
        b: float = 0.75,
        stopwords: str | None = "en",
        max_passage_chars: int = 1000,
    ) -> None:
        import bm25s  # seconds to import (scipy): only the search tool needs it

        if top_k < 1:
            raise ToolConfigError(f"search tool: top_k={top_k} must be >= 1")
        self.name = name
        self.top_k = top_k
        self.stopwords = stopwords
        self.max_passage_chars = max_passage_chars
        self.ids, self.texts = read_corpus(corpus_path)
        self._bm25s = bm25s
        self.retriever = bm25s.BM25(k1=k1, b=b, method="lucene")
        self.retriever.index(self._tokenize(self.texts), show_progress=False)

    def _tokenize(self, texts: list[str]) -> Any:
        return self._bm25s.tokenize(texts, stopwords=self.stopwords, show_progress=False)

    def search(self, query: str) -> list[tuple[str, str, float]]:
        """(id, text, score) of the best passages, best first; only positive scores."""
        if self.retriever is None:
            raise ToolError(f"search tool {self.name!r} was closed; build a new one to search")
        k = min(self.top_k, len(self.texts))
        docs, scores = self.retriever.retrieve(self._tokenize([query]), k=k, show_progress=False)
        return [
            (self.ids[int(d)], self.texts[int(d)], float(s))
            for d, s in zip(docs[0], scores[0])
            if s > 0
        ]

    def close(self) -> None:
        """Drop the index and the passages (the tool's memory); searching afterwards is an
        error."""
        self.retriever = None
        self.ids, self.texts = [], []

    async def execute(self, instance_id: str, arguments: dict[str, Any]) -> ToolResult:
        query = arguments.get("query")
        if not isinstance(query, str) or not query.strip():
            return ToolResult("", error="argument 'query' (a non-empty string) is missing")
        hits = await asyncio.to_thread(self.search, query)  # large corpora take a while
        if not hits:
            return ToolResult("No passage matches the query.", metrics={"hits": 0.0})
        text = "\n".join(
            f"[{i}] (id {pid}) {passage[: self.max_passage_chars]}"
            for i, (pid, passage, _) in enumerate(hits, 1)
        )
        return ToolResult(text, metrics={"hits": float(len(hits))})
