"""`hf`: in-process generation with transformers `generate` (the embedded default).

Prompts are left-padded into batches of at most `hf.max_batch_rows` rows (prompt i's n
samples are n consecutive rows). Each row samples from its own `torch.Generator`, seeded
`seed + i * n + j` for sample j of prompt i (the convention of `SamplingParams.seed`), so a
sample does not depend on the batch it shares: one call and the same prompts split into
shares (`SamplingParams.for_share`) give bitwise the same samples. Sampling (temperature, top-k, top-p) and the log-probs of the
sampled tokens come from `SampledLogProbRecorder`, the only logits processor, so the log-prob
is of the temperature-scaled distribution before truncation (see `tephra.rollout.base`).

Partial rollout: a weight update made under `paused()` from another thread stops in-flight
generation at the next token (a stopping criterion watches the flag); the unfinished rows
resume under the new weights and each token records the `weight_version` that produced it.
"""

from __future__ import annotations

import random
import threading
import warnings
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, cast

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    GenerationConfig,
    LogitsProcessorList,
    StoppingCriteria,
    StoppingCriteriaList,
)

from tephra.engine_api.adapters import PEFT_PREFIX, LoraAdapter
from tephra.kernels.cpu_linear import use_fast_linears
from tephra.rollout.backends.kv_cache import growing_cache
from tephra.rollout.backends.request_batcher import RequestBatcher
from tephra.rollout.backends.sampling_processor import SampledLogProbRecorder
from tephra.rollout.base import (
    DEFAULT_ADAPTER,
    FinishReason,
    Rollout,
    RolloutConfig,
    RolloutError,
    RolloutOutput,
    Sample,
    SamplingParams,
    adapter_of,
    check_adapter_slot,
    check_prompts,
)
from tephra.rollout.multimodal import MultimodalInputs, check_image_tokens, vision_family

_UNSET = object()
"""The active adapter before any was chosen (or after an injection, which may change it)."""

_SEED_MASK = 2**64 - 1
"""torch generators take seeds in [0, 2**64); larger or negative seeds wrap."""


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list | tuple) else [int(value)]


def _auto_class(model_path: str) -> Any:
    """A vision-language checkpoint (a config with `vision_config`) loads as image-text-to-
    text; everything else as a causal LM."""
    try:
        cfg = AutoConfig.from_pretrained(model_path)
    except (OSError, ValueError):
        return AutoModelForCausalLM  # from_pretrained reports the problem
    return (
        AutoModelForImageTextToText if getattr(cfg, "vision_config", None) else AutoModelForCausalLM
    )


class _StopWhenPaused(StoppingCriteria):
    """Stops every row after the token just sampled once `running` is cleared (`paused()`)."""

    def __init__(self, running: threading.Event) -> None:
        self.running = running

    def __call__(
        self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any
    ) -> torch.Tensor:
        stop = not self.running.is_set()
        return torch.full((input_ids.shape[0],), stop, dtype=torch.bool, device=input_ids.device)


class _StopToDropFinished(StoppingCriteria):
    """Stops every row once `fraction` of them finished (sampled a stop token or reached
    their own budget): `generate` would keep computing the finished rows to the end, so the
    caller drops them and continues the others from the KV cache."""

    def __init__(
        self,
        width: int,
        stops: list[int],
        budgets: list[int],
        fraction: float,
        device: torch.device,
    ) -> None:
        self.width, self.fraction = width, fraction
        self.stops = torch.tensor(stops, dtype=torch.long, device=device)
        self.budgets = torch.tensor(budgets, dtype=torch.long, device=device)

    def __call__(
        self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any
    ) -> torch.Tensor:
        new = input_ids[:, self.width :]
        done = new.shape[1] >= self.budgets
        if len(self.stops):
            done |= torch.isin(new, self.stops).any(-1)
        stop = int(done.sum()) >= self.fraction * len(done)
        return torch.full((input_ids.shape[0],), stop, dtype=torch.bool, device=input_ids.device)


@dataclass
class _Carry:
    """Where a segment that stopped to drop finished rows left the others: their ids and
    attention mask (prompt + tokens, as `generate` saw them) and their KV cache, valid
    while the weights are those of update `updates`."""

    ids: torch.Tensor
    attn: torch.Tensor
    cache: Any  # a transformers DynamicCache
    updates: int

    def keep(self, rows: list[int]) -> _Carry:
        if len(rows) == self.ids.shape[0]:
            return self
        index = torch.tensor(rows, device=self.ids.device)
        self.cache.batch_select_indices(index)
        return _Carry(self.ids[index], self.attn[index], self.cache, self.updates)


class HFRollout(Rollout):
    """transformers generation in this process; `agenerate` goes through a batching thread.

    `update_adapter` (adapter-only sync) injects peft's LoRA layers into the model once per
    adapter name, around the unchanged linear layers, and afterwards only copies new A / B
    matrices in; each generation call activates the adapter its `SamplingParams.adapter`
    names (peft's named adapters; the others stay loaded and unused)."""

    supports_adapters = True

    def __init__(self, config: RolloutConfig) -> None:
        self.config = config
        settings = config.hf
        try:
            self.model = _auto_class(config.model_path).from_pretrained(
                config.model_path,
                dtype=config.torch_dtype,
                attn_implementation=settings.attn_implementation,
            )
        except (OSError, ValueError) as exc:
            raise RolloutError(
                f"hf rollout: could not load rollout.model_path={config.model_path!r}: {exc}"
            ) from exc
        self.device = torch.device(settings.device)
        self.model.to(self.device).eval()
        if self.device.type == "cpu" and settings.cpu_linear == "auto":
            use_fast_linears(self.model, prepack=settings.prepack_weights)
        gen_cfg = self.model.generation_config
        self.eos_token_ids = _as_id_list(gen_cfg.eos_token_id) or _as_id_list(
            self.model.config.eos_token_id
        )
        pad = (
            gen_cfg.pad_token_id
            if gen_cfg.pad_token_id is not None
            else self.model.config.pad_token_id
        )
        self.pad_token_id = (
            int(_as_id_list(pad)[0])
            if pad is not None
            else (self.eos_token_ids[0] if self.eos_token_ids else 0)
        )
        # generate() fills unset options from the model's generation_config (e.g. a shipped
        # top_p=0.8 or repetition_penalty); every option is set explicitly per call instead.
        self.model.generation_config = GenerationConfig()
        self.vocab_size = int(self.model.get_output_embeddings().weight.shape[0])
        # one generate segment / weight update at a time; reentrant so that `update_weights`
        # can run inside `paused()`, which holds it
        self._lock = threading.RLock()
        self._running = threading.Event()
        """Cleared by `paused()`: generation stops at the next token and waits."""
        self._running.set()
        self._updates = 0
        """Weight updates so far: a KV cache carried between segments is of one of them."""
        self.weight_version: int | None = None
        """Version of the weights held, set by the owner (partial rollout); when not None every
        generated token is tagged with it (`Sample.token_versions`)."""
        self._seeds = random.Random(config.seed)
        self._adapter_shapes: dict[str, tuple[int, float, tuple[str, ...]]] = {}
        """Rank, alpha and modules of each adapter `update_adapter` injected, by name."""
        self._lora_layers: list[Any] = []
        """peft's LoRA layers in the model (each holds every adapter name of its module)."""
        self._active: object = _UNSET
        """The adapter name the LoRA layers have active (None: none, the base weights)."""
        self._asleep = False
        self._batcher = RequestBatcher(
            self._run_request_batch,
            settings.max_batch_rows,
            settings.batch_wait_ms / 1000.0,
            name="tephra-hf-rollout-batcher",
        )
        self._closed = False
        self._routers = [
            m
            for name, m in self.model.named_modules()
            if name.endswith("mlp.gate") and type(m).__name__.endswith("TopKRouter")
        ]
        """The MoE top-k routers (transformers' Qwen2-MoE / Qwen3-MoE), in layer order."""
        if config.record_routes and not self._routers:
            raise RolloutError(
                f"hf rollout: routing replay needs a mixture-of-experts model with top-k "
                f"routers (Qwen2-MoE, Qwen3-MoE); {config.model_path!r} has none: set "
                "actor.moe.routing_replay=off"
            )

    # -- synchronous batch generation -------------------------------------------------------

    def generate(
        self,
        prompts: list[list[int]],
        sampling: SamplingParams,
        multimodal: list[MultimodalInputs | None] | None = None,
    ) -> RolloutOutput:
        """`multimodal[i]`: prompt i's images (a vision-language model), None for none."""
        check_prompts(prompts, sampling, self.config.max_model_len, self.vocab_size, multimodal)
        rows = [list(p) for p in prompts for _ in range(sampling.n)]
        mm_rows = [m for m in (multimodal or [None] * len(prompts)) for _ in range(sampling.n)]
        seed = sampling.seed if sampling.seed is not None else self._seeds.randrange(2**62)
        step = self.config.hf.max_batch_rows
        generations: list[Sample] = []
        for start in range(0, len(rows), step):
            end = min(start + step, len(rows))
            generations += self._generate_rows(
                rows[start:end],
                sampling,
                [sampling.max_tokens] * (end - start),
                [seed + r for r in range(start, end)],
                mm_rows[start:end],
            )
        if self.config.record_routes:
            routes = self.record_routes([row + g.response_ids for row, g in zip(rows, generations)])
            for g, r in zip(generations, routes):
                g.routed_experts = r
        return RolloutOutput.from_generations(list(prompts), generations, sampling.n)

    @torch.no_grad()
    def record_routes(self, rows: list[list[int]]) -> list[torch.Tensor]:
        """Each row's experts `[tokens, moe_layers, k]`, from one forward of the rollout's
        model over the row (prompt + response; same weights and dtype as generation).
        Incremental decoding with a KV cache computes the same routes up to rounding: a
        token whose top-k is a near tie could differ."""
        out: list[torch.Tensor] = []
        step = self.config.hf.max_batch_rows
        with self._lock:
            for start in range(0, len(rows), step):
                chunk = rows[start : start + step]
                width = max(len(r) for r in chunk)
                ids = torch.full((len(chunk), width), self.pad_token_id, dtype=torch.long)
                attn = torch.zeros((len(chunk), width), dtype=torch.long)
                for i, row in enumerate(chunk):
                    ids[i, width - len(row) :] = torch.tensor(row, dtype=torch.long)
                    attn[i, width - len(row) :] = 1
                pos = (attn.cumsum(-1) - 1).clamp(min=0)
                seen: list[torch.Tensor] = []
                hooks = [
                    r.register_forward_hook(lambda m, a, o, seen=seen: seen.append(o[2]))
                    for r in self._routers
                ]
                try:
                    self.model(
                        input_ids=ids.to(self.device),
                        attention_mask=attn.to(self.device),
                        position_ids=pos.to(self.device),
                    )
                finally:
                    for h in hooks:
                        h.remove()
                routes = torch.stack([s.reshape(len(chunk), width, -1) for s in seen], 2).cpu()
                out += [routes[i, width - len(row) :].clone() for i, row in enumerate(chunk)]
        return out

    def _stop_ids(self, sampling: SamplingParams) -> list[int]:
        stops = list(sampling.stop_token_ids)
        if not sampling.ignore_eos:
            stops += [t for t in self.eos_token_ids if t not in stops]
        return stops

    @torch.no_grad()
    def _generate_rows(
        self,
        rows: list[list[int]],
        sampling: SamplingParams,
        max_tokens: list[int],
        seeds: list[int],
        multimodal: list[MultimodalInputs | None] | None = None,
    ) -> list[Sample]:
        """Generate one sample per row; row r stops at its own `max_tokens[r]` and samples
        from a generator seeded `seeds[r]`.

        Decoding runs in segments. A segment ends when all rows finished, when
        `hf.drop_finished_fraction` of them finished (the rest continue from their KV cache
        in the next segment, without the finished rows), or when a weight update under
        `paused()` stopped it at the next token: the unfinished rows keep their tokens and
        log-probs and resume (prompt + tokens so far, the rest of their budget) under the new
        weights, from their generators' state where they stopped, so a given schedule of
        updates gives the same samples. Each token is tagged with the `weight_version` that produced
        it (when set)."""
        if self._asleep:
            raise RolloutError("hf rollout is asleep; call wake_up() before generating")
        adapter = adapter_of(sampling, self._adapter_shapes)
        stops = self._stop_ids(sampling)
        stop_set = torch.tensor(stops, dtype=torch.long)
        tokens: list[list[int]] = [[] for _ in rows]
        log_probs: list[list[float]] = [[] for _ in rows]
        versions: list[list[int]] = [[] for _ in rows]
        reasons: list[FinishReason | None] = [None] * len(rows)
        # CPU generators: the same draws whatever the model's device
        generators = [torch.Generator().manual_seed(seed & _SEED_MASK) for seed in seeds]
        active, carry = list(range(len(rows))), None
        while active:
            self._running.wait()
            with self._lock:
                if not self._running.is_set():  # an update took the lock first: wait for it
                    continue
                version = self.weight_version
                self._use_adapter(adapter)
                if carry is not None and carry.updates != self._updates:
                    carry = None  # new weights: the cache is stale, prefill again
                new, new_lp, carry = self._segment(
                    [rows[r] + tokens[r] for r in active],
                    sampling,
                    [max_tokens[r] - len(tokens[r]) for r in active],
                    [generators[r] for r in active],
                    [multimodal[r] for r in active] if multimodal else None,
                    carry,
                )
            for i, r in enumerate(active):
                budget = max_tokens[r] - len(tokens[r])
                hits = torch.isin(new[i], stop_set).nonzero() if stops else torch.empty(0)
                first_stop = int(hits[0]) + 1 if len(hits) else None
                if first_stop is not None and first_stop <= budget:
                    length, reasons[r] = first_stop, "stop"
                elif new.shape[1] >= budget:
                    length, reasons[r] = budget, "length"
                else:  # a weight update or the others finishing: continues in the next segment
                    length = new.shape[1]
                tokens[r] += new[i, :length].tolist()
                log_probs[r] += new_lp[i, :length].tolist()
                versions[r] += [version] * length if version is not None else []
            going = [i for i, r in enumerate(active) if reasons[r] is None]
            active = [active[i] for i in going]
            carry = carry.keep(going) if carry is not None and going else None
        return [
            Sample(
                response_ids=tokens[r],
                log_probs=log_probs[r] if sampling.logprobs else None,
                finish_reason=cast(str, reasons[r]),  # every row has stopped here
                # untagged when any segment ran without a version set
                token_versions=versions[r] if len(versions[r]) == len(tokens[r]) else None,
            )
            for r in range(len(rows))
        ]

    def _segment(
        self,
        rows: list[list[int]],
        sampling: SamplingParams,
        max_tokens: list[int],
        generators: list[torch.Generator],
        multimodal: list[MultimodalInputs | None] | None,
        carry: _Carry | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, _Carry | None]:
        """One `model.generate` over `rows` (left-padded; or, from `carry`, the ids, mask and
        KV cache a previous segment left them with) until every row stopped or reached its
        budget, enough rows finished to drop them, or `paused()` interrupted it; row r draws
        from `generators[r]`, which keep their state for the next segment. Returns the new
        tokens [rows, steps], their log-probs [rows, steps] and the carry to continue every
        row from (None for image rows, which always prefill again)."""
        if carry is None:
            width = max(len(r) for r in rows)
            ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
            attn = torch.zeros((len(rows), width), dtype=torch.long)
            for i, row in enumerate(rows):
                ids[i, width - len(row) :] = torch.tensor(row, dtype=torch.long)
                attn[i, width - len(row) :] = 1
            ids, attn = ids.to(self.device), attn.to(self.device)
        else:
            ids, attn = carry.ids, carry.attn
            width = ids.shape[1]
        # images (vision-language model): pixel inputs of the rows, in row order
        mm_kwargs = (
            vision_family(self.model.config).model_kwargs(ids.cpu(), multimodal, self.model.config)
            if (multimodal and any(m is not None for m in multimodal))
            else {}
        )
        stops = self._stop_ids(sampling)
        recorder = SampledLogProbRecorder(
            sampling.temperature, sampling.top_k, sampling.top_p, width, generators
        )
        gen_config = GenerationConfig(
            # greedy: the recorder samples (temperature/top-k/top-p) and leaves one token
            max_new_tokens=max(max_tokens),
            do_sample=False,
            num_beams=1,
            repetition_penalty=1.0,
            no_repeat_ngram_size=0,
            eos_token_id=stops or None,
            pad_token_id=self.pad_token_id,
            return_dict_in_generate=True,
            use_cache=True,
        )
        # image rows keep every row to the end: their mRoPE offsets live in the model's state
        fraction = 1.0 if mm_kwargs else self.config.hf.drop_finished_fraction
        criteria = [
            _StopWhenPaused(self._running),
            _StopToDropFinished(width, stops, max_tokens, fraction, self.device),
        ]
        # images enter with the prompt's forward, so image rows prefill in `generate`
        past = (
            carry.cache
            if carry is not None
            else (None if mm_kwargs else self._prefill_shared_prompts(ids, attn, rows))
        )
        if past is None and not mm_kwargs:
            past = growing_cache(self.model.config)
        out = self.model.generate(
            input_ids=ids,
            attention_mask=attn,
            past_key_values=past,
            generation_config=gen_config,
            logits_processor=LogitsProcessorList([recorder]),
            stopping_criteria=StoppingCriteriaList(criteria),
            **{k: v.to(self.device) for k, v in mm_kwargs.items()},
        )
        log_probs = recorder.finish(out.sequences).cpu()
        new = out.sequences[:, width:]
        carry = (
            None
            if mm_kwargs or out.past_key_values is None
            else _Carry(
                out.sequences,
                torch.cat([attn, torch.ones_like(new)], dim=1),
                out.past_key_values,
                self._updates,
            )
        )
        return new.cpu(), log_probs, carry

    def _prefill_shared_prompts(
        self, ids: torch.Tensor, attn: torch.Tensor, rows: list[list[int]]
    ) -> Any:
        """The KV cache of every prompt but its last token, computed once per run of equal
        consecutive rows (a prompt's n samples) and repeated for each row; `generate` then
        starts from it. Prefill is most of the compute of short responses and n rows of the
        same prompt would otherwise repeat it n times. None when no row repeats."""
        owner, distinct = [], []
        for r, row in enumerate(rows):
            if r == 0 or row != rows[r - 1]:
                distinct.append(r)
            owner.append(len(distinct) - 1)
        if len(distinct) == len(rows) or ids.shape[1] < 2:
            return None
        first = torch.tensor(distinct, device=ids.device)
        u_ids, u_attn = ids[first, :-1], attn[first, :-1]
        # the position ids `generate` gives left-padded rows (pads at 1; never attended to)
        positions = (u_attn.cumsum(-1) - 1).masked_fill(u_attn == 0, 1)
        cache = growing_cache(self.model.config)
        self.model(
            input_ids=u_ids,
            attention_mask=u_attn,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        cache.batch_select_indices(torch.tensor(owner, device=ids.device))
        return cache

    # -- async single requests ----------------------------------------------------------------

    async def agenerate(
        self,
        prompt_ids: list[int],
        sampling: SamplingParams,
        session_id: str | None = None,
        multimodal: MultimodalInputs | None = None,
    ) -> Sample:
        """One request; concurrent requests with the same temperature/top-k/top-p/stop ids
        share one batched `generate` (each keeps its own max_tokens and samples from its own
        generator, seeded by its `seed`, so a seeded request gives the same sample whatever
        batch it joins). `session_id` is accepted for
        the contract; there is only one in-process model. `multimodal`: the prompt's images
        (checked against its image tokens; requests with and without images share a batch)."""
        if sampling.n != 1:
            raise RolloutError(
                f"agenerate serves one sample; got sampling.n={sampling.n} (send n requests)"
            )
        check_prompts([prompt_ids], sampling, self.config.max_model_len, self.vocab_size)
        adapter_of(sampling, self._adapter_shapes)  # an unknown name fails here, alone
        if multimodal is not None:
            check_image_tokens(
                list(prompt_ids),
                multimodal,
                self.model.config,
                f"agenerate (session {session_id})",
            )
        key = (
            sampling.temperature,
            sampling.top_k,
            sampling.top_p,
            sampling.stop_token_ids,
            sampling.ignore_eos,
            sampling.logprobs,
            sampling.adapter,  # one batch runs through one adapter
        )
        return cast(
            Sample, await self._batcher.submit((list(prompt_ids), sampling, multimodal), key)
        )

    def _run_request_batch(
        self, payloads: list[tuple[list[int], SamplingParams, MultimodalInputs | None]]
    ) -> list[Sample]:
        first = payloads[0][1]
        seeds = [
            s.seed if s.seed is not None else self._seeds.randrange(2**62) for _, s, _ in payloads
        ]
        rows = [p for p, _, _ in payloads]
        max_tokens = [s.max_tokens for _, s, _ in payloads]
        images = [m for _, _, m in payloads]
        out: list[Sample] = []
        step = self.config.hf.max_batch_rows
        for start in range(0, len(rows), step):
            out += self._generate_rows(
                rows[start : start + step],
                first,
                max_tokens[start : start + step],
                seeds[start : start + step],
                images[start : start + step],
            )
        return out

    @property
    def batches_run(self) -> int:
        """Batched generate calls made for `agenerate` requests so far."""
        return self._batcher.batches_run

    # -- weights and memory -------------------------------------------------------------------

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Hold generation for a weight update (partial rollout): in-flight `generate` /
        `agenerate` calls stop at the next token boundary, keeping their tokens and log-probs,
        and wait; on exit they resume under the weights (and `weight_version`) set inside."""
        self._running.clear()
        try:
            with self._lock:  # the in-flight segment has returned once this is held
                yield
        finally:
            self._running.set()

    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy each (HF name, tensor) into the model in place. A tied model holds one matrix
        for the embedding and the head, so either name updates both. With an adapter served
        (`update_adapter`), the names of adapted layers set the base weights under it."""
        with self._lock:
            self._updates += 1  # even a failed update may have changed some weights
            state = self.model.state_dict()
            for name, tensor in named_tensors:
                if name not in state and self._adapter_shapes:
                    name = _base_layer_name(name)
                if name not in state:
                    known = ", ".join(list(state)[:6])
                    raise RolloutError(
                        f"update_weights: {name!r} is not a weight of the rollout model "
                        f"({type(self.model).__name__}; names look like {known}, ...); export "
                        "weights with Hugging Face names"
                    )
                target = state[name]
                if tuple(target.shape) != tuple(tensor.shape):
                    raise RolloutError(
                        f"update_weights: {name!r} has shape {list(tensor.shape)}, the rollout "
                        f"model expects {list(target.shape)}"
                    )
                target.copy_(tensor.detach().to(device=target.device, dtype=target.dtype))

    @torch.no_grad()
    def update_adapter(self, adapter: LoraAdapter, name: str = DEFAULT_ADAPTER) -> None:
        """Serve `adapter` over the unchanged base weights as adapter `name`: peft's LoRA
        layers wrap the adapted linear layers (the name injected on its first call), whose
        output becomes W x + (alpha / rank) * B (A x) while `name` is active; each call
        copies the new A and B in. A later adapter of a name must have the first one's rank,
        alpha and modules; other names may differ."""
        shape = (adapter.rank, adapter.alpha, tuple(adapter.modules))
        check_adapter_slot(self._adapter_shapes, name, self.config.max_loras)
        with self._lock:
            self._updates += 1  # the KV cache of the old adapter is stale
            if name not in self._adapter_shapes:
                self._inject(adapter, name)
                self._adapter_shapes[name] = shape
            elif shape != self._adapter_shapes[name]:
                rank, alpha, modules = self._adapter_shapes[name]
                raise RolloutError(
                    f"update_adapter: adapter {name!r} changed shape (rank {adapter.rank}, "
                    f"alpha {adapter.alpha}, {len(adapter.modules)} modules; the rollout serves "
                    f"rank {rank}, alpha {alpha}, {len(modules)} modules); one run trains one "
                    "adapter: load another shape under another name"
                )
            params = dict(self.model.named_parameters())
            for peft_name, tensor in adapter.tensors.items():
                target = params[_rollout_adapter_name(peft_name, name)]
                if tuple(target.shape) != tuple(tensor.shape):
                    raise RolloutError(
                        f"update_adapter: {peft_name!r} has shape {list(tensor.shape)}, the "
                        f"rollout model's layer expects {list(target.shape)}"
                    )
                target.copy_(tensor.detach().to(device=target.device, dtype=target.dtype))

    @property
    def adapters(self) -> list[str]:
        """The names of the LoRA adapters loaded (`update_adapter`), sorted."""
        return sorted(self._adapter_shapes)

    def _use_adapter(self, name: str | None) -> None:
        """Make adapter `name` the one the LoRA layers apply (None: none, the base weights);
        called under the lock before each decoding segment, so calls through different
        adapters can alternate."""
        if name == self._active:
            return
        for layer in self._lora_layers:
            # a layer without `name` (another adapter's module) then adds nothing
            layer.set_adapter([name] if name is not None else [], inference_mode=True)
        self._active = name

    def _inject(self, adapter: LoraAdapter, name: str) -> None:
        """peft's LoRA layers (adapter `name`) around exactly the adapter's modules; layers
        that already hold other adapters get this one beside them."""
        try:
            # imported here: only adapter syncs need peft (the `lora` extra)
            from peft import LoraConfig, inject_adapter_in_model
            from peft.tuners.tuners_utils import BaseTunerLayer
        except ImportError as exc:
            raise RolloutError(
                "update_adapter needs peft: install tephra-rollout[lora], or set "
                "actor.lora_sync=merged"
            ) from exc
        names = set(dict(self.model.named_modules()))
        missing = [m for m in adapter.modules if m not in names]
        if missing:
            raise RolloutError(
                f"update_adapter: {missing[:3]} are not modules of the rollout model "
                f"({type(self.model).__name__}); the adapter was trained on another model"
            )
        config = LoraConfig(
            r=adapter.rank,
            lora_alpha=adapter.alpha,  # type: ignore[arg-type]  # peft types it int; floats work
            lora_dropout=0.0,
            # full names: a suffix such as `q_proj` could also match a frozen vision tower
            target_modules=adapter.modules,
        )
        with warnings.catch_warnings():
            # peft warns that a second adapter joins the first: that is the point here
            warnings.filterwarnings("ignore", message="Already found a `peft_config`")
            inject_adapter_in_model(config, self.model, adapter_name=name)
        self.model.eval()
        self._lora_layers = [m for m in self.model.modules() if isinstance(m, BaseTunerLayer)]
        self._active = _UNSET  # peft may have made the new adapter active in some layers
        injected = {
            n
            for n, _ in self.model.named_parameters()
            if ".lora_" in n and n.endswith(f".{name}.weight")
        }
        expected = {_rollout_adapter_name(n, name) for n in adapter.tensors}
        if injected != expected:
            raise RolloutError(
                f"update_adapter: peft made {len(injected)} adapter matrices, the adapter "
                f"holds {len(expected)} (e.g. {sorted(injected ^ expected)[:2]})"
            )

    def sleep(self) -> None:
        """On a GPU, move the weights to CPU memory; on CPU there is nothing to free."""
        if self.device.type == "cuda" and not self._asleep:
            with self._lock:
                self.model.to("cpu")
                torch.cuda.empty_cache()
        self._asleep = self.device.type == "cuda"

    def wake_up(self) -> None:
        if self._asleep:
            with self._lock:
                self.model.to(self.device)
        self._asleep = False

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._batcher.close()


def _rollout_adapter_name(peft_name: str, adapter: str) -> str:
    """`base_model.model.<module>.lora_A.weight` (peft's file) -> the injected parameter's
    name in the rollout model, `<module>.lora_A.<adapter>.weight`."""
    stem, kind = peft_name[len(PEFT_PREFIX) :].rsplit(".lora_", 1)
    return f"{stem}.lora_{kind.split('.')[0]}.{adapter}.weight"


def _base_layer_name(name: str) -> str:
    """`<module>.weight` -> `<module>.base_layer.weight`: where peft keeps the base weight of
    a layer it wrapped."""
    stem, leaf = name.rsplit(".", 1)
    return f"{stem}.base_layer.{leaf}"
