"""Server backends without a server: request/response translation (vLLM and SGLang JSON as
their APIs document it), the weights folder, and process failures (with stand-in commands)."""

from __future__ import annotations

import base64
import dataclasses
import os
import sys
import time
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from tephra.rollout import (
    RolloutConfig,
    RolloutError,
    SamplingParams,
    ServerLaunch,
    ServerSettings,
    get_rollout,
)
from tephra.rollout.backends import SglangProtocol, VllmProtocol
from tephra.rollout.backends.server_client import image_payload, merge_env
from tephra.rollout.backends.server_process import ServerProcess
from tephra.rollout.backends.weights_folder import (
    clip_tower_names,
    is_tied,
    served_copy,
    untied_copy,
    write_update,
)
from tephra.rollout.multimodal import MultimodalInputs


def test_vllm_request_and_response_translation(tiny_model):
    protocol = VllmProtocol()
    sampling = SamplingParams(
        n=2, temperature=0.5, top_p=0.9, top_k=7, max_tokens=5, stop_token_ids=(3,), seed=4
    )
    [(path, body)] = protocol.sample_requests([1, 2, 3], sampling)
    assert path == "/v1/completions"
    assert body == {
        "model": "tephra-policy",
        "prompt": [1, 2, 3],
        "n": 2,
        "max_tokens": 5,
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 7,
        "stop_token_ids": [3],
        "ignore_eos": False,
        "return_token_ids": True,
        "skip_special_tokens": False,
        "seed": 4,
        "logprobs": 1,
    }
    response = {
        "choices": [
            {
                "index": 1,
                "text": "x",
                "token_ids": [9, 3],
                "finish_reason": "stop",
                "logprobs": {
                    "token_logprobs": [-0.5, -0.25],
                    "tokens": ["a", "b"],
                    "top_logprobs": [],
                },
            },
            {
                "index": 0,
                "text": "y",
                "token_ids": [8, 8, 8, 8, 8],
                "finish_reason": "length",
                "logprobs": {"token_logprobs": [-1.0] * 5, "tokens": ["c"] * 5, "top_logprobs": []},
            },
        ]
    }
    samples = protocol.parse_samples(response, sampling)
    assert [s.response_ids for s in samples] == [[8, 8, 8, 8, 8], [9, 3]]
    assert [s.finish_reason for s in samples] == ["length", "stop"]
    assert samples[1].log_probs == [-0.5, -0.25]
    with pytest.raises(RolloutError, match="3 log-probs for 2 tokens"):
        bad = {"choices": [{**response["choices"][0], "logprobs": {"token_logprobs": [0, 0, 0]}}]}
        protocol.parse_samples(bad, sampling)
    # an aborted sample (partial rollout) keeps its tokens and log-probs so far
    [aborted] = protocol.parse_samples(
        {"choices": [{**response["choices"][0], "finish_reason": "abort"}]}, sampling
    )
    assert (aborted.response_ids, aborted.log_probs, aborted.finish_reason) == (
        [9, 3],
        [-0.5, -0.25],
        "abort",
    )
    with pytest.raises(RolloutError, match="finished with 'error'; expected stop, length or abort"):
        protocol.parse_samples(
            {"choices": [{**response["choices"][0], "finish_reason": "error"}]}, sampling
        )
    assert protocol.abort_request() == ("/abort_requests", {})

    assert protocol.reload_requests("/w") == [
        ("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": "/w"}}),
        ("/reset_prefix_cache", {}),
    ]
    config = RolloutConfig(
        model_path=tiny_model.path, max_model_len=64, vllm=ServerSettings(extra_args=["--x"])
    )
    command = protocol.launch_command("/py", "/m", "127.0.0.1", 9, config, config.vllm)
    assert command[:3] == ["/py", "-m", "vllm.entrypoints.openai.api_server"]
    for flag, value in (
        ("--model", "/m"),
        ("--port", "9"),
        ("--max-model-len", "64"),
        ("--logprobs-mode", "processed_logprobs"),
        ("--dtype", "float32"),
    ):
        assert command[command.index(flag) + 1] == value
    assert "--enforce-eager" in command and command[-1] == "--x"
    assert protocol.default_env()["VLLM_SERVER_DEV_MODE"] == "1"


def test_vllm_image_request_translation(tmp_path):
    """A prompt with two images (grids 1x4x4 and 1x2x4: 4 and 2 tokens after the 2x2 merge):
    each image's placeholder run, the tensors as exact bytes, hashes that change with the
    pixels and the update count; the generate route's response parsed; the image routes
    only for a vision model's folder."""
    hf_config = SimpleNamespace(
        model_type="qwen2_vl", image_token_id=9, vision_config=SimpleNamespace(spatial_merge_size=2)
    )
    grid = torch.tensor([[1, 4, 4], [1, 2, 4]])
    pixels = torch.randn(24, 6, generator=torch.Generator().manual_seed(0))
    images = MultimodalInputs(pixels, grid)
    prompt = [1, 5, 9, 9, 9, 9, 6, 2, 5, 9, 9, 6, 3]
    payload = image_payload(prompt, images, hf_config, salt=0)
    assert payload["placeholders"] == [(2, 4), (9, 2)]
    sent = payload["tensors"]["pixel_values"]
    assert (sent["dtype"], sent["shape"]) == ("float32", [24, 6])
    assert base64.b64decode(sent["data"]) == pixels.numpy().tobytes()
    assert payload["tensors"]["image_grid_thw"]["dtype"] == "int64"
    assert len(set(payload["hashes"])) == 2
    assert image_payload(prompt, images, hf_config, salt=0)["hashes"] == payload["hashes"]
    after_update = image_payload(prompt, images, hf_config, salt=1)["hashes"]
    assert not set(after_update) & set(payload["hashes"])
    with pytest.raises(RolloutError, match="image 0's 4 placeholder tokens are not one run"):
        image_payload([1, 9, 9, 5, 9, 9, 9, 9, 3], images, hf_config, salt=0)

    protocol = VllmProtocol()
    sampling = SamplingParams(temperature=0.0, max_tokens=3)
    [(path, body)] = protocol.image_requests(prompt, sampling, payload)
    assert path == "/tephra/generate"
    assert body["token_ids"] == prompt and body["images"] is payload
    assert body["sampling_params"]["logprobs"] == 0 and body["return_token_ids"]
    response = {
        "prompt_token_ids": prompt,
        "choices": [
            {
                "index": 0,
                "token_ids": [4, 4, 2],
                "finish_reason": "stop",
                "logprobs": {"content": [{"token_id": t, "logprob": -0.5} for t in (4, 4, 2)]},
            }
        ],
    }
    [sample] = protocol.parse_samples(response, sampling)
    assert (sample.response_ids, sample.log_probs) == ([4, 4, 2], [-0.5, -0.5, -0.5])

    text_model, vision_model = tmp_path / "text", tmp_path / "vision"
    text_model.mkdir()
    vision_model.mkdir()
    (text_model / "config.json").write_text('{"model_type": "qwen2"}')
    (vision_model / "config.json").write_text('{"model_type": "qwen2_vl", "vision_config": {}}')
    config = RolloutConfig(model_path=str(text_model), max_model_len=64)
    text = protocol.launch_command("py", str(text_model), "h", 9, config, config.vllm)
    vision = protocol.launch_command("py", str(vision_model), "h", 9, config, config.vllm)
    assert "--enable-scale-out" not in text and "tephra_vllm_images.TephraImages" not in text
    assert "--enable-scale-out" in vision and "--no-mm-device-do-normalize" in vision
    assert vision[vision.index("--middleware") + 1] == "tephra_vllm_images.TephraImages"


def test_llava_is_served_and_updated_under_vllms_clip_names(tmp_path):
    assert clip_tower_names("model.vision_tower.encoder.layers.0.mlp.fc1.weight") == (
        "model.vision_tower.vision_model.encoder.layers.0.mlp.fc1.weight"
    )
    assert clip_tower_names("vision_tower.embeddings.class_embedding") == (
        "vision_tower.vision_model.embeddings.class_embedding"
    )
    for same in (
        "vision_tower.vision_model.embeddings.class_embedding",  # saved so already
        "model.multi_modal_projector.linear_1.weight",
        "model.language_model.layers.0.mlp.up_proj.weight",
        "model.my_vision_tower.x",
    ):
        assert clip_tower_names(same) == same
    source, out = tmp_path / "llava", tmp_path / "served"
    source.mkdir()
    (source / "config.json").write_text('{"model_type": "llava", "vision_config": {}}')
    save_file(
        {
            "vision_tower.embeddings.w": torch.ones(2),
            "language_model.lm_head.weight": torch.zeros(2),
        },
        str(source / "model.safetensors"),
    )
    assert VllmProtocol().weight_names(str(source)) is clip_tower_names
    served_copy(source, out, untie=False, rename=clip_tower_names)
    assert sorted(load_file(out / "model.safetensors")) == [
        "language_model.lm_head.weight",
        "vision_tower.vision_model.embeddings.w",
    ]
    assert (out / "config.json").read_text() == (source / "config.json").read_text()


def test_sglang_request_and_response_translation():
    protocol = SglangProtocol()
    sampling = SamplingParams(n=2, temperature=0.0, max_tokens=3, seed=10, ignore_eos=True)
    requests = protocol.sample_requests([4, 5], sampling)
    assert [path for path, _ in requests] == ["/generate", "/generate"]
    assert requests[1][1] == {
        "input_ids": [4, 5],
        "return_logprob": True,
        "sampling_params": {
            "max_new_tokens": 3,
            "temperature": 0.0,
            "top_p": 1.0,
            "top_k": -1,
            "stop_token_ids": [],
            "ignore_eos": True,
            "skip_special_tokens": False,
            "sampling_seed": 11,
        },
    }
    response = {
        "text": "ab",
        "output_ids": [7, 2],
        "meta_info": {
            "output_token_logprobs": [[-0.1, 7, None], [-0.2, 2, None]],
            "finish_reason": {"type": "stop", "matched": 2},
        },
    }
    [sample] = protocol.parse_samples(response, sampling)
    assert sample.response_ids == [7, 2] and sample.log_probs == [-0.1, -0.2]
    assert sample.finish_reason == "stop"
    aborted = {
        **response,
        "meta_info": {**response["meta_info"], "finish_reason": {"type": "abort"}},
    }
    assert protocol.parse_samples(aborted, sampling)[0].finish_reason == "abort"
    assert protocol.abort_request() == ("/abort_request", {"abort_all": True})
    assert protocol.reload_requests("/w") == [
        ("/update_weights_from_disk", {"model_path": "/w"}),
        ("/flush_cache", {}),
    ]


def test_untied_copy_and_weight_update_files(tiny_tied_model, tmp_path):
    """The untied copy computes the same logits as the tied original; an update that holds
    only the embedding gets an explicit head equal to it."""
    assert is_tied(tiny_tied_model.path)
    copy = untied_copy(tiny_tied_model.path, tmp_path / "served")
    assert not is_tied(copy)
    tied = AutoModelForCausalLM.from_pretrained(tiny_tied_model.path, dtype=torch.float32)
    untied = AutoModelForCausalLM.from_pretrained(copy, dtype=torch.float32)
    ids = torch.tensor([[3, 4, 5, 6]])
    with torch.no_grad():
        torch.testing.assert_close(tied(ids).logits, untied(ids).logits, atol=0, rtol=0)
    embed = torch.randn(tiny_tied_model.vocab_size, 64)
    folder = write_update(
        [("model.embed_tokens.weight", embed), ("model.norm.weight", torch.ones(64))],
        tmp_path / "update",
        torch.bfloat16,
        config_from=copy,
        add_untied_head=True,
    )
    tensors = {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}
    assert set(tensors) == {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    assert tensors["lm_head.weight"].dtype == torch.bfloat16
    torch.testing.assert_close(tensors["lm_head.weight"], embed.to(torch.bfloat16))
    assert (folder / "config.json").exists()


def test_server_process_failures_are_quick_and_clear(tmp_path):
    start = time.monotonic()
    crashing = ServerProcess(
        "demo",
        [sys.executable, "-c", "print('loading'); raise SystemExit('bad model path')"],
        {},
        str(tmp_path / "a.log"),
    )
    with pytest.raises(RolloutError, match="(?s)exited during start-up.*bad model path"):
        crashing.wait_healthy("http://127.0.0.1:9", timeout_s=60)
    silent = ServerProcess(
        "demo", [sys.executable, "-c", "import time; time.sleep(60)"], {}, str(tmp_path / "b.log")
    )
    with pytest.raises(RolloutError, match="not healthy .* after 2 s"):
        silent.wait_healthy("http://127.0.0.1:9", timeout_s=2)
    assert not silent.alive()  # killed, not left behind
    assert time.monotonic() - start < 20
    with pytest.raises(RolloutError, match="does not exist"):
        ServerProcess("demo", [str(tmp_path / "nope" / "python")], {}, str(tmp_path / "c.log"))


def test_connecting_to_a_missing_server_names_the_url(tiny_model):
    config = RolloutConfig(
        model_path=tiny_model.path, vllm=ServerSettings(url="http://127.0.0.1:9")
    )
    with pytest.raises(
        RolloutError, match="vllm.url: no healthy server at http://127.0.0.1:9/health"
    ):
        get_rollout("vllm", config)


def test_server_settings_reach_the_command_line_and_the_transfer_requests():
    from tephra.rollout.backends.vllm import PLUGIN_DIR
    from tephra.rollout.backends.vllm_plugin.tephra_weight_transport import BucketMeta

    config = RolloutConfig(model_path="m", max_model_len=64)
    settings = ServerSettings(
        tensor_parallel_size=2, data_parallel_size=3, gpu_memory_utilization=0.4
    )
    vllm, sglang = VllmProtocol(), SglangProtocol()
    command = vllm.launch_command("py", "m", "127.0.0.1", 9, config, settings)
    text = " ".join(command)
    assert "--tensor-parallel-size 2" in text and "--data-parallel-size 3" in text
    assert "--gpu-memory-utilization 0.4" in text and "--enable-sleep-mode" not in text
    i = command.index("--weight-transfer-config")
    assert command[i + 1] == '{"backend": "tephra"}'
    assert command[command.index("--worker-extension-cls") + 1] == (
        "tephra_vllm_plugin.TephraWorkerExtension"
    )
    assert vllm.launch_env(settings) == {"PYTHONPATH": str(PLUGIN_DIR)}
    assert (PLUGIN_DIR / "tephra_vllm_plugin.py").is_file()
    disk = ServerSettings(weight_sync="disk")
    assert "--weight-transfer-config" not in vllm.launch_command("py", "m", "h", 9, config, disk)
    # the plugin folder is on the path either way: a vision model's server loads the image
    # middleware from it whatever the weight sync
    assert vllm.launch_env(disk) == {"PYTHONPATH": str(PLUGIN_DIR)}
    # a key reaches vLLM through the environment (and tephra's guard), SGLang by its flag
    assert vllm.key_launch("k") == (
        ["--middleware", "tephra_vllm_guard.RequireKey"],
        {"TEPHRA_SERVER_API_KEY": "k", "PYTHONPATH": str(PLUGIN_DIR)},
    )
    assert (PLUGIN_DIR / "tephra_vllm_guard.py").is_file()
    assert sglang.key_launch("k") == (["--api-key", "k"], {})
    joined = merge_env({"PYTHONPATH": "/a", "X": "1"}, {"PYTHONPATH": "/b", "X": "2"})
    assert joined == {"PYTHONPATH": f"/b{os.pathsep}/a", "X": "2"}

    meta = BucketMeta(["a.weight", "b.bias"], ["float32", "float32"], [[2, 3], [3]])
    assert vllm.transfer_init_request("gloo", "10.0.0.1", 7, 3) == (
        "/init_weight_transfer_engine",
        {
            "init_info": {
                "master_address": "10.0.0.1",
                "master_port": 7,
                "rank_offset": 1,
                "world_size": 3,
                "backend": "gloo",
            }
        },
    )
    # ipc: no group to join, the handle comes with each bucket
    assert vllm.transfer_init_request("ipc", "10.0.0.1", 0, 2) == (
        "/init_weight_transfer_engine",
        {"init_info": {"backend": "ipc"}},
    )
    assert vllm.transfer_bucket_request(meta, None) == (
        "/update_weights",
        {
            "update_info": {
                "names": ["a.weight", "b.bias"],
                "dtype_names": ["float32", "float32"],
                "shapes": [[2, 3], [3]],
            }
        },
    )
    assert vllm.transfer_bucket_request(meta, "H")[1]["update_info"]["handle"] == "H"
    assert vllm.transfer_finish_requests(4)[0] == ("/finish_weight_update", {"weight_version": "4"})

    text = " ".join(
        sglang.launch_command(
            "py",
            "m",
            "h",
            9,
            config,
            ServerSettings(tensor_parallel_size=2, gpu_memory_utilization=0.5, sleep_level=1),
        )
    )
    assert "--tp-size 2" in text and "--mem-fraction-static 0.5" in text
    assert "--enable-memory-saver" in text and "--enable-weights-cpu-backup" in text
    text = " ".join(sglang.launch_command("py", "m", "h", 9, config, ServerSettings(sleep_level=2)))
    assert "--enable-memory-saver" in text and "--enable-weights-cpu-backup" not in text
    # enforce_eager (auto: on on CPU, as here) is SGLang's --disable-cuda-graph; off lets it
    # capture graphs
    assert "--disable-cuda-graph" in text
    eager_off = ServerSettings(enforce_eager=False)
    assert "--disable-cuda-graph" not in sglang.launch_command("py", "m", "h", 9, config, eager_off)
    assert sglang.transfer_init_request("nccl", "h", 7, 2)[1] == {
        "master_address": "h",
        "master_port": 7,
        "rank_offset": 1,
        "world_size": 2,
        "group_name": "tephra-weights",
        "backend": "nccl",
    }
    assert sglang.transfer_init_request("ipc", "h", 0, 2) is None
    path, body = sglang.transfer_bucket_request(meta, None)
    assert (path, body) == (
        "/update_weights_from_distributed",
        {
            "names": ["a.weight", "b.bias"],
            "dtypes": ["float32", "float32"],
            "shapes": [[2, 3], [3]],
            "group_name": "tephra-weights",
            "flush_cache": False,
        },
    )
    assert sglang.transfer_bucket_request(meta, "H") == (
        "/update_weights_from_tensor",
        {"serialized_named_tensors": ["H"], "flush_cache": False},
    )
    assert not sglang.packs_buckets


def test_sleep_and_wake_requests_per_level():
    vllm, sglang = VllmProtocol(), SglangProtocol()
    off, one, two = (ServerSettings(sleep_level=n) for n in (0, 1, 2))
    assert vllm.sleep_requests(off) == [] and vllm.wake_requests(off, ["weights"]) == []
    assert vllm.sleep_requests(one) == [("/sleep?level=1", {})]
    assert vllm.sleep_requests(two) == [("/sleep?level=2", {})]
    # vLLM reads repeated `tags` query parameters
    assert vllm.wake_requests(two, ["weights"]) == [("/wake_up?tags=weights", {})]
    assert vllm.wake_requests(one, ["weights", "kv_cache"]) == [
        ("/wake_up?tags=weights&tags=kv_cache", {})
    ]
    assert sglang.sleep_requests(off) == []
    assert sglang.sleep_requests(two) == [("/release_memory_occupation", {})]
    assert sglang.wake_requests(one, ["kv_cache"]) == [
        ("/resume_memory_occupation", {"tags": ["kv_cache"]})
    ]


def test_weight_buckets_bound_their_size_and_round_trip():
    from tephra.rollout.backends.vllm_plugin.tephra_weight_transport import buckets, unpack

    gen = torch.Generator().manual_seed(0)
    named = [(f"w{i}", torch.randn(n, generator=gen)) for i, n in enumerate([10, 30, 5, 100, 1])]
    out = list(buckets(iter(named), torch.float32, bucket_bytes=40 * 4))
    # 10+30 fit; 5 starts a new bucket; 100 is larger than a bucket and travels alone
    assert [m.names for m, _ in out] == [["w0", "w1"], ["w2"], ["w3"], ["w4"]]
    back = [pair for meta, flat in out for pair in unpack(meta, flat)]
    assert [n for n, _ in back] == [n for n, _ in named]
    for (_, a), (_, b) in zip(back, named):
        assert torch.equal(a, b)
    [(meta, flat)] = buckets(
        [("x", torch.ones(2, 2, dtype=torch.float64))], torch.bfloat16, 1 << 20
    )
    assert (
        flat.dtype == torch.bfloat16
        and meta.shapes == [[2, 2]]
        and meta.dtype_names == ["bfloat16"]
    )


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("weight_sync", "nfs", "expected 'memory'"),
        ("weight_bucket_mb", 0, "weight_bucket_mb=0 must be > 0"),
        ("tensor_parallel_size", 0, "must be >= 1"),
        ("gpu_memory_utilization", 1.5, r"must be in \(0, 1\]"),
        (
            "weight_transport",
            "ipcc",
            r"weight_transport='ipcc' is not a weight transport \(did you "
            r"mean 'ipc'\?\); choose one of \['auto', 'gloo', 'nccl', 'ipc'\]",
        ),
        ("sleep_level", 3, r"sleep_level=3: choose 0 \(no sleep\), 1"),
    ],
)
def test_bad_server_settings_name_the_field(field, value, message):
    from tephra.engine_api.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        ServerSettings(**{field: value})


def test_a_launch_without_weight_updates_keeps_every_launch_field():
    """The judge's server settings (`ServerLaunch`) reach the rollout as `ServerSettings`
    with each launch field as given."""
    launch = ServerLaunch(
        url="http://127.0.0.1:9", enforce_eager=False, extra_args=["--x"], max_in_flight=3
    )
    settings = ServerSettings.of_launch(launch)
    assert {f.name: getattr(settings, f.name) for f in dataclasses.fields(ServerLaunch)} == {
        f.name: getattr(launch, f.name) for f in dataclasses.fields(ServerLaunch)
    }
