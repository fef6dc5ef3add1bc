"""A stand-in for a server's weight-transfer endpoints, in a process of its own: it speaks
the JSON of vLLM's four-phase protocol as tephra's `tephra` engine takes it, and SGLang's
(`/init_weights_update_group`, `/update_weights_from_distributed`: one broadcast per tensor;
`/update_weights_from_tensor`: a pickled list of (name, tensor) per tensor-parallel rank),
receives each bucket the way the server would (`tephra_weight_transport`: the handle opened
for ipc, broadcasts for gloo), keeps a copy of every tensor, and records every request in
order (sleep and wake included). The test reads both back: `GET /received` (the tensors, as
a torch.save payload) and `GET /log` ([path, body] pairs, handles left out).

`python weight_receiver.py cpu|cuda` prints its port, then serves until killed. Like the
server plugin it imports only torch and `tephra_weight_transport` (the plugin folder on
sys.path), so it also runs on a GPU machine without vLLM.
"""

from __future__ import annotations

import io
import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import torch

PLUGIN_DIR = (
    Path(__file__).resolve().parents[1] / "src" / "tephra" / "rollout" / "backends" / "vllm_plugin"
)
sys.path.insert(0, str(PLUGIN_DIR))

from tephra_weight_transport import (  # noqa: E402
    BucketMeta,
    broadcast,
    open_group,
    open_pickled,
    open_shared,
    unpack,
)


class Receiver(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, device: torch.device) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.device = device
        self.lock = threading.Lock()
        self.log: list[list] = []
        """[path, body] of every POST, in arrival order (handles elided)."""
        self.received: dict[str, torch.Tensor] = {}
        self.group = None
        self.transport: str | None = None


class Handler(BaseHTTPRequestHandler):
    server: Receiver

    def log_message(self, *args) -> None:
        pass

    def reply(self, data: bytes, kind: str = "application/json") -> None:
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/received":
            buffer = io.BytesIO()
            torch.save(self.server.received, buffer)
            self.reply(buffer.getvalue(), "application/octet-stream")
        elif self.path == "/log":
            self.reply(json.dumps(self.server.log).encode())
        else:
            self.reply(b"{}")

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
        server = self.server
        info = body.get("update_info") or body.get("init_info") or body
        with server.lock:
            server.log.append(
                [
                    self.path,
                    {
                        k: v
                        for k, v in info.items()
                        if k not in ("handle", "serialized_named_tensors")
                    },
                ]
            )
        if self.path in ("/init_weight_transfer_engine", "/init_weights_update_group"):
            server.transport = info["backend"]
            if server.transport != "ipc":
                server.group = open_group(
                    info["master_address"],
                    info["master_port"],
                    1,
                    info["world_size"],
                    info["backend"],
                    60.0,
                )
        elif self.path == "/update_weights_from_distributed":
            for name, dtype, shape in zip(info["names"], info["dtypes"], info["shapes"]):
                tensor = torch.empty(shape, dtype=getattr(torch, dtype), device=server.device)
                broadcast(server.group, tensor)
                server.received[name] = tensor.to("cpu", copy=True)
        elif self.path == "/update_weights_from_tensor":
            [handle] = info["serialized_named_tensors"]  # one tensor-parallel rank
            for name, tensor in open_pickled(handle, server.device):
                server.received[name] = tensor.to("cpu", copy=True)
        elif self.path == "/update_weights":
            meta = BucketMeta(info["names"], info["dtype_names"], info["shapes"])
            if "handle" in info:
                flat = open_shared(info["handle"], server.device)
            else:
                flat = torch.empty(
                    meta.numel(), dtype=getattr(torch, meta.dtype_names[0]), device=server.device
                )
                broadcast(server.group, flat)
            for name, tensor in unpack(meta, flat):
                server.received[name] = tensor.to("cpu", copy=True)
            if server.device.type == "cuda":
                torch.cuda.synchronize()  # copied before the sender may free the bucket
        self.reply(b"{}")


def main() -> None:
    device = torch.device(sys.argv[1])
    if device.type == "cuda":
        torch.cuda.set_device(0)
        device = torch.device("cuda", 0)
    server = Receiver(device)
    print(server.server_address[1], flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
