"""The `search` tool (against a hand-computed BM25), the `mcp` tools (against an MCP server the
test starts over stdio) and YAML tool loading with its error messages."""

from __future__ import annotations

import asyncio
import json
import math
import re
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from tephra.episodes.tools import (
    TOOLS,
    MCPToolset,
    SearchTool,
    Tool,
    ToolConfigError,
    ToolResult,
    load_tools,
)

CORPUS = [
    {"id": "fr", "text": "Paris is the capital city of France"},
    {"id": "de", "text": "Berlin is the capital city of Germany and Berlin is large"},
    {"id": "py", "text": "Python is a programming language"},
    {"id": "cat", "text": "cats sleep most of the day"},
]


def words(text: str) -> list[str]:
    return re.findall(r"\b\w\w+\b", text.lower())  # bm25s's default token pattern


def bm25_reference(query: list[str], docs: list[list[str]], k1=1.5, b=0.75) -> list[float]:
    """Lucene BM25 (no (k1 + 1) numerator, as Lucene >= 8) written out term by term."""
    n = len(docs)
    avgdl = sum(len(d) for d in docs) / n
    scores = []
    for doc in docs:
        score = 0.0
        for term in set(query):
            df = sum(term in d for d in docs)
            tf = doc.count(term)
            if tf:
                idf = math.log(1 + (n - df + 0.5) / (df + 0.5))
                score += idf * tf / (tf + k1 * (1 - b + b * len(doc) / avgdl))
        scores.append(score)
    return scores


@pytest.fixture
def corpus_file(tmp_path):
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in CORPUS))
    return path


def test_search_ranks_like_hand_computed_bm25(corpus_file):
    tool = SearchTool(str(corpus_file), top_k=2, stopwords=None)
    docs = [words(row["text"]) for row in CORPUS]
    query = "capital of Germany"
    ref = bm25_reference(words(query), docs)
    hits = tool.search(query)
    order = sorted(range(len(docs)), key=lambda i: -ref[i])[:2]
    assert [h[0] for h in hits] == [CORPUS[i]["id"] for i in order] == ["de", "fr"]
    assert [h[2] for h in hits] == pytest.approx([ref[i] for i in order], rel=1e-5)
    result = asyncio.run(tool.execute("x", {"query": query}))
    assert (
        result.error is None and result.text.splitlines()[0] == f"[1] (id de) {CORPUS[1]['text']}"
    )
    assert (
        asyncio.run(tool.execute("x", {"query": "zebra"})).text == "No passage matches the query."
    )
    assert (
        asyncio.run(tool.execute("x", {})).error
        == "argument 'query' (a non-empty string) is missing"
    )


def test_search_corpus_errors_name_the_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": 1, "text": "ok"}\n{"id": 2}\n')
    with pytest.raises(ToolConfigError, match="line 2 of .*needs a string field 'text'"):
        SearchTool(str(bad))
    with pytest.raises(ToolConfigError, match="does not exist"):
        SearchTool(str(tmp_path / "missing.jsonl"))


SERVER = textwrap.dedent('''
    from mcp.server.mcpserver import MCPServer
    server = MCPServer("calc")

    @server.tool()
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    @server.tool()
    def shout(text: str) -> str:
        """Upper-case the text."""
        if not text:
            raise ValueError("empty text")
        return text.upper()

    if __name__ == "__main__":
        server.run("stdio")
''')


class Doubler(Tool):
    name = "double"
    description = "Double a number."
    parameters = {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]}

    def __init__(self, factor: int = 2):
        self.factor = factor

    async def execute(self, instance_id, arguments):
        return ToolResult(str(arguments["x"] * self.factor))


def test_yaml_loads_builtin_custom_and_mcp_tools(tmp_path, corpus_file):
    server = tmp_path / "server.py"
    server.write_text(SERVER)
    tools_yaml = tmp_path / "tools.yaml"
    tools_yaml.write_text(
        textwrap.dedent(f"""
        tools:
          - class: search
            config: {{corpus_path: {corpus_file}, top_k: 1}}
          - class: {__name__}:Doubler
            config: {{factor: 3}}
          - class: mcp
            config: {{transport: stdio, command: {sys.executable}, args: [{server}], prefix: "calc_"}}
    """)
    )
    tools = load_tools(tools_yaml)
    try:
        assert sorted(tools) == ["calc_add", "calc_shout", "double", "search"]
        add = tools["calc_add"]
        assert add.schema()["function"]["description"] == "Add two integers."
        assert (
            add.parameters["required"] == ["a", "b"]
            and add.parameters["properties"]["a"]["type"] == "integer"
        )

        async def calls():
            return await asyncio.gather(
                add.execute("i", {"a": 2, "b": 40}),
                tools["calc_shout"].execute("i", {"text": "hi"}),
                tools["calc_shout"].execute("i", {"text": ""}),
                tools["double"].execute("i", {"x": 5}),
            )

        added, shouted, failed, doubled = asyncio.run(calls())
        assert (added.text, shouted.text, doubled.text) == ("42", "HI", "15")
        assert failed.error is not None and failed.text == ""
        # the connection outlives one event loop: a second asyncio.run reuses it
        assert asyncio.run(add.execute("i", {"a": 1, "b": 1})).text == "2"
    finally:
        tools["calc_add"].toolset.close()


def test_mcp_connection_errors_are_clear(tmp_path):
    with pytest.raises(ToolConfigError, match="transport 'http' needs `url`"):
        MCPToolset(transport="http")
    broken = tmp_path / "broken.py"
    broken.write_text("raise SystemExit(3)\n")
    with pytest.raises(Exception, match="could not connect to the server"):
        MCPToolset(command=sys.executable, args=[str(broken)], timeout_s=20).tools()


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("- class: nowhere.module:Thing\n", r"entry 0: cannot import module 'nowhere.module'"),
        (
            f"- class: search\n  config: {{top_k: 1}}\n- class: {__name__}:Nope\n",
            r"entry 0: building 'search' failed",
        ),
        (f"- class: {__name__}:Nope\n", rf"entry 0: module '{__name__}' has no attribute 'Nope'"),
        (
            f"- class: {__name__}:bm25_reference\n",
            r"entry 0: .* is not a subclass of tephra.episodes.tools.Tool",
        ),
        ("- class: pythn\n", r"neither a registered tool \(mcp, python, search\)"),
        (
            f"- class: {__name__}:Doubler\n- class: {__name__}:Doubler\n",
            r"entry 1: tool name 'double' is already used",
        ),
        ("- {config: {}}\n", r"entry 0: expected a mapping with key 'class'"),
        ("tools: 3\n", r"expected a list of \{class, config\} entries"),
    ],
)
def test_yaml_errors_name_the_file_and_entry(tmp_path, content, message):
    path = tmp_path / "tools.yaml"
    path.write_text(content)
    with pytest.raises(ToolConfigError, match=message) as info:
        load_tools(path)
    assert str(path) in str(info.value)


def test_registry_lists_the_builtins():
    assert TOOLS.names() == ["mcp", "python", "search"]


def test_mcp_over_streamable_http(tmp_path):
    with socket.socket() as probe:  # a free local port for the server
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = tmp_path / "http_server.py"
    server.write_text(
        SERVER.replace('server.run("stdio")', f'server.run("streamable-http", port={port})')
    )
    proc = subprocess.Popen(
        [sys.executable, str(server)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    toolset = MCPToolset(transport="http", url=f"http://127.0.0.1:{port}/mcp", timeout_s=30)
    try:
        deadline = time.monotonic() + 60
        while True:  # wait until the server listens
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, (
                    "MCP HTTP server did not start"
                )
                time.sleep(0.2)
        tools = {t.name: t for t in toolset.tools()}
        assert sorted(tools) == ["add", "shout"]
        assert asyncio.run(tools["add"].execute("i", {"a": 20, "b": 22})).text == "42"
    finally:
        toolset.close()
        proc.terminate()
        proc.wait(timeout=10)
