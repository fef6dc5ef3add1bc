"""Weight transports: the choice by placement (`tephra.rollout.weight_transport`), the
sender's buckets reaching a receiver in another process bit for bit (ipc as CPU shared
memory here, as CUDA IPC on a GPU; gloo), and the order of sleep, wake and sync requests.

The receiver is `weight_receiver.py`, a stand-in process speaking the JSON of vLLM's
weight-transfer endpoints and receiving with the plugin's own code. It is reached by URL, and
`auto` takes a server at a URL to be on another GPU (nccl), so these tests set
`rollout.transport` to the transport under test. The real vLLM server is driven in
`test_rollout_vllm.py`.
"""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch

from tephra.engine_api.errors import ConfigError
from tephra.rollout import RolloutConfig, RolloutError, ServerSettings, get_rollout
from tephra.rollout.weight_transport import Placement, choose_transport

RECEIVER = Path(__file__).with_name("weight_receiver.py")
CPU, OWN_GPU, OTHER_GPU = Placement("cpu", True), Placement("cuda", True), Placement("cuda", False)


@pytest.mark.parametrize(
    "placement, expected",
    [
        (CPU, "gloo"),  # no GPU: a host broadcast
        (Placement("cpu", False), "gloo"),
        (OWN_GPU, "ipc"),  # colocated on the sender's GPU: CUDA IPC
        (OTHER_GPU, "nccl"),  # separate GPUs: NCCL
        (Placement("cuda", True, server_gpus=2), "gloo"),  # one rank shares the GPU, one does not
    ],
)
def test_auto_picks_the_transport_by_placement(placement, expected):
    assert choose_transport("vllm.weight_transport", "auto", placement) == expected


@pytest.mark.parametrize(
    "requested, placement, message",
    [
        (
            "nccl",
            OWN_GPU,
            r"vllm.weight_transport='nccl' with the server on the sender's GPU: NCCL "
            r"refuses two ranks of one communicator on one GPU; use `ipc`",
        ),
        ("nccl", CPU, r"'nccl' on CPU: NCCL needs CUDA; use `gloo`"),
        ("ipc", CPU, r"'ipc' on CPU: .* use `gloo`"),
        ("ipc", OTHER_GPU, r"'ipc' with a server on another GPU: .* use `nccl`"),
        ("ipc", Placement("cuda", True, server_gpus=4), r"'ipc' with a server over 4 GPUs"),
        (
            "nccl",
            Placement("cuda", True, server_gpus=2),
            r"'nccl' with the server on the sender's GPU",
        ),
        ("nccI", OTHER_GPU, r"'nccI' is not a weight transport \(did you mean 'nccl'\?\)"),
    ],
)
def test_transports_that_cannot_work_are_refused(requested, placement, message):
    with pytest.raises(ConfigError, match=message):
        choose_transport("vllm.weight_transport", requested, placement)


def test_explicit_transports_that_work_are_kept_and_unoffered_ones_refused():
    assert choose_transport("f", "nccl", OTHER_GPU) == "nccl"
    assert choose_transport("f", "ipc", OWN_GPU) == "ipc"
    assert choose_transport("f", "gloo", OWN_GPU) == "gloo"  # slow on GPU, but it works
    with pytest.raises(
        ConfigError,
        match=r"f='ipc': demo does not offer it \(it offers "
        r"\['gloo', 'nccl'\]\)",
    ):
        choose_transport("f", "ipc", OWN_GPU, offered=("gloo", "nccl"), server="demo")


@pytest.fixture
def receiver(request):
    device = getattr(request, "param", "cpu")
    process = subprocess.Popen(
        [sys.executable, str(RECEIVER), device], stdout=subprocess.PIPE, text=True
    )
    try:
        port = int(process.stdout.readline())
        yield f"http://127.0.0.1:{port}"
    finally:
        process.kill()
        process.wait()


def _received(url: str) -> dict[str, torch.Tensor]:
    data = httpx.get(url + "/received", timeout=30).content
    return torch.load(io.BytesIO(data))


def _log(url: str) -> list[str]:
    return [path for path, _ in _bodies(url)]


def _bodies(url: str) -> list[list]:
    return httpx.get(url + "/log", timeout=30).json()


def _weights(seed: int, tied_model_path: str) -> list[tuple[str, torch.Tensor]]:
    """Random float32 weights of the tied model's shapes (the head left out, as an engine
    exporting a tied model sends it)."""
    from safetensors.torch import load_file

    state = load_file(str(Path(tied_model_path) / "model.safetensors"))
    gen = torch.Generator().manual_seed(seed)
    return [
        (name, torch.randn(t.shape, generator=gen))
        for name, t in state.items()
        if name != "lm_head.weight"
    ]


def _sync_and_compare(
    url: str, model_path: str, transport: str, device: str, backend: str = "vllm"
) -> None:
    settings = ServerSettings(url=url, weight_bucket_mb=0.02)
    rollout = get_rollout(
        backend,
        RolloutConfig(
            model_path=model_path, dtype="bfloat16", max_model_len=64, **{backend: settings}
        ),
    )
    try:
        rollout.transport = transport
        for seed in (1, 2):  # twice: the second update reuses the opened transport
            weights = _weights(seed, model_path)
            sent = [(name, t.to(device)) for name, t in weights]
            rollout.update_weights(iter(sent))
            got = _received(url)
            # every tensor, cast to the rollout dtype by the sender, bit for bit; vLLM serves
            # a tied model untied, so its head follows the embedding
            expected = dict(weights)
            if backend == "vllm":
                expected["lm_head.weight"] = expected["model.embed_tokens.weight"]
            assert sorted(got) == sorted(expected)
            for name, tensor in expected.items():
                assert got[name].dtype == torch.bfloat16
                assert torch.equal(
                    got[name].view(torch.int16), tensor.to(torch.bfloat16).view(torch.int16)
                ), name
            stats = rollout.last_update_stats
            assert stats["buckets"] > 3  # 0.02 MiB buckets: the memory bound held
            embedding = dict(weights)["model.embed_tokens.weight"].numel() * 2
            assert stats["max_bucket_bytes"] <= max(0.02 * 2**20, embedding)
        init = "/init_weight_transfer_engine" if backend == "vllm" else "/init_weights_update_group"
        assert _log(url).count(init) == (1 if backend == "vllm" or transport != "ipc" else 0)
        # the caller's tensors are untouched (CPU shared memory shares a copy)
        assert all(not t.is_shared() for _, t in sent if t.device.type == "cpu")
    finally:
        rollout.close()


@pytest.mark.parametrize("transport", ["ipc", "gloo"])
def test_buckets_reach_a_receiver_process_bit_for_bit_on_cpu(receiver, tiny_tied_model, transport):
    """ipc here: handles of CPU shared memory, through the same `share` / `open_shared` code
    that carries CUDA IPC handles on a GPU."""
    _sync_and_compare(receiver, tiny_tied_model.path, transport, "cpu")


@pytest.mark.parametrize("transport", ["ipc", "gloo"])
def test_sglang_requests_carry_the_buckets_bit_for_bit(receiver, tiny_tied_model, transport):
    """SGLang cannot run here: its request bodies go to the stand-in, which receives them as
    SGLang documents (a pickled (name, tensor) list per TP rank; per-tensor broadcasts)."""
    _sync_and_compare(receiver, tiny_tied_model.path, transport, "cpu", backend="sglang")
    bodies = _bodies(receiver)
    paths = [p for p, _ in bodies]
    if transport == "ipc":
        assert set(paths) == {"/update_weights_from_tensor", "/flush_cache"}
        assert all(
            b == {"flush_cache": False} for p, b in bodies if p == "/update_weights_from_tensor"
        )
    else:
        [init] = [b for p, b in bodies if p == "/init_weights_update_group"]
        assert init["group_name"] == "tephra-weights" and init["backend"] == "gloo"
        assert init["world_size"] == 2 and init["rank_offset"] == 1
        assert all(
            b["group_name"] == "tephra-weights" and not b["flush_cache"]
            for p, b in bodies
            if p == "/update_weights_from_distributed"
        )
    # each update: its buckets, then one /flush_cache
    assert paths.count("/flush_cache") == 2 and paths[-1] == "/flush_cache"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("receiver", ["cuda"], indirect=True)
def test_cuda_ipc_buckets_reach_a_receiver_on_the_same_gpu_bit_for_bit(receiver, tiny_tied_model):
    _sync_and_compare(receiver, tiny_tied_model.path, "ipc", "cuda")


def test_a_sync_wakes_the_weights_first_and_the_kv_cache_after(receiver, tiny_tied_model):
    """verl's order: wake_up(tags=[weights]), sync, wake_up(tags=[kv_cache])."""
    rollout = get_rollout(
        "vllm",
        RolloutConfig(
            model_path=tiny_tied_model.path,
            max_model_len=64,
            vllm=ServerSettings(url=receiver, sleep_level=1),
        ),
    )
    try:
        rollout.transport = "ipc"
        rollout.sleep()
        rollout.sleep()  # already asleep: nothing sent
        rollout.update_weights(iter(_weights(1, tiny_tied_model.path)))
        rollout.wake_up()  # awake after the sync: nothing sent
        rollout.sleep()
        rollout.wake_up()  # a generation without a sync wakes both, weights first
        log = [p for p in _log(receiver) if p != "/update_weights"]
        assert log == [
            "/sleep?level=1",
            "/wake_up?tags=weights",
            "/init_weight_transfer_engine",
            "/start_weight_update",
            "/finish_weight_update",
            "/reset_prefix_cache",
            "/wake_up?tags=kv_cache",
            "/sleep?level=1",
            "/wake_up?tags=weights&tags=kv_cache",
        ]
        assert rollout.calls == {"sleep": 3, "wake_up": 2, "update_weights": 1}
    finally:
        rollout.close()


def test_sleep_level_2_needs_a_sync_before_generating(receiver, tiny_tied_model):
    rollout = get_rollout(
        "vllm",
        RolloutConfig(
            model_path=tiny_tied_model.path,
            max_model_len=64,
            vllm=ServerSettings(url=receiver, sleep_level=2),
        ),
    )
    try:
        rollout.transport = "ipc"
        rollout.sleep()
        with pytest.raises(RolloutError, match="vllm.sleep_level=2 dropped the server's weights"):
            rollout.wake_up()
        rollout.update_weights(iter(_weights(1, tiny_tied_model.path)))  # every weight resent
        rollout.wake_up()
        log = [p for p in _log(receiver) if p != "/update_weights"]
        assert log[0] == "/sleep?level=2" and log[1] == "/wake_up?tags=weights"
        assert log[-1] == "/wake_up?tags=kv_cache"
    finally:
        rollout.close()


def test_sglang_wakes_weights_before_a_sync_and_the_kv_cache_after(receiver, tiny_tied_model):
    rollout = get_rollout(
        "sglang",
        RolloutConfig(
            model_path=tiny_tied_model.path,
            max_model_len=64,
            sglang=ServerSettings(url=receiver, sleep_level=1),
        ),
    )
    try:
        rollout.transport = "ipc"
        rollout.sleep()
        rollout.update_weights(iter(_weights(1, tiny_tied_model.path)))
        bodies = [b for b in _bodies(receiver) if b[0] != "/update_weights_from_tensor"]
        assert bodies == [
            ["/release_memory_occupation", {}],
            ["/resume_memory_occupation", {"tags": ["weights"]}],
            ["/flush_cache", {}],
            ["/resume_memory_occupation", {"tags": ["kv_cache"]}],
        ]
    finally:
        rollout.close()


def test_a_handle_may_name_only_torch_tensor_rebuilds():
    """The handle comes in an HTTP body: anything but torch's rebuild functions is refused."""
    import base64
    import pickle

    from tephra.rollout.backends.vllm_plugin.tephra_weight_transport import open_pickled, share

    evil = base64.b64encode(pickle.dumps(subprocess.getoutput)).decode()
    with pytest.raises(pickle.UnpicklingError, match="may not name subprocess.getoutput"):
        open_pickled(evil)
    tensor = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    sender_gpu, opened = open_pickled(share(tensor.clone()))
    assert sender_gpu is None and torch.equal(opened, tensor)
