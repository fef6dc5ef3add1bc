"""The client side shared by server backends (`vllm`, `sglang`).

`ServerRollout` starts the server (or connects to given URLs), sends requests with one
`httpx.AsyncClient` on a private event-loop thread (so `generate` works from sync code and
`agenerate` from any event loop), and turns every failure into a `RolloutError`. What differs
between servers (command line, request and response JSON, reload and abort endpoints) is a
`ServerProtocol`, tested on its own.

Partial rollout (`paused()`), the same code for every server: the client holds new requests
back, asks each server to abort everything in flight (`ServerProtocol.abort_request`), and
waits until every request has come back. An aborted request returns what it generated so far
(finish reason `abort`: token ids and log-probs); once the owner's update is done the client
resubmits each unfinished sample as prompt + its tokens, with the rest of its `max_tokens`.
Since an update starts only after every request has returned, and a request is sent only
while no update runs, each request runs under one weight version: its tokens are tagged with
the `weight_version` current when it was sent.
"""

from __future__ import annotations

import abc
import asyncio
import base64
import collections
import contextlib
import hashlib
import itertools
import os
import secrets
import shutil
import socket
import tempfile
import threading
import time
import warnings
import zlib
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, cast
from urllib.parse import urlparse

import httpx
import torch

from tephra.engine_api.adapters import LoraAdapter
from tephra.engine_api.errors import ConfigError
from tephra.engine_api.multimodal import MultimodalInputs, check_image_tokens, vision_family
from tephra.rollout.backends.server_process import ServerProcess, free_port
from tephra.rollout.backends.vllm_plugin.tephra_weight_transport import (
    BucketMeta,
    broadcast,
    buckets,
    open_group,
    unpack,
)
from tephra.rollout.backends.weights_folder import (
    EMBEDDINGS,
    HEAD,
    is_tied,
    served_copy,
    write_adapter,
    write_update,
)
from tephra.rollout.base import (
    DEFAULT_ADAPTER,
    Rollout,
    RolloutConfig,
    RolloutError,
    RolloutOutput,
    Sample,
    SamplingParams,
    ServerDiedError,
    ServerSettings,
    adapter_of,
    check_adapter_slot,
    check_prompts,
)
from tephra.rollout.colocation import resolve_server_settings
from tephra.rollout.weight_transport import TRANSPORTS, Placement, choose_transport

Request = tuple[str, dict]
"""(path, JSON body) of one POST."""
REAP_WAIT_S = 5.0
"""After a failed request, how long to wait for a managed server process to be seen dead, so
that the error says the server died rather than that a connection broke."""

ABORTED = "abort"
"""Finish reason `parse_samples` gives a sample the server aborted (its tokens so far); only
the client sees it: a sample aborted by `paused()` is resumed, any other abort is an error."""


def server_device() -> str:
    """Where a server this process starts computes: `cuda` where this process sees a GPU."""
    return "cuda" if torch.cuda.is_available() else "cpu"


class ServerProtocol(abc.ABC):
    """How to start and talk to one kind of server."""

    name: str
    health_path: str = "/health"
    needs_untied_head: bool = False
    """Serve tied models from an untied copy (vLLM keeps a stale tied head after reloads)."""

    @abc.abstractmethod
    def default_python(self) -> str: ...

    @abc.abstractmethod
    def launch_command(
        self,
        python: str,
        model_dir: str,
        host: str,
        port: int,
        config: RolloutConfig,
        settings: ServerSettings,
    ) -> list[str]: ...

    def default_env(self) -> dict[str, str]:
        return {}

    def weight_names(self, model_dir: str) -> Callable[[str], str] | None:
        """How the server names the weights of the model in `model_dir`, when not as
        transformers saves them (the served copy and every update are renamed); None: as saved."""
        return None

    def check_settings(self, settings: ServerSettings) -> None:
        """Refuse settings this server cannot honour here (a `ConfigError` naming the field),
        before anything starts. Default: everything is accepted."""
        return None

    def launch_env(self, settings: ServerSettings) -> dict[str, str]:
        """Environment the settings add (after `default_env`, before `settings.env`)."""
        return {}

    @abc.abstractmethod
    def key_launch(self, key: str) -> tuple[list[str], dict[str, str]]:
        """Extra arguments and environment that make the server demand `key` on every route
        but its health check (dev and weight routes included)."""

    @abc.abstractmethod
    def sample_requests(self, prompt_ids: list[int], sampling: SamplingParams) -> list[Request]:
        """The requests that give `sampling.n` samples of one prompt."""

    def image_requests(
        self, prompt_ids: list[int], sampling: SamplingParams, images: dict[str, Any]
    ) -> list[Request]:
        """The requests that give `sampling.n` samples of one prompt with images (`images`:
        what `image_payload` made of them); a server that cannot take images refuses."""
        raise RolloutError(
            f"rollout.backend={self.name!r} does not take images (prompts with a "
            "MultimodalInputs); set rollout.backend=vllm or rollout.backend=hf"
        )

    @abc.abstractmethod
    def parse_samples(self, response: dict, sampling: SamplingParams) -> list[Sample]:
        """The samples in one response, in sample order; an aborted sample has finish reason
        `ABORTED` and the tokens (and log-probs) generated before the abort."""

    @abc.abstractmethod
    def abort_request(self) -> Request:
        """The request that aborts every generation in flight on the server, each of which
        then returns what it generated so far (partial rollout)."""

    @abc.abstractmethod
    def reload_requests(self, weights_dir: str) -> list[Request]:
        """Requests that load the weights in `weights_dir` and drop cached prefixes."""

    def sleep_requests(self, settings: ServerSettings) -> list[Request]:
        """Requests that put the server to sleep at `settings.sleep_level` (none at 0)."""
        return []

    def wake_requests(self, settings: ServerSettings, tags: list[str]) -> list[Request]:
        """Requests that wake the parts of a sleeping server named by `tags` (`weights`,
        `kv_cache`)."""
        return []

    # -- in-memory weight transfer: the trainer broadcasting as rank 0 of a private process
    # group (gloo, nccl), or sending shared-memory handles (ipc) --
    packs_buckets: bool = True
    """One flat broadcast per bucket (True) or one broadcast per tensor of the bucket (False)."""
    weight_transports: tuple[str, ...] = TRANSPORTS
    """The transports this server's weight-transfer API takes."""

    def transfer_init_request(
        self, transport: str, address: str, port: int, world_size: int
    ) -> Request | None:
        """The request that prepares the server for updates: for a group transport its
        workers join the group (ranks 1..world_size-1) at address:port; None if none is needed."""
        raise NotImplementedError(f"{self.name} has no in-memory weight transfer")

    def transfer_start_requests(self) -> list[Request]:
        return []

    @abc.abstractmethod
    def transfer_bucket_request(self, meta: BucketMeta, handle: str | None) -> Request:
        """The request announcing one bucket; the server then receives it by broadcast, or
        (ipc) opens `handle`, what `share_bucket` made of it."""

    def share_bucket(
        self, meta: BucketMeta, flat: torch.Tensor, device: torch.device | None
    ) -> str:
        """The `handle` of one bucket for the ipc transport."""
        raise NotImplementedError(f"{self.name} has no ipc weight transfer")

    def transfer_finish_requests(self, version: int) -> list[Request]:
        return []

    # -- LoRA adapters served over the base weights (adapter-only sync) --
    @abc.abstractmethod
    def lora_launch(self, max_rank: int, max_loras: int = 1) -> tuple[list[str], dict[str, str]]:
        """Extra arguments and environment that start the server able to load LoRA adapters
        of rank up to `max_rank` at run time, `max_loras` of them served at once."""

    @abc.abstractmethod
    def load_adapter_request(self, name: str, folder: str) -> Request:
        """The request that loads the peft folder `folder` as adapter `name`."""

    @abc.abstractmethod
    def unload_adapter_request(self, name: str) -> Request:
        """The request that drops adapter `name`."""

    @abc.abstractmethod
    def with_adapter(self, request: Request, name: str) -> Request:
        """`request` (a generation request) made to sample through adapter `name`."""


class ServerRollout(Rollout):
    """A `Rollout` over one or more generation servers (see module docstring).

    `update_adapter` writes the adapter as a peft folder under `weights_dir`, loads it on
    every server under a new server-side name (`tephra-lora-<n>`, or `tephra-lora-<name>-<n>`
    for a named adapter), unloads the one it replaces, and names the current one of the
    request's `SamplingParams.adapter` in every generation request after that."""

    supports_adapters = True

    def __init__(self, config: RolloutConfig, protocol: ServerProtocol) -> None:  # noqa: PLR0915 (older than the limit; to split)
        self.config = config
        self.protocol = protocol
        # what the owner left automatic, resolved for a server of its own (a trainer resolves
        # a colocated server's before it builds the rollout: `tephra.rollout.colocation`)
        self.settings: ServerSettings = resolve_server_settings(
            getattr(config, protocol.name), protocol.name, server_device()
        ).settings
        protocol.check_settings(self.settings)
        if config.record_routes:
            raise ConfigError(
                f"rollout.backend={protocol.name!r} with routing replay (actor.moe."
                f"routing_replay=rollout): the {protocol.name} server returns no routed "
                "experts here (vLLM 0.32 records them only in its V2 GPU model runner, with "
                "--enable-return-routed-experts; the CPU build's runner never does); use "
                "rollout.backend=hf or set actor.moe.routing_replay=off"
            )
        self.process: ServerProcess | None = None
        self._closed = False
        self._own_dir = self.settings.weights_dir is None
        self.weights_dir = Path(
            self.settings.weights_dir or tempfile.mkdtemp(prefix=f"tephra-{protocol.name}-")
        )
        self.weights_dir.mkdir(parents=True, exist_ok=True)
        self._updates = itertools.count()
        self._last_update: Path | None = None
        self._groups: dict[str, Any] = {}
        self._hf_config: Any = None
        self.update_count = 0
        """Number of `update_weights` calls so far (sent to servers that record a version)."""
        self.weight_version: int | None = None
        """Version of the weights held, set by the owner (partial rollout); when not None every
        generated token is tagged with it (`Sample.token_versions`)."""
        self._pause_holds = 0
        """`paused()` contexts entered and not left (generation opens again at 0)."""
        self._adapters: dict[str, tuple[str, Path]] = {}
        """Each loaded adapter's name -> its server-side name and its folder."""
        self.last_update_stats: dict[str, float] = {}
        """Of the last update: `seconds`, `buckets`, `max_bucket_bytes`, `bytes`."""
        self.calls: collections.Counter[str] = collections.Counter()
        """How often `sleep`, `wake_up` and `update_weights` ran (what the trainer asked)."""
        self.asleep: set[str] = set()
        """The parts of the server (`weights`, `kv_cache`) put to sleep and not woken yet."""
        self._transport = self._choose_transport()
        if self.settings.weight_sync == "disk":
            warnings.warn(
                f"{protocol.name}.weight_sync=disk: every weight update is written to "
                f"{self.weights_dir} and reloaded by the server; `memory` keeps the disk "
                "off the hot path",
                stacklevel=2,
            )
        model_dir = config.model_path
        if not (Path(model_dir) / "config.json").is_file():
            raise RolloutError(
                f"rollout.model_path={model_dir!r} has no config.json; give a local Hugging Face "
                "folder (save_pretrained / Engine.export_hf) that the server can load"
            )
        self._tied = protocol.needs_untied_head and is_tied(model_dir)
        self._rename = protocol.weight_names(model_dir)
        key = self.settings.api_key
        self._api_key = secrets.token_urlsafe(32) if key == "auto" else key
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name=f"tephra-{protocol.name}-http", daemon=True
        )
        self._thread.start()
        self._client = self._call(self._make_client())
        try:
            if self.settings.url:
                self.urls = [
                    u.strip().rstrip("/") for u in self.settings.url.split(",") if u.strip()
                ]
                for url in self.urls:
                    self._check_reachable(url)
            else:
                if self._tied or self._rename is not None:
                    model_dir = str(
                        served_copy(
                            model_dir,
                            self.weights_dir / "served-model",
                            untie=self._tied,
                            rename=self._rename,
                        )
                    )
                self.model_dir = model_dir
                self.urls = [self._start_server(model_dir)]
        except BaseException:
            self.close()
            raise

    @property
    def transport(self) -> str:
        """The transport of `memory` updates (`settings.weight_transport`, with `auto`
        resolved by where the server runs: `tephra.rollout.weight_transport`)."""
        return self._transport

    @transport.setter
    def transport(self, value: str) -> None:
        """Another transport from the next update on (the servers are prepared for it again);
        for tests and benchmarks, which drive ipc as CPU shared memory, refused by config."""
        if value not in TRANSPORTS:
            raise ValueError(f"transport={value!r}: choose one of {list(TRANSPORTS)}")
        if value != self._transport:
            self._transport, self._groups = value, {}

    def _choose_transport(self) -> str:
        settings = self.settings
        device = server_device()
        return choose_transport(
            f"{self.protocol.name}.weight_transport",
            settings.weight_transport,
            Placement(
                device,
                same_device=settings.url is None,
                server_gpus=settings.tensor_parallel_size * settings.data_parallel_size,
            ),
            self.protocol.weight_transports,
            self.protocol.name,
        )

    # -- plumbing -------------------------------------------------------------------------------

    async def _make_client(self) -> httpx.AsyncClient:
        self._semaphore = asyncio.Semaphore(self.settings.max_in_flight)
        # partial rollout, on this loop: `_open` is cleared while an update holds generation;
        # `_in_flight` counts generation requests sent and not answered (`_idle` when none);
        # `_pauses` counts the pauses begun, so an abort seen by a request is known to be ours
        self._open, self._idle = asyncio.Event(), asyncio.Event()
        self._open.set()
        self._idle.set()
        self._in_flight = self._pauses = 0
        # aborts must not queue behind the generation requests they are meant to end
        headers = {"Authorization": f"Bearer {self._api_key}"} if self._api_key else {}
        timeout = httpx.Timeout(self.settings.request_timeout_s)
        self._control = httpx.AsyncClient(timeout=timeout, headers=headers)
        limits = httpx.Limits(
            max_connections=self.settings.max_in_flight,
            max_keepalive_connections=self.settings.max_in_flight,
        )
        return httpx.AsyncClient(timeout=timeout, limits=limits, headers=headers)

    def _call(self, coro: Any) -> Any:
        """Run a coroutine on the private loop and wait for it (from synchronous code)."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def _start_server(self, model_dir: str) -> str:
        settings = self.settings
        python = settings.python or self.protocol.default_python()
        port = settings.port or free_port(settings.host)
        env = {
            k: v
            for k, v in os.environ.items()
            if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")
        }
        env.update(self.protocol.default_env())
        env.update(self.protocol.launch_env(settings))
        env.update(settings.env)
        command = self.protocol.launch_command(
            python, model_dir, settings.host, port, self.config, settings
        )
        if self._api_key:
            args, key_env = self.protocol.key_launch(self._api_key)
            command += args
            env = merge_env(env, key_env)
        if self.config.max_lora_rank:
            args, lora_env = self.protocol.lora_launch(
                self.config.max_lora_rank, self.config.max_loras
            )
            command += args
            env = merge_env(env, lora_env)
        log_path = settings.log_path or str(self.weights_dir / "server.log")
        self.process = ServerProcess(self.protocol.name, command, env, log_path)
        url = f"http://{settings.host}:{port}"
        self.process.wait_healthy(url, settings.startup_timeout_s, self.protocol.health_path)
        return url

    def _check_reachable(self, url: str) -> None:
        try:
            httpx.get(url + self.protocol.health_path, timeout=10.0).raise_for_status()
        except httpx.HTTPError as exc:
            raise RolloutError(
                f"{self.protocol.name}.url: no healthy server at {url}{self.protocol.health_path} "
                f"({exc}); start it or fix the URL"
            ) from exc

    def _dead_error(self) -> RolloutError | None:
        if self.process is not None and not self.process.alive():
            return self.process.failure("died")
        return None

    async def _dead_within(self, seconds: float) -> RolloutError | None:
        """`_dead_error()` once the server process has exited, waiting up to `seconds` for
        it: a request's connection breaks while a killed server exits, before `poll()` sees
        it gone, and on a loaded machine that gap can be long. None if it is still running
        (then the request failed for another reason)."""
        if self.process is None:
            return None
        deadline = time.monotonic() + seconds
        while self.process.alive() and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        return self._dead_error()

    async def _post(self, url: str, request: Request, control: bool = False) -> dict:
        """POST on the private loop; a dead server process ends the wait within a second.
        `control`: on a client of its own, not counted against `max_in_flight` (aborts)."""
        path, body = request
        client = self._control if control else self._client
        async with contextlib.nullcontext() if control else self._semaphore:
            task = asyncio.ensure_future(client.post(url + path, json=body))
            while True:
                done, _ = await asyncio.wait({task}, timeout=1.0)
                if done:
                    break
                dead = self._dead_error()
                if dead is not None:
                    task.cancel()
                    raise dead
            try:
                response = task.result()
            except httpx.HTTPError as exc:
                raise await self._dead_within(REAP_WAIT_S) or RolloutError(
                    f"{self.protocol.name} request {path} to {url} failed: {type(exc).__name__}: {exc}"
                ) from exc
        if response.status_code != 200:
            raise RolloutError(
                f"{self.protocol.name} server refused {path} (HTTP {response.status_code}): "
                f"{response.text[:800]}"
            )
        if "json" not in response.headers.get("content-type", ""):
            # vLLM answers its LoRA routes with plain text ("Success: LoRA adapter ...")
            return {"text": response.text}
        return response.json()

    def _url_for(self, session_id: str | None, index: int) -> str:
        if len(self.urls) == 1:
            return self.urls[0]
        if session_id is None:
            return self.urls[index % len(self.urls)]
        return self.urls[zlib.crc32(session_id.encode()) % len(self.urls)]

    async def _sample(
        self,
        url: str,
        prompt_ids: list[int],
        sampling: SamplingParams,
        images: MultimodalInputs | None = None,
    ) -> list[Sample]:
        """`sampling.n` samples of one prompt; a sample aborted by `paused()` goes on from its
        tokens under the weights set meanwhile (`_resume`)."""
        samples, paused = await self._send(url, list(prompt_ids), sampling, images)
        if len(samples) != sampling.n:
            raise RolloutError(
                f"{self.protocol.name} returned {len(samples)} samples, asked n={sampling.n}"
            )
        return list(
            await asyncio.gather(
                *(
                    self._resume(url, list(prompt_ids), sampling, j, g, images)
                    if g.finish_reason == ABORTED
                    else asyncio.sleep(0, g)
                    for j, g in enumerate(self._check_abort(samples, paused))
                )
            )
        )

    async def _send(
        self,
        url: str,
        prompt_ids: list[int],
        sampling: SamplingParams,
        images: MultimodalInputs | None = None,
    ) -> tuple[list[Sample], bool]:
        """The samples of one prompt's requests, sent once generation is open (not inside
        `paused()`), each token tagged with the `weight_version` current when they were sent
        (no update can start before they return); and whether a pause began meanwhile."""
        while not self._open.is_set():
            await self._open.wait()
        version, pauses = self.weight_version, self._pauses
        requests = (
            self.protocol.sample_requests(prompt_ids, sampling)
            if images is None
            else self.protocol.image_requests(
                prompt_ids,
                sampling,
                image_payload(prompt_ids, images, self._vision_config(), self.update_count),
            )
        )
        served = adapter_of(sampling, self._adapters)
        if served is not None:
            server_name = self._adapters[served][0]
            requests = [self.protocol.with_adapter(r, server_name) for r in requests]
        self._in_flight += 1
        self._idle.clear()
        try:
            responses = await asyncio.gather(*(self._post(url, r) for r in requests))
        finally:
            self._in_flight -= 1
            if not self._in_flight:
                self._idle.set()
        for resp in responses:
            # the server's prompt must be ours: images expanded once, never twice
            used = resp.get("prompt_token_ids")
            if used is not None and list(used) != prompt_ids:
                raise RolloutError(
                    f"{self.protocol.name} ran a prompt of {len(used)} tokens for the "
                    f"{len(prompt_ids)} sent (first difference at {_first_difference(used, prompt_ids)}); "
                    "it must use the token ids as given"
                )
        samples = [g for resp in responses for g in self.protocol.parse_samples(resp, sampling)]
        if version is not None:
            for g in samples:
                g.token_versions = [version] * len(g.response_ids)
        return samples, self._pauses != pauses

    def _check_abort(self, samples: list[Sample], paused: bool) -> list[Sample]:
        if not paused and any(g.finish_reason == ABORTED for g in samples):
            raise RolloutError(
                f"{self.protocol.name} aborted a sample that this rollout did not pause (another "
                "client aborted it, or the server is shutting down); expected stop or length"
            )
        return samples

    async def _resume(
        self,
        url: str,
        prompt_ids: list[int],
        sampling: SamplingParams,
        j: int,
        partial: Sample,
        images: MultimodalInputs | None = None,
    ) -> Sample:
        """Sample `j` of a prompt, aborted after `partial`'s tokens: resubmit prompt + tokens
        with the rest of `max_tokens` (one sample, seed `seed + j + 1_000_003 * k` on the k-th
        resumption) until it stops or reaches its budget."""
        tokens, log_probs = list(partial.response_ids), partial.log_probs
        versions = partial.token_versions
        resumes = 0
        while partial.finish_reason == ABORTED:
            rest = sampling.max_tokens - len(tokens)
            if rest <= 0:  # the abort raced the last token: the budget is spent
                return Sample(
                    response_ids=tokens,
                    log_probs=log_probs,
                    finish_reason="length",
                    token_versions=versions,
                )
            resumes += 1
            seed = None if sampling.seed is None else sampling.seed + j + 1_000_003 * resumes
            more, paused = await self._send(
                url,
                prompt_ids + tokens,
                sampling.replace(n=1, max_tokens=rest, seed=seed),
                images,
            )
            [partial] = self._check_abort(more, paused)
            tokens += partial.response_ids
            log_probs = None if log_probs is None else log_probs + (partial.log_probs or [])
            versions = (
                None
                if versions is None or partial.token_versions is None
                else versions + partial.token_versions
            )
        return Sample(
            response_ids=tokens,
            log_probs=log_probs,
            finish_reason=partial.finish_reason,
            token_versions=versions,
        )

    # -- the contract ---------------------------------------------------------------------------

    def generate(
        self,
        prompts: list[list[int]],
        sampling: SamplingParams,
        multimodal: list[MultimodalInputs | None] | None = None,
    ) -> RolloutOutput:
        """`multimodal[i]`: prompt i's images (a vision-language model), None for none."""
        check_prompts(prompts, sampling, self.config.max_model_len, multimodal=multimodal)
        adapter_of(sampling, self._adapters)  # an unknown name fails before any request
        images = multimodal or [None] * len(prompts)
        for i, m in enumerate(images):
            self._check_images(prompts[i], m, f"prompt {i}")
        self._ensure_open()

        def seeded(i: int) -> SamplingParams:
            # prompt i's samples take seeds seed + i*n ... seed + i*n + n-1 (no two share one)
            return (
                sampling
                if sampling.seed is None
                else sampling.replace(seed=sampling.seed + i * sampling.n)
            )

        async def run() -> list[list[Sample]]:
            return await asyncio.gather(
                *(
                    self._sample(self._url_for(None, i), p, seeded(i), images[i])
                    for i, p in enumerate(prompts)
                )
            )

        per_prompt = self._call(run())
        return RolloutOutput.from_generations(
            list(prompts), [g for gs in per_prompt for g in gs], sampling.n
        )

    async def agenerate(
        self,
        prompt_ids: list[int],
        sampling: SamplingParams,
        session_id: str | None = None,
        multimodal: MultimodalInputs | None = None,
    ) -> Sample:
        if sampling.n != 1:
            raise RolloutError(
                f"agenerate serves one sample; got sampling.n={sampling.n} (send n requests)"
            )
        check_prompts([prompt_ids], sampling, self.config.max_model_len)
        adapter_of(sampling, self._adapters)
        self._check_images(prompt_ids, multimodal, "agenerate")
        self._ensure_open()
        url = self._url_for(session_id, 0)
        future = asyncio.run_coroutine_threadsafe(
            self._sample(url, prompt_ids, sampling, multimodal), self._loop
        )
        return (await asyncio.wrap_future(future))[0]

    def _vision_config(self) -> Any:
        """The served model's transformers config (its image token and merge sizes)."""
        if self._hf_config is None:
            # transformers takes seconds to import; only prompts with images need the config
            from transformers import AutoConfig

            self._hf_config = AutoConfig.from_pretrained(self.config.model_path)
        return self._hf_config

    def _check_images(
        self, prompt_ids: list[int], images: MultimodalInputs | None, where: str
    ) -> None:
        if images is None:
            return
        if images.num_videos:
            raise RolloutError(
                f"{where}: rollout.backend={self.protocol.name!r} takes images, not videos; set "
                "rollout.backend=hf for prompts with videos"
            )
        check_image_tokens(prompt_ids, images, self._vision_config(), where)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Send the tensors to every server (`weight_sync`: in memory, or through the disk) and
        drop cached prefixes; `update_count` counts the updates. Inside `paused()` no request
        is in flight; outside it, requests running on the server meanwhile may take tokens
        from both the old and the new weights (untagged)."""
        self._ensure_open()
        self.calls["update_weights"] += 1
        start = time.perf_counter()
        self.update_count += 1
        # a sleeping server: weights first, the KV cache only after the update, so that the
        # cache and the sender's buckets are never allocated together (verl's order)
        self._wake(["weights"])
        named_tensors = self._server_names(named_tensors)
        if self.settings.weight_sync == "memory":
            self.last_update_stats = self._update_in_memory(self._with_untied_head(named_tensors))
        else:
            self._update_from_disk(named_tensors)
            self.last_update_stats = {}
        self._wake(["kv_cache"])
        self.last_update_stats["seconds"] = time.perf_counter() - start

    @property
    def adapter(self) -> str | None:
        """The server-side name of the default adapter (`update_adapter` without a name;
        None: none loaded)."""
        entry = self._adapters.get(DEFAULT_ADAPTER)
        return entry[0] if entry is not None else None

    @property
    def adapters(self) -> dict[str, str]:
        """Each loaded adapter's name -> its server-side name."""
        return {name: served for name, (served, _) in sorted(self._adapters.items())}

    def update_adapter(self, adapter: LoraAdapter, name: str = DEFAULT_ADAPTER) -> None:
        """Load `adapter` on every server under a new server-side name, then unload the one
        it replaces (the adapter loaded as `name` before; the server's base weights are not
        touched); later requests through `name` use the new one. A server started here
        needs `config.max_lora_rank` >= the adapter's rank, and holds at most
        `config.max_loras` names."""
        self._ensure_open()
        check_adapter_slot(self._adapters, name, self.config.max_loras)
        if self.config.max_lora_rank and adapter.rank > self.config.max_lora_rank:
            raise RolloutError(
                f"update_adapter: rank {adapter.rank} exceeds rollout.max_lora_rank="
                f"{self.config.max_lora_rank}, the most the {self.protocol.name} server was "
                "started to serve"
            )
        self.calls["update_adapter"] += 1
        start = time.perf_counter()
        self.update_count += 1
        self._wake(["weights"])
        served = (
            f"tephra-lora-{self.update_count}"
            if name == DEFAULT_ADAPTER
            else f"tephra-lora-{name}-{self.update_count}"
        )
        folder = self.weights_dir / f"adapter-{next(self._updates):06d}"
        write_adapter(adapter, folder, self.config.model_path)
        self._run_all([self.protocol.load_adapter_request(served, str(folder))])
        old = self._adapters.get(name)
        self._adapters[name] = (served, folder)
        if old is not None:
            self._run_all([self.protocol.unload_adapter_request(old[0])])
            shutil.rmtree(old[1], ignore_errors=True)
        self._wake(["kv_cache"])
        self.last_update_stats = {
            "bytes": float(adapter.nbytes),
            "seconds": time.perf_counter() - start,
        }

    def _server_names(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterable[tuple[str, torch.Tensor]]:
        """The tensors under the names the server loads (`ServerProtocol.weight_names`)."""
        rename = self._rename
        if rename is None:
            return named_tensors
        return ((rename(name), tensor) for name, tensor in named_tensors)

    def _with_untied_head(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """A tied model is served untied: its head follows the embedding."""
        seen_head, embedding = False, None
        for name, tensor in named_tensors:
            seen_head |= name == HEAD
            if name in EMBEDDINGS:
                embedding = tensor
            yield name, tensor
        if self._tied and not seen_head and embedding is not None:
            yield HEAD, embedding

    def _open_groups(self) -> None:
        """One private group per server: this process is rank 0, the server's workers the
        rest. The server joins inside its init request, so that request runs on the HTTP
        loop while this thread hosts the rendezvous. ipc needs no group: the server is
        only told (when its protocol asks) that handles will come."""
        workers = self.settings.tensor_parallel_size * self.settings.data_parallel_size
        backend = self._transport
        for url in self.urls:
            host = self.settings.host if self.settings.url is None else _own_address(url)
            if backend == "ipc":
                request = self.protocol.transfer_init_request(backend, host, 0, 1 + workers)
                if request is not None:
                    self._call(self._post(url, request))
                self._groups[url] = None
                continue
            port = free_port()
            request = self.protocol.transfer_init_request(backend, host, port, 1 + workers)
            # a group transport has an init request (protocols give None only for ipc)
            pending = asyncio.run_coroutine_threadsafe(
                self._post(url, cast(Request, request)), self._loop
            )
            try:
                self._groups[url] = open_group(
                    host, port, 0, 1 + workers, backend, self.settings.startup_timeout_s
                )
            except Exception as exc:
                pending.cancel()
                raise RolloutError(
                    f"{self.protocol.name}.weight_sync=memory: the server at {url} did not join "
                    f"the weight-transfer group at {host}:{port} ({exc}); start it with tephra's "
                    "transfer plugin (see the rollout README) or set weight_sync=disk"
                ) from exc
            pending.result()

    def _update_in_memory(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]]
    ) -> dict[str, float]:
        if not self._groups:
            self._open_groups()
        device = (
            torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
        )
        self._run_all(self.protocol.transfer_start_requests())
        bucket_bytes = int(self.settings.weight_bucket_mb * 1024**2)
        count = max_bytes = total = 0
        for meta, flat in buckets(named_tensors, self.config.torch_dtype, bucket_bytes):
            flat = flat.to(device) if device is not None else flat
            nbytes = flat.numel() * flat.element_size()
            count, total, max_bytes = count + 1, total + nbytes, max(max_bytes, nbytes)
            if self.transport == "ipc":
                self._send_handle(meta, flat, device)
            for url, group in self._groups.items():
                if group is None:
                    continue
                pending = asyncio.run_coroutine_threadsafe(
                    self._post(url, self.protocol.transfer_bucket_request(meta, None)), self._loop
                )
                if self.protocol.packs_buckets:
                    broadcast(group, flat)
                else:
                    for _, tensor in unpack(meta, flat):
                        broadcast(group, tensor.contiguous())
                pending.result()
            del flat
        self._run_all(self.protocol.transfer_finish_requests(self.update_count))
        if device is not None and self.transport == "ipc":
            torch.cuda.ipc_collect()  # the server has let go of every bucket's handle
        return {"buckets": count, "max_bucket_bytes": max_bytes, "bytes": total}

    def _send_handle(
        self, meta: BucketMeta, flat: torch.Tensor, device: torch.device | None
    ) -> None:
        """ipc: every server opens the bucket's handle and copies it into its weights before
        its request returns, so the bucket may be freed afterwards (one bucket at a time)."""
        if device is None:
            # CPU shared memory moves the storage into a shared file: share a copy, never
            # the caller's tensor (a bucket of one tensor is a view of the trainer's weight)
            flat = flat.clone()
        handle = self.protocol.share_bucket(meta, flat, device)
        self._run_all([self.protocol.transfer_bucket_request(meta, handle)])

    def _update_from_disk(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Write the tensors as safetensors into a fresh folder under `weights_dir`, ask each
        server to reload from it and to drop its prefix cache; the previous folder is removed."""
        folder = self.weights_dir / f"update-{next(self._updates):06d}"
        write_update(
            named_tensors,
            folder,
            self.config.torch_dtype,
            config_from=getattr(self, "model_dir", self.config.model_path),
            add_untied_head=self._tied,
        )

        async def reload() -> None:
            for url in self.urls:
                for request in self.protocol.reload_requests(str(folder)):
                    await self._post(url, request)

        self._call(reload())
        if self._last_update is not None:
            shutil.rmtree(self._last_update, ignore_errors=True)
        self._last_update = folder

    def _run_all(self, requests: list[Request]) -> None:
        async def run() -> None:
            for url in self.urls:
                for request in requests:
                    await self._post(url, request)

        if requests:
            self._call(run())

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Hold generation for a weight update (partial rollout): requests are held back, the
        ones in flight are aborted on every server and return their tokens and log-probs so
        far; on exit each unfinished sample is resubmitted (prompt + its tokens, the rest of
        its budget) under the weights and `weight_version` set inside. From any thread but
        the rollout's own HTTP loop."""
        self._ensure_open()
        try:
            self._call(self._hold())
            yield
        finally:
            self._call(self._release())

    async def _hold(self) -> None:
        self._pause_holds += 1
        self._open.clear()
        self._pauses += 1
        while self._in_flight:
            # again until all are back: a request still on its way when the abort ran has
            # reached the server since
            for url in self.urls:
                try:
                    await self._post(url, self.protocol.abort_request(), control=True)
                except ServerDiedError:
                    raise
                except RolloutError as exc:
                    raise RolloutError(
                        f"{self.protocol.name}: aborting the requests in flight for a weight "
                        f"update (trainer.partial_rollout) failed: {exc}; {self.protocol.name} "
                        f"servers started elsewhere ({self.protocol.name}.url) must serve "
                        f"{self.protocol.abort_request()[0]} (see the rollout README)"
                    ) from exc
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._idle.wait(), timeout=0.25)

    async def _release(self) -> None:
        self._pause_holds -= 1
        if not self._pause_holds:
            self._open.set()

    def sleep(self) -> None:
        """Put the server to sleep at `sleep_level` (nothing at 0): level 1 keeps the weights
        in host memory, level 2 drops them (the next `update_weights` must come before a
        generation, and sends every weight anyway)."""
        self.calls["sleep"] += 1
        requests = self.protocol.sleep_requests(self.settings)
        if requests and not self.asleep:
            self._run_all(requests)
            self.asleep = {"weights", "kv_cache"}

    def wake_up(self) -> None:
        """Wake everything asleep (weights, then KV cache). `update_weights` wakes a sleeping
        server itself, in the order a sync needs."""
        self.calls["wake_up"] += 1
        if self.weights_dropped:
            raise RolloutError(
                f"{self.protocol.name}.sleep_level=2 dropped the server's weights; call "
                "update_weights (which wakes them and sends every weight) before waking it to "
                "generate, or use sleep_level=1 (weights kept in host memory)"
            )
        self._wake(["weights", "kv_cache"])

    @property
    def weights_dropped(self) -> bool:
        return "weights" in self.asleep and self.settings.sleep_level == 2

    def _wake(self, tags: list[str]) -> None:
        tags = [t for t in tags if t in self.asleep]
        if tags:
            self._run_all(self.protocol.wake_requests(self.settings, tags))
            self.asleep -= set(tags)

    def _ensure_open(self) -> None:
        if self._closed:
            raise RolloutError(f"{self.protocol.name} rollout is closed")
        dead = self._dead_error()
        if dead is not None:
            raise dead

    def close(self) -> None:
        """Kill a started server's process group, stop the HTTP thread. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._groups.clear()
        if self.process is not None:
            self.process.kill()
        try:
            self._call(self._client.aclose())
            self._call(self._control.aclose())
        except Exception:  # noqa: BLE001 - closing is best effort
            pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        if self._own_dir:
            shutil.rmtree(self.weights_dir, ignore_errors=True)


def encode_tensor(tensor: torch.Tensor) -> dict[str, Any]:
    """A tensor as JSON: its bytes in base64, its dtype and shape (read back exactly)."""
    tensor = tensor.detach().cpu().contiguous()
    data = tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b""
    return {
        "data": base64.b64encode(data).decode("ascii"),
        "dtype": str(tensor.dtype).removeprefix("torch."),
        "shape": list(tensor.shape),
    }


def image_placeholders(
    prompt_ids: list[int], images: MultimodalInputs, hf_config: Any
) -> list[tuple[int, int]]:
    """(offset, length) of each image's run of placeholder tokens in `prompt_ids`, in image
    order: the prompt already holds every image expanded (as the model's processor does)."""
    family = vision_family(hf_config)
    token = family.image_token_id(hf_config)
    positions = [p for p, t in enumerate(prompt_ids) if t == token]
    out: list[tuple[int, int]]
    out, start = [], 0
    for count in family.image_token_counts(images, hf_config):
        run = positions[start : start + count]
        if len(run) != count or run[-1] - run[0] != count - 1:
            raise RolloutError(
                f"image {len(out)}'s {count} placeholder tokens are not one run in the prompt; "
                "build prompt ids and images with the same processor (tephra.rollout."
                "multimodal.VisionProcessor)"
            )
        out.append((run[0], count))
        start += count
    return out


def image_payload(
    prompt_ids: list[int], images: MultimodalInputs, hf_config: Any, salt: int
) -> dict[str, Any]:
    """One prompt's images as a server request carries them: the processor's tensors, each
    image's placeholder range, and a hash per image of its pixels and `salt` (the weight
    update count: a server caches image features by hash, and they change with the weights)."""
    tensors = {"pixel_values": images.pixel_values}
    if images.image_grid_thw is not None:
        tensors["image_grid_thw"] = images.image_grid_thw
    placeholders = image_placeholders(prompt_ids, images, hf_config)
    if images.image_grid_thw is not None:
        sizes = images.image_grid_thw.prod(-1).tolist()
        pixels = list(torch.split(images.pixel_values, [int(n) for n in sizes]))
    else:
        pixels = list(images.pixel_values)
    hashes = []
    for i, p in enumerate(pixels):
        # a numpy array is a buffer; numpy's stubs do not say so
        digest = hashlib.sha256(p.detach().cpu().contiguous().view(torch.uint8).numpy())  # type: ignore[arg-type]
        if images.image_grid_thw is not None:
            digest.update(str(images.image_grid_thw[i].tolist()).encode())
        digest.update(f"|{salt}".encode())
        hashes.append(digest.hexdigest())
    return {
        "tensors": {k: encode_tensor(v) for k, v in tensors.items()},
        "placeholders": placeholders,
        "hashes": hashes,
    }


def _first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _own_address(url: str) -> str:
    """This machine's address on the route to the server at `url` (an external server joins
    the transfer group there)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.connect((urlparse(url).hostname or "127.0.0.1", 9))
        return sock.getsockname()[0]


def merge_env(env: dict[str, str], extra: dict[str, str]) -> dict[str, str]:
    """`env` updated by `extra`, search paths (`PYTHONPATH`) joined rather than replaced."""
    merged = dict(env)
    for name, value in extra.items():
        if name == "PYTHONPATH" and merged.get(name):
            value = f"{value}{os.pathsep}{merged[name]}"
        merged[name] = value
    return merged
