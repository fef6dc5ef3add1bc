"""A stand-in for a vLLM judge server, started by tephra as it starts vLLM
(`<python> -m vllm.entrypoints.openai.api_server --model DIR --host H --port P ...`, with
`reward.judge.vllm.python` naming a wrapper that runs this file with `--log FOLDER` first):
a real HTTP server on the port it is given, answering `/health` and `/v1/completions` as vLLM
does for token-id prompts. Its judgement of a prompt is the number `sum(prompt ids) % 10`,
written with the judge model's tokenizer (`tokenizer.json`), so a test can recompute every
score. Each start appends its pid and its parent's to FOLDER/starts.log, and each completion
request its prompt to FOLDER/requests.log
(vLLM's CPU build takes minutes to install and 45-120 s to start here: too slow to count
starts in the suite)."""

from __future__ import annotations

import http.server
import json
import os
import sys
from pathlib import Path

from tokenizers import Tokenizer


def judgement(prompt_ids: list[int]) -> str:
    """The stand-in judge's answer to a prompt (token ids)."""
    return str(sum(prompt_ids) % 10)


def main(argv: list[str]) -> None:
    log = Path(argv[argv.index("--log") + 1])
    model = argv[argv.index("--model") + 1]
    host, port = argv[argv.index("--host") + 1], int(argv[argv.index("--port") + 1])
    # the tokenizers library, not transformers: it imports in a fraction of the time
    tok = Tokenizer.from_file(str(Path(model) / "tokenizer.json"))
    with open(log / "starts.log", "a") as f:  # this server and the process that started it
        f.write(f"{os.getpid()} {os.getppid()}\n")

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (the stdlib's name)
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

        def do_POST(self):  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
            out: dict = {}
            if self.path == "/v1/completions":
                ids = tok.encode(judgement(body["prompt"]), add_special_tokens=False).ids
                out = {"choices": [{"index": 0, "token_ids": ids, "finish_reason": "stop"}]}
                with open(log / "requests.log", "a") as f:
                    f.write(json.dumps(body["prompt"]) + "\n")
            data = json.dumps(out).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    http.server.ThreadingHTTPServer((host, port), Handler).serve_forever()


if __name__ == "__main__":
    main(sys.argv[1:])
