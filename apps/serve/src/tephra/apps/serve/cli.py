"""`uv run apps/serve`: start the Tinker-compatible server on a host and port."""

from __future__ import annotations

import argparse
import os
import socket
import threading
import time
from pathlib import Path

import uvicorn

from tephra.apps.serve.errors import UserError
from tephra.apps.serve.server import build_app
from tephra.apps.serve.service import BaseModel, ServeSettings, Service
from tephra.engine_api.config import ModelConfig
from tephra.engine_fsdp.testing import tiny_qwen2_config

TINY = "tiny"
DEMO = "demo"


TINY_INIT_STD = 0.2
"""Standard deviation of the tiny model's random weights. At transformers' 0.02 its logits are
nearly flat (std ~0.16 over the 256 tokens: the tied 64-wide embeddings are too short) and no
LoRA adapter can make it confident (one token's logit rises by at most ~1.3); at 0.2 the RL
example's task is learned in 12 steps (README, An RL loop)."""


def base_model(spec: str) -> BaseModel:
    """`NAME=SOURCE`: SOURCE is `tiny` (a 2-layer Qwen2 built from its config, vocabulary
    256, random weights of std `TINY_INIT_STD`: tests and trials), `demo` (SmolLM2-135M-
    Instruct, the demo's model) or a local Hugging Face folder."""
    name, sep, source = spec.partition("=")
    if not sep or not name or not source:
        raise UserError(f"--model {spec!r}: write NAME=SOURCE (SOURCE: tiny, demo or a folder)")
    if source == TINY:
        config = tiny_qwen2_config(initializer_range=TINY_INIT_STD)
        return BaseModel(name, ModelConfig(hf_config=config), 256)
    if source == DEMO:
        # imported here: the converter pulls in gguf, needed only for the demo model
        from tephra.controller.data.smollm2 import smollm2_folder

        return BaseModel(name, ModelConfig(path=str(smollm2_folder())), 2048)
    folder = Path(source)
    if not (folder / "config.json").is_file():
        raise UserError(
            f"--model {spec!r}: {source} is not tiny, demo, or a folder with config.json"
        )
    return BaseModel(name, ModelConfig(path=str(folder)), 4096)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="uv run apps/serve", description=__doc__)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    p.add_argument(
        "--api-key",
        default=os.environ.get("TEPHRA_SERVE_API_KEY"),
        help="the key clients must send (default: $TEPHRA_SERVE_API_KEY)",
    )
    p.add_argument(
        "--model",
        action="append",
        default=None,
        help="a base model to serve, NAME=SOURCE (tiny, demo or a HF folder); repeatable "
        "(default: tiny=tiny)",
    )
    p.add_argument("--engine", default="fsdp", help="training engine (registry name)")
    p.add_argument("--workdir", type=Path, default=None, help="folder of swapped-out adapters")
    return p


def make_service(models: list[str], engine: str = "fsdp", workdir: Path | None = None) -> Service:
    return Service([base_model(m) for m in models], ServeSettings(engine=engine, workdir=workdir))


class BackgroundServer:
    """The server on a thread of this process (tests, notebooks): `url` once started."""

    def __init__(self, service: Service, api_key: str, host: str = "127.0.0.1") -> None:
        self.service = service
        # IPPROTO_TCP named: asyncio sets TCP_NODELAY only on sockets that say so
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self.sock.bind((host, 0))
        port = self.sock.getsockname()[1]
        self.url = f"http://{host}:{port}"
        config = uvicorn.Config(build_app(service, api_key), log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True
        )

    def start(self) -> BackgroundServer:
        """Serve on the thread; returns once the server accepts connections."""
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError(f"the server did not start on {self.url}")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        """Stop serving and release the engines."""
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.service.close()
        self.sock.close()

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    if not args.api_key:
        raise SystemExit("give --api-key (or set TEPHRA_SERVE_API_KEY): clients must send it")
    try:
        service = make_service(args.model or [f"{TINY}={TINY}"], args.engine, args.workdir)
    except UserError as e:
        raise SystemExit(str(e)) from None
    print(f"tephra serve: base models {sorted(service.bases)} on http://{args.host}:{args.port}")
    uvicorn.run(build_app(service, args.api_key), host=args.host, port=args.port)
