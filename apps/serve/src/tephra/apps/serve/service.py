"""What the server does for each Tinker call, independent of HTTP: base models, their
engines and samplers, training clients, saved sampler weights, and the queue of work.

All engine and sampler work runs on one worker thread, in the order the calls arrived: a
client's futures complete in its submission order (the SDK sends a training client's calls
one after another), and two clients' calls on one engine never interleave inside a call.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import itertools
import tempfile
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tephra.apps.serve import losses, wire
from tephra.apps.serve.adapters import SharedEngine
from tephra.apps.serve.errors import UserError
from tephra.apps.serve.sampler import Sampler, Sampling
from tephra.apps.serve.states import StateStore, check_name, parse
from tephra.engine_api.config import EngineConfig, ModelConfig
from tephra.engine_api.registry import get_engine

LORA_ALPHA = 32.0
"""LoRA scaling numerator of every adapter (the update is alpha / rank * B A)."""

Result = tuple[str, Any]
"""A finished call: `("json", dict)` or `("proto", bytes)`."""


@dataclass
class BaseModel:
    """A base model the server offers: its name, how to build it, its context length."""

    name: str
    model: ModelConfig
    max_context: int


@dataclass
class ServeSettings:
    engine: str = "fsdp"
    """Training engine (registry name); any engine passing the conformance kit serves."""
    workdir: Path | None = None
    """Folder of the states `save_state` writes (`checkpoints/`) and of the live clients'
    swapped-out states (`engines/serve-*/`, one folder per server, removed when it stops); a
    temporary folder, removed when the server stops, when None."""
    engine_overrides: dict[str, Any] = field(default_factory=dict)
    """Extra `EngineConfig` fields (`micro_batch`, `precision`, `device`) of every engine."""


class Service:
    def __init__(self, bases: list[BaseModel], settings: ServeSettings | None = None) -> None:
        self.bases = {b.name: b for b in bases}
        self.settings = settings or ServeSettings()
        self._tmp = None
        if self.settings.workdir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="tephra-serve-")
        self.workdir = Path(self._tmp.name) if self._tmp else Path(self.settings.workdir)  # type: ignore[arg-type]
        self.states = StateStore(self.workdir)
        # the live clients' swapped-out states: this server's own folder, removed at close
        (self.workdir / "engines").mkdir(parents=True, exist_ok=True)
        self._swap = tempfile.TemporaryDirectory(prefix="serve-", dir=self.workdir / "engines")
        self.engines: dict[tuple[str, int], SharedEngine] = {}
        self.samplers: dict[str, Sampler] = {}
        self.clients: dict[str, tuple[str, int]] = {}
        self.sampler_weights: dict[str, tuple[str, dict[str, torch.Tensor]]] = {}
        self.sampling_sessions: dict[str, tuple[str, str | None]] = {}
        self.futures: dict[str, concurrent.futures.Future[Result]] = {}
        self._ids = itertools.count(1)
        self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tephra-serve")

    def close(self) -> None:
        self._worker.shutdown(wait=True, cancel_futures=True)
        self._swap.cleanup()
        if self._tmp is not None:
            self._tmp.cleanup()

    # ----- futures -----------------------------------------------------------------------
    def submit(self, work: Callable[[], Result], model_id: str | None = None) -> dict:
        """Queue `work`; the reply the SDK takes for an `UntypedAPIFuture`."""
        request_id = f"req-{next(self._ids)}"
        self.futures[request_id] = self._worker.submit(work)
        reply: dict[str, Any] = {"request_id": request_id}
        if model_id is not None:
            reply["model_id"] = model_id
        return reply

    # ----- base models -------------------------------------------------------------------
    def capabilities(self) -> dict:
        return {
            "supported_models": [
                {
                    "model_name": b.name,
                    "max_context_length": b.max_context,
                    "trainable": True,
                    "sampleable": True,
                }
                for b in self.bases.values()
            ]
        }

    def _base(self, name: str | None, call: str) -> BaseModel:
        if name not in self.bases:
            raise UserError(
                f"{call}: base_model={name!r} is not served; this server has {sorted(self.bases)}"
            )
        return self.bases[name]

    def engine_config(self, base: BaseModel, rank: int) -> EngineConfig:
        """The engine of `rank`-rank adapters on `base` (AdamW, settings set per step)."""
        return EngineConfig(
            model=base.model,
            lora={"rank": rank, "alpha": LORA_ALPHA},  # type: ignore[arg-type]
            optimizer={"lr": 1e-4, "weight_decay": 0.0, "grad_clip": 0.0},  # type: ignore[arg-type]
            **{"device": "cpu", **self.settings.engine_overrides},
        )

    def _shared(self, base: BaseModel, rank: int) -> SharedEngine:
        key = (base.name, rank)
        if key not in self.engines:
            engine = get_engine(self.settings.engine, self.engine_config(base, rank))
            self.engines[key] = SharedEngine(engine, Path(self._swap.name) / f"{base.name}-r{rank}")
        return self.engines[key]

    # ----- training clients --------------------------------------------------------------
    def create_model(self, body: dict) -> dict:
        base = self._base(body.get("base_model"), "create_lora_training_client")
        lora = body.get("lora_config") or {}
        rank = int(lora.get("rank", 0))
        if rank < 1:
            raise UserError(
                "create_model: tephra serve trains LoRA adapters only; give lora_config.rank >= 1"
            )
        for flag in ("train_mlp", "train_attn"):
            if lora.get(flag, True) is False:
                raise UserError(
                    f"create_lora_training_client: {flag}=False is not served; adapters go "
                    "on every linear layer of attention and MLP"
                )
        model_id = f"{base.name}-lora-{uuid.uuid4().hex[:12]}"

        def work() -> Result:
            self._shared(base, rank).add_client(model_id)
            self.clients[model_id] = (base.name, rank)
            return "json", {"model_id": model_id, "type": "create_model"}

        return self.submit(work)

    def _client(self, model_id: str, call: str) -> SharedEngine:
        if model_id not in self.clients:
            raise UserError(f"{call}: model_id={model_id!r} is unknown to this server")
        base, rank = self.clients[model_id]
        return self.engines[(base, rank)]

    def get_info(self, body: dict) -> dict:
        model_id = body.get("model_id", "")
        self.futures_done()
        if model_id not in self.clients:
            raise UserError(f"get_info: model_id={model_id!r} is unknown to this server")
        base, rank = self.clients[model_id]
        hf = self.bases[base].model.hf_config or {}
        return {
            "type": "get_info",
            "model_id": model_id,
            "model_data": {"arch": hf.get("model_type"), "model_name": base},
            "is_lora": True,
            "lora_rank": rank,
            "model_name": base,
        }

    def futures_done(self) -> None:
        """Wait for the queued work (a call that reads state the queue writes)."""
        self._worker.submit(lambda: None).result()

    def forward_backward(self, call: wire.ForwardBackwardCall) -> dict:
        def work() -> Result:
            shared = self._client(call.model_id, "forward_backward")
            batch = losses.to_batch(call.data, call.loss_fn)
            if call.forward_only:
                log_probs = shared.forward(call.model_id, batch)
            else:
                log_probs = shared.forward_backward(call.model_id, batch, call.loss_fn)
            per_datum = losses.per_datum_log_probs(log_probs, batch)
            elementwise = losses.elementwise_losses(call.loss_fn, per_datum, batch)
            outputs = [
                {"logprobs": lp, "elementwise_loss": el} for lp, el in zip(per_datum, elementwise)
            ]
            total = float(sum(el.sum() for el in elementwise))
            return "proto", wire.forward_backward_output(outputs, {"loss:sum": total})

        return self.submit(work, call.model_id)

    def optim_step(self, body: dict) -> dict:
        model_id = body.get("model_id", "")
        if "adam_params" not in body:
            raise UserError(
                "optim_step: only AdamParams are served (the engine's optimizer is AdamW); "
                f"got {sorted(k for k in body if k.endswith('params'))}"
            )
        adam = body["adam_params"]

        def work() -> Result:
            shared = self._client(model_id, "optim_step")
            norm = shared.optim_step(
                model_id,
                lr=float(adam.get("learning_rate", 1e-4)),
                betas=(float(adam.get("beta1", 0.9)), float(adam.get("beta2", 0.95))),
                eps=float(adam.get("eps", 1e-12)),
                weight_decay=float(adam.get("weight_decay", 0.0)),
                grad_clip=float(adam.get("grad_clip_norm", 0.0)),
            )
            return "json", {"metrics": {"grad_norm:mean": norm}}

        return self.submit(work, model_id)

    # ----- saved states ------------------------------------------------------------------
    def save_weights(self, body: dict) -> dict:
        """`save_state(name)`: the client's adapter and optimizer state to disk."""
        model_id = body.get("model_id", "")
        name = check_name(body.get("path") or f"state-{uuid.uuid4().hex[:8]}", "save_state")
        overwrite = bool(body.get("overwrite", False))

        def work() -> Result:
            shared = self._client(model_id, "save_state")
            base, rank = self.clients[model_id]
            path, folder = self.states.prepare(model_id, name, overwrite, "save_state")
            shared.save_state(model_id, folder / "engine")
            self.states.record(path, folder, base, rank, body.get("user_metadata"))
            return "json", {"path": path, "type": "save_weights"}

        return self.submit(work, model_id)

    def load_weights(self, body: dict) -> dict:
        """`load_state(path)` / `load_state_with_optimizer(path)` on a client, or a new
        client from a saved state (`create_training_client_from_state[_with_optimizer]`: no
        `model_id`, the new client's id derived from the session as the SDK expects). Without
        `optimizer` the saved adapter is loaded alone and the optimizer starts afresh."""
        model_id = body.get("model_id")
        call = "load_state" if model_id else "create_training_client_from_state"
        path = body.get("path")
        parse(path, call)
        with_optimizer = bool(body.get("optimizer", False))
        if model_id is None:
            session, seq = body.get("session_id"), body.get("model_seq_id")
            if session is None or seq is None:
                raise UserError(f"{call}: give model_id, or session_id and model_seq_id")
            model_id = f"{session}:train:{seq}"
        override = body.get("base_model")

        def work() -> Result:
            state = self.states.get(path, call)
            if override is not None and override != state.base_model:
                raise UserError(
                    f"{call}: base_model={override!r}, but {path} was saved on "
                    f"{state.base_model!r}; omit base_model or give {state.base_model!r}"
                )
            base = self._base(state.base_model, call)
            if model_id in self.clients:
                if self.clients[model_id] != (base.name, state.lora_rank):
                    have_base, have_rank = self.clients[model_id]
                    raise UserError(
                        f"{call}: {path} holds a rank-{state.lora_rank} adapter of "
                        f"{base.name!r}; this client has a rank-{have_rank} adapter of "
                        f"{have_base!r}: load it with "
                        "create_training_client_from_state_with_optimizer"
                    )
                shared = self._client(model_id, call)
                load = shared.load_state if with_optimizer else shared.load_weights_only
                load(model_id, state.engine_checkpoint)
            else:
                shared = self._shared(base, state.lora_rank)
                shared.add_client(model_id)
                load = shared.load_state if with_optimizer else shared.load_weights_only
                try:
                    load(model_id, state.engine_checkpoint)
                except Exception:
                    del shared.clients[model_id]  # no client is made of a failed load
                    raise
                self.clients[model_id] = (base.name, state.lora_rank)
            return "json", {"path": path, "model_id": model_id, "type": "load_weights"}

        return self.submit(work, model_id)

    def list_checkpoints(self, run: str) -> dict:
        """The states `save_state` wrote from training client `run`."""
        self.futures_done()
        check_name(run, "list_checkpoints")
        return {
            "checkpoints": [
                {
                    "checkpoint_id": f"weights/{s.folder.name}",
                    "checkpoint_type": "training",
                    "time": datetime.datetime.fromtimestamp(s.time, datetime.UTC).isoformat(),
                    "tinker_path": s.path,
                    "size_bytes": sum(f.stat().st_size for f in s.folder.rglob("*") if f.is_file()),
                    "user_metadata": s.user_metadata or None,
                }
                for s in self.states.list(run)
            ],
            "cursor": None,
        }

    # ----- sampling ----------------------------------------------------------------------
    def save_weights_for_sampler(self, body: dict) -> dict:
        model_id = body.get("model_id", "")

        def work() -> Result:
            shared = self._client(model_id, "save_weights_for_sampler")
            base, _ = self.clients[model_id]
            name = body.get("path") or f"sampler-{uuid.uuid4().hex[:8]}"
            path = f"tinker://{model_id}/sampler_weights/{name}"
            self.sampler_weights[path] = (base, shared.weights(model_id))
            if body.get("path"):
                return "json", {"path": path, "type": "save_weights_for_sampler"}
            session = f"sampling-{uuid.uuid4().hex[:12]}"
            self.sampling_sessions[session] = (base, path)
            return "json", {"sampling_session_id": session, "type": "save_weights_for_sampler"}

        return self.submit(work, model_id)

    def create_sampling_session(self, body: dict) -> dict:
        path = body.get("model_path")
        self.futures_done()
        if path is not None:
            if path not in self.sampler_weights:
                raise UserError(
                    f"create_sampling_client: model_path={path!r} was not saved on this "
                    "server (save_weights_for_sampler gives the path)"
                )
            base = self.sampler_weights[path][0]
        else:
            base = self._base(body.get("base_model"), "create_sampling_client").name
        session = f"sampling-{uuid.uuid4().hex[:12]}"
        self.sampling_sessions[session] = (base, path)
        return {"type": "create_sampling_session", "sampling_session_id": session}

    def _sampler_for(self, body: dict) -> tuple[str, str | None]:
        session = body.get("sampling_session_id")
        if session is not None:
            if session not in self.sampling_sessions:
                raise UserError(f"sample: sampling_session_id={session!r} is unknown")
            return self.sampling_sessions[session]
        path = body.get("model_path")
        if path is not None:
            if path not in self.sampler_weights:
                raise UserError(f"sample: model_path={path!r} was not saved on this server")
            return self.sampler_weights[path][0], path
        return self._base(body.get("base_model"), "sample").name, None

    def _base_weights(self, base: str) -> dict[str, torch.Tensor]:
        # the base model's weights: an adapter's initial state (B = 0) merges to the base
        key = f"base:{base}"
        if key not in self.sampler_weights:
            bm = self.bases[base]
            rank = next((r for (b, r) in self.engines if b == base), 1)
            shared = self._shared(bm, rank)
            probe = f"{key}-probe"
            shared.add_client(probe)
            self.sampler_weights[key] = (base, shared.weights(probe))
            del shared.clients[probe]
            shared.active = None
        return self.sampler_weights[key][1]

    def sample(self, body: dict) -> dict:
        base, path = self._sampler_for(body)
        prompt = wire.prompt_tokens(body.get("prompt", {}), "sample")
        params = body.get("sampling_params", {})
        stop = params.get("stop")
        if isinstance(stop, str) or (
            isinstance(stop, list) and any(isinstance(s, str) for s in stop)
        ):
            raise UserError(
                "sample: sampling_params.stop holds strings; tephra serve has no tokenizer "
                "for its tiny models: give stop token ids"
            )
        n = int(body.get("num_samples", 1))
        if body.get("prompt_logprobs") or body.get("topk_prompt_logprobs", 0):
            raise UserError("sample: prompt_logprobs / topk_prompt_logprobs are not served")
        sampling = Sampling(
            max_tokens=int(params.get("max_tokens") or 16),
            temperature=float(params.get("temperature", 1.0)),
            top_k=int(params.get("top_k", -1)),
            top_p=float(params.get("top_p", 1.0)),
            seed=params.get("seed"),
            stop_ids=tuple(int(s) for s in (stop or [])),
        )

        def work() -> Result:
            if base not in self.samplers:
                self.samplers[base] = Sampler(self.bases[base].model)
            sampler = self.samplers[base]
            key = path or f"base:{base}"
            weights = self.sampler_weights[path][1] if path else self._base_weights(base)
            sampler.load(key, weights)
            return "proto", wire.sample_output(sampler.sample(prompt, n, sampling))

        reply = self.submit(work)
        reply["sample_sequence_ids"] = [f"{reply['request_id']}-{j}" for j in range(n)]
        return reply
