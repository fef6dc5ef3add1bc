"""Adapter-only sync on the server backends (`ServerRollout.update_adapter`), driven through
the SGLang protocol against a recording stand-in server (SGLang needs a GPU; vLLM's LoRA path
shares this client and differs only in the request names, checked below).

The stand-in speaks SGLang's JSON: `/load_lora_adapter` reads the peft folder it is given
(as SGLang does: `adapter_config.json` and `adapter_model.safetensors`) and keeps what it
read; `/unload_lora_adapter` drops it; `/generate` answers one token and records the
`lora_path` the request named. Any weight route (`/update_weights_*`) is recorded too: an
adapter sync must leave the base weights alone."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tephra.core.errors import ConfigError
from tephra.engine_api.adapters import LoraAdapter
from tephra.rollout import RolloutConfig, RolloutError, SamplingParams, ServerSettings, get_rollout
from tephra.rollout.backends import SglangProtocol, VllmProtocol


class Recorder(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.posts: list[tuple[str, dict]] = []
        self.loaded: dict[str, tuple[dict, dict[str, torch.Tensor]]] = {}
        """Adapter name -> (its adapter_config.json, its tensors), as read from its folder."""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class Handler(BaseHTTPRequestHandler):
    server: Recorder

    def log_message(self, *args) -> None:
        pass

    def reply(self, body: dict, status: int = 200) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self.reply({})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
        rec = self.server
        rec.posts.append((self.path, body))
        if self.path == "/load_lora_adapter":
            folder = Path(body["lora_path"])
            config = json.loads((folder / "adapter_config.json").read_text())
            rec.loaded[body["lora_name"]] = (
                config,
                load_file(str(folder / "adapter_model.safetensors")),
            )
            self.reply({"success": True})
        elif self.path == "/unload_lora_adapter":
            del rec.loaded[body["lora_name"]]
            self.reply({"success": True})
        elif self.path == "/generate":
            if body.get("lora_path") is not None and body["lora_path"] not in rec.loaded:
                self.reply({"error": f"adapter {body['lora_path']} is not loaded"}, 400)
                return
            self.reply(
                {
                    "output_ids": [5],
                    "meta_info": {
                        "finish_reason": {"type": "length"},
                        "output_token_logprobs": [[-0.5, 5, None]],
                    },
                }
            )
        else:
            self.reply({})


def _adapter(seed: int, rank: int = 2) -> LoraAdapter:
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for module in ("model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj"):
        tensors[f"base_model.model.{module}.lora_A.weight"] = torch.randn(rank, 8, generator=g)
        tensors[f"base_model.model.{module}.lora_B.weight"] = torch.randn(8, rank, generator=g)
    return LoraAdapter(rank, 16.0, tensors)


@pytest.fixture
def recorded(tiny_model):
    rec = Recorder()
    threading.Thread(target=rec.serve_forever, daemon=True).start()
    config = RolloutConfig(
        model_path=tiny_model.path,
        max_lora_rank=4,
        sglang=ServerSettings(url=rec.url, request_timeout_s=60),
    )
    rollout = get_rollout("sglang", config)
    yield rec, rollout
    rollout.close()
    rec.shutdown()
    rec.server_close()


def test_each_sync_loads_the_adapter_under_a_new_name_and_unloads_the_old(recorded):
    rec, rollout = recorded
    sampling = SamplingParams(max_tokens=1, temperature=1.0)
    rollout.generate([[1, 2]], sampling)  # before any adapter: the base model
    for seed in (1, 2):
        adapter = _adapter(seed)
        rollout.update_adapter(adapter)
        name = f"tephra-lora-{seed}"
        assert rollout.adapter == name and list(rec.loaded) == [name]
        config, tensors = rec.loaded[name]
        # what the server read is the adapter, bit for bit, with its rank, alpha and modules
        assert tensors.keys() == adapter.tensors.keys()
        assert all(torch.equal(tensors[k], v) for k, v in adapter.tensors.items())
        assert (config["r"], config["lora_alpha"], config["peft_type"]) == (2, 16.0, "LORA")
        assert config["target_modules"] == ["down_proj", "q_proj"]
        assert rollout.last_update_stats["bytes"] == 4 * 2 * 8 * 4
        rollout.generate([[1, 2]], sampling)
    paths = [p for p, _ in rec.posts]
    assert paths == [
        "/generate",
        "/load_lora_adapter",
        "/generate",
        "/load_lora_adapter",
        "/unload_lora_adapter",
        "/generate",
    ]
    generates = [b for p, b in rec.posts if p == "/generate"]
    assert [b.get("lora_path") for b in generates] == [None, "tephra-lora-1", "tephra-lora-2"]
    assert rec.posts[4][1] == {"lora_name": "tephra-lora-1"}
    # the first adapter's folder is gone once the second is served; the second's stays
    first, second = folders_of(rec)
    assert not Path(first).exists() and Path(second).is_dir()
    # a rank above what the server was started for is refused before any request
    with pytest.raises(RolloutError, match=r"rank 8 exceeds rollout.max_lora_rank=4"):
        rollout.update_adapter(_adapter(3, rank=8))
    assert len(rec.posts) == 6


def folders_of(rec: Recorder) -> list[str]:
    return [b["lora_path"] for p, b in rec.posts if p == "/load_lora_adapter"]


def test_lora_launch_and_requests_of_vllm_and_sglang():
    vllm, sglang = VllmProtocol(), SglangProtocol()
    assert vllm.lora_launch(16) == (
        ["--enable-lora", "--max-lora-rank", "16", "--max-loras", "1"],
        {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"},
    )
    # vLLM takes only its listed ranks: a rank-4 adapter gets a rank-8 server
    assert vllm.lora_launch(4)[0][:3] == ["--enable-lora", "--max-lora-rank", "8"]
    assert vllm.lora_launch(320)[0][2] == "320" and vllm.lora_launch(321)[0][2] == "512"
    with pytest.raises(ConfigError, match=r"rank 513: vLLM serves adapters of rank <= 512"):
        vllm.lora_launch(513)
    assert vllm.load_adapter_request("a", "/f") == (
        "/v1/load_lora_adapter",
        {"lora_name": "a", "lora_path": "/f"},
    )
    assert vllm.unload_adapter_request("a") == ("/v1/unload_lora_adapter", {"lora_name": "a"})
    (request,) = vllm.sample_requests([1, 2], SamplingParams())
    assert vllm.with_adapter(request, "a")[1]["model"] == "a"
    args, env = sglang.lora_launch(8)
    assert args[:3] == ["--enable-lora", "--max-lora-rank", "8"] and env == {}
    assert "--lora-target-modules" in args
    assert sglang.load_adapter_request("a", "/f") == (
        "/load_lora_adapter",
        {"lora_name": "a", "lora_path": "/f"},
    )
    (request,) = sglang.sample_requests([1, 2], SamplingParams())
    assert sglang.with_adapter(request, "a")[1]["lora_path"] == "a"


@pytest.fixture
def recorded_two(tiny_model):
    rec = Recorder()
    threading.Thread(target=rec.serve_forever, daemon=True).start()
    config = RolloutConfig(
        model_path=tiny_model.path,
        max_lora_rank=4,
        max_loras=2,
        sglang=ServerSettings(url=rec.url, request_timeout_s=60),
    )
    rollout = get_rollout("sglang", config)
    yield rec, rollout
    rollout.close()
    rec.shutdown()
    rec.server_close()


def test_named_adapters_stay_loaded_side_by_side_and_requests_pick_one(recorded_two):
    """Two runs' adapters on one server: each name is loaded under a server name of its own,
    replacing one unloads only its old version, and each request names the adapter its
    `SamplingParams.adapter` asks for."""
    rec, rollout = recorded_two
    one = SamplingParams(max_tokens=1, temperature=1.0)
    rollout.update_adapter(_adapter(1), name="run1")
    rollout.update_adapter(_adapter(2), name="run2")
    assert rollout.adapters == {"run1": "tephra-lora-run1-1", "run2": "tephra-lora-run2-2"}
    assert sorted(rec.loaded) == ["tephra-lora-run1-1", "tephra-lora-run2-2"]
    assert rollout.adapter is None  # no default adapter: requests without a name use the base
    rollout.generate([[1, 2]], one.replace(adapter="run2"))
    rollout.generate([[1, 2]], one.replace(adapter="run1"))
    rollout.generate([[1, 2]], one)
    rollout.update_adapter(_adapter(3), name="run1")  # run 1's next sync
    assert sorted(rec.loaded) == ["tephra-lora-run1-3", "tephra-lora-run2-2"]
    # what the server holds for run 1 is its new adapter, bit for bit; run 2's is untouched
    for served, seed in (("tephra-lora-run1-3", 3), ("tephra-lora-run2-2", 2)):
        tensors = rec.loaded[served][1]
        assert all(torch.equal(tensors[k], v) for k, v in _adapter(seed).tensors.items())
    rollout.generate([[1, 2]], one.replace(adapter="run1"))
    generates = [b.get("lora_path") for p, b in rec.posts if p == "/generate"]
    assert generates == ["tephra-lora-run2-2", "tephra-lora-run1-1", None, "tephra-lora-run1-3"]
    unloads = [b["lora_name"] for p, b in rec.posts if p == "/unload_lora_adapter"]
    assert unloads == ["tephra-lora-run1-1"]
    first, second, third = folders_of(rec)
    assert not Path(first).exists() and Path(second).is_dir() and Path(third).is_dir()

    # refusals come before any request: an unknown name, a name beyond max_loras, a bad name
    posts = len(rec.posts)
    with pytest.raises(
        RolloutError, match=r"adapter='run3' is not loaded; loaded adapters: \['run1', 'run2'\]"
    ):
        rollout.generate([[1, 2]], one.replace(adapter="run3"))
    with pytest.raises(
        ConfigError, match=r"cannot load adapter 'run3'.*rollout.max_loras=2; raise rollout"
    ):
        rollout.update_adapter(_adapter(4), name="run3")
    with pytest.raises(ConfigError, match=r"name='run 3' must be a non-empty name of letters"):
        rollout.update_adapter(_adapter(4), name="run 3")
    assert len(rec.posts) == posts


def test_max_loras_reaches_the_server_command_and_is_checked():
    assert VllmProtocol().lora_launch(8, 3)[0] == [
        "--enable-lora",
        "--max-lora-rank",
        "8",
        "--max-loras",
        "3",
    ]
    args = SglangProtocol().lora_launch(8, 3)[0]
    assert args[args.index("--max-loras-per-batch") + 1] == "3"
    with pytest.raises(ConfigError, match=r"rollout.max_loras=0 must be an integer >= 1"):
        RolloutConfig(model_path="m", max_loras=0)
    with pytest.raises(ConfigError, match=r"sampling.adapter='' must be the name"):
        SamplingParams(adapter="")
