"""`sglang`: an SGLang server driven with token ids over its native API.

Verified only where SGLang runs (GPU): sglang 0.5.x needs CUDA kernels, so on CPU machines
only the request/response translation is tested. Started as `python -m sglang.launch_server`
from `sglang.python`; `/generate` with `input_ids` and `return_logprob`; weights reloaded
in memory with `/init_weights_update_group` + `/update_weights_from_distributed` (one
broadcast per tensor: `weight_transport` gloo / nccl), with `/update_weights_from_tensor`
(`ipc`: each bucket's (name, tensor) views pickled with torch's CUDA IPC reductions, as
SGLang's `MultiprocessingSerializer` reads them), or with `/update_weights_from_disk`
(`weight_sync=disk`); then `/flush_cache`. Sleep: `/release_memory_occupation` and
`/resume_memory_occupation` with `tags` (`weights`, `kv_cache`). LoRA (adapter-only sync):
started with `--enable-lora --max-lora-rank R --lora-target-modules all`, each adapter
loaded with `/load_lora_adapter` under a new name, the previous one dropped with
`/unload_lora_adapter`, requests naming it in `lora_path`. Partial rollout: `/abort_request {"abort_all": true}` aborts every request in
flight; each returns its `output_ids` and log-probs so far with finish reason `abort` (the
abort-and-resubmit path is the one shared with vLLM in `server_client`, tested there).
"""

from __future__ import annotations

import torch

from tephra.rollout.backends.server_client import (
    ABORTED,
    Request,
    ServerProtocol,
    ServerRollout,
    server_device,
)
from tephra.rollout.backends.vllm_plugin.tephra_weight_transport import (
    BucketMeta,
    pickle_shared,
    unpack,
)
from tephra.rollout.base import (
    RolloutConfig,
    RolloutError,
    Sample,
    SamplingParams,
    ServerSettings,
)
from tephra.rollout.colocation import resolve_server_settings

GROUP = "tephra-weights"


class SglangProtocol(ServerProtocol):
    name = "sglang"

    def default_python(self) -> str:
        return "python"

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
        return [
            python,
            "-m",
            "sglang.launch_server",
            "--model-path",
            model_dir,
            "--host",
            host,
            "--port",
            str(port),
            "--dtype",
            config.resolved_dtype,
            "--context-length",
            str(config.max_model_len),
            "--random-seed",
            str(config.seed),
            "--tp-size",
            str(settings.tensor_parallel_size),
            "--dp-size",
            str(settings.data_parallel_size),
            # SGLang compiles only with --enable-torch-compile: eager means no CUDA graphs
            *(["--disable-cuda-graph"] if settings.enforce_eager else []),
            *(
                ["--mem-fraction-static", str(settings.gpu_memory_utilization)]
                if settings.gpu_memory_utilization is not None
                else []
            ),
            # level 1 keeps a host copy of the weights (sglang >= 0.5.3), level 2 drops them
            *(["--enable-memory-saver"] if settings.sleep_level else []),
            *(["--enable-weights-cpu-backup"] if settings.sleep_level == 1 else []),
            *settings.extra_args,
        ]

    def key_launch(self, key: str) -> tuple[list[str], dict[str, str]]:
        # SGLang's --api-key guards every route but /health and /metrics (its own middleware);
        # it reads the key only from its command line
        return ["--api-key", key], {}

    def sample_requests(self, prompt_ids: list[int], sampling: SamplingParams) -> list[Request]:
        """One request per sample (sample j seeded with seed + j, like vLLM)."""
        requests = []
        for j in range(sampling.n):
            params = {
                "max_new_tokens": sampling.max_tokens,
                "temperature": sampling.temperature,
                "top_p": sampling.top_p,
                "top_k": sampling.top_k,
                "stop_token_ids": list(sampling.stop_token_ids),
                "ignore_eos": sampling.ignore_eos,
                "skip_special_tokens": False,
            }
            if sampling.seed is not None:
                params["sampling_seed"] = sampling.seed + j
            requests.append(
                (
                    "/generate",
                    {
                        "input_ids": prompt_ids,
                        "sampling_params": params,
                        "return_logprob": sampling.logprobs,
                    },
                )
            )
        return requests

    def parse_samples(self, response: dict, sampling: SamplingParams) -> list[Sample]:
        items = response if isinstance(response, list) else [response]
        out = []
        for item in items:
            meta = item.get("meta_info", {})
            ids = item.get("output_ids")
            if ids is None:
                raise RolloutError("sglang response has no 'output_ids'")
            log_probs = None
            if sampling.logprobs:
                log_probs = [float(entry[0]) for entry in meta.get("output_token_logprobs", [])]
                if len(log_probs) != len(ids):
                    raise RolloutError(
                        f"sglang returned {len(log_probs)} log-probs for {len(ids)} tokens"
                    )
            finish = meta.get("finish_reason") or {}
            reason = finish.get("type") if isinstance(finish, dict) else finish
            if reason not in ("stop", "length", ABORTED):
                raise RolloutError(
                    f"sglang sample finished with {finish!r}; expected stop, length or abort"
                )
            out.append(Sample(response_ids=list(ids), log_probs=log_probs, finish_reason=reason))
        return out

    def abort_request(self) -> Request:
        return ("/abort_request", {"abort_all": True})

    def reload_requests(self, weights_dir: str) -> list[Request]:
        return [("/update_weights_from_disk", {"model_path": weights_dir}), ("/flush_cache", {})]

    def sleep_requests(self, settings: ServerSettings) -> list[Request]:
        return [("/release_memory_occupation", {})] if settings.sleep_level else []

    def wake_requests(self, settings: ServerSettings, tags: list[str]) -> list[Request]:
        return [("/resume_memory_occupation", {"tags": list(tags)})] if settings.sleep_level else []

    # SGLang receives one broadcast per tensor (`update_weights_from_distributed`)
    packs_buckets = False

    def transfer_init_request(
        self, transport: str, address: str, port: int, world_size: int
    ) -> Request | None:
        if transport == "ipc":  # /update_weights_from_tensor needs no group
            return None
        return (
            "/init_weights_update_group",
            {
                "master_address": address,
                "master_port": port,
                "rank_offset": 1,
                "world_size": world_size,
                "group_name": GROUP,
                "backend": transport,
            },
        )

    def transfer_bucket_request(self, meta: BucketMeta, handle: str | None) -> Request:
        if handle is not None:
            # one entry per tensor-parallel rank; ipc is refused for servers over several GPUs
            return (
                "/update_weights_from_tensor",
                {"serialized_named_tensors": [handle], "flush_cache": False},
            )
        return (
            "/update_weights_from_distributed",
            {
                "names": meta.names,
                "dtypes": meta.dtype_names,
                "shapes": meta.shapes,
                "group_name": GROUP,
                "flush_cache": False,
            },
        )

    def share_bucket(
        self, meta: BucketMeta, flat: torch.Tensor, device: torch.device | None
    ) -> str:
        # SGLang's own format: a pickled list of (name, tensor), each a view of the bucket
        return pickle_shared(unpack(meta, flat))

    def transfer_finish_requests(self, version: int) -> list[Request]:
        return [("/flush_cache", {})]

    def lora_launch(self, max_rank: int, max_loras: int = 1) -> tuple[list[str], dict[str, str]]:
        # no adapter at start: the modules are named so that any later adapter fits
        return [
            "--enable-lora",
            "--max-lora-rank",
            str(max_rank),
            "--lora-target-modules",
            "all",
            "--max-loras-per-batch",
            str(max_loras),
        ], {}

    def load_adapter_request(self, name: str, folder: str) -> Request:
        return ("/load_lora_adapter", {"lora_name": name, "lora_path": folder})

    def unload_adapter_request(self, name: str) -> Request:
        return ("/unload_lora_adapter", {"lora_name": name})

    def with_adapter(self, request: Request, name: str) -> Request:
        path, body = request
        return path, {**body, "lora_path": name}


class SglangRollout(ServerRollout):
    """SGLang server backend (see module docstring); `SglangRollout(config)`."""

    protocol_class = SglangProtocol

    def __init__(self, config: RolloutConfig) -> None:
        super().__init__(config, SglangProtocol())
