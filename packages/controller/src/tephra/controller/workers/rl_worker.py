"""The colocated RL worker: actor, reference, critic and rollout engine in one process per rank.

Weights move inside the process: `sync_weights` streams `actor.export_weights()` buckets into
`rollout.update_weights()`, or with LoRA hands `actor.export_adapter_weights()` to
`rollout.update_adapter()` (adapter-only sync, `actor.lora_sync`). Every public method is
declared with a dispatch mode, so the driver calls `wg.compute_log_probs(batch)` on the whole
batch and gets the whole batch back: rows are split over data-parallel ranks and replicated over a rank's tensor / pipeline /
context peers (`dp_info`, from the actor engine).

Generation has a data parallelism of its own (`rollout_info`): rollout DP = world size /
the rollout's tensor-parallel size (1 for `hf`, `rollout.<backend>.tensor_parallel_size` for
a server). Rank r holds a rollout engine when r is a multiple of that size, and each such
rank generates a disjoint share of the prompts (`Dispatch.ROLLOUT_SPLIT`), the trainer's
model-parallel peers included; the driver gathers the samples and dispatches the training
batch by `dp_info`. Sample seeds follow the prompt's place in the whole batch, so the split
does not change the samples.

Generation is a part the worker holds (`tephra.controller.workers.generation.Generator`: rollout engine,
tokenizer, tools, scorer),
the same part a rollout replica of its own pool holds (`rollout_replicas.RolloutWorker`); the
worker adds the dispatch modes, profiling and the weight sync around it.

Rewards are scored by that part, on each rank's own samples, in a background thread started right
after generation: the log-prob passes that follow run while the scorer works (`collect_scores`
waits for it), as in verl's "reward computed while log-probs run". With a reward pool
(`resources.reward`) that thread hands the samples to a rank of the pool, an `RLWorker` holding
the role `reward`: its scorer (reward model, judge) and PRIME's reward model live there only.
"""

from __future__ import annotations

import contextlib
import functools
import math
import random
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar

import ray
import torch
import torch.distributed as dist
from tensordict import TensorDict
from torch.profiler import ProfilerActivity, profile, record_function

from tephra.algos import ActorObjective, CriticObjective
from tephra.controller.cluster.dispatch import Dispatch, dispatch
from tephra.controller.cluster.worker_group import DataParallelInfo, Worker
from tephra.controller.config.tree import PPOConfig
from tephra.controller.recipes import enabled_recipes
from tephra.controller.run.flops import device_peak
from tephra.controller.run.memory_metrics import process_memory
from tephra.controller.run.models import resolve_model_path
from tephra.controller.samples import Prompt, RewardResult, Sample, Scores
from tephra.controller.step.skip_flat import can_skip_flat, skip_zero_advantage_rows
from tephra.controller.workers.colocated_server import colocated_server
from tephra.controller.workers.generation import Generator
from tephra.engine_api.engine import Engine
from tephra.engine_api.fastest_dtype import resolve_dtype
from tephra.engine_api.loss import LossFn
from tephra.engine_api.registry import get_engine
from tephra.episodes.rewards import RewardInput
from tephra.rollout.backends.server_process import free_port
from tephra.rollout.backends.vllm_plugin.tephra_weight_transport import open_group, send_all
from tephra.rollout.base import ServerSettings

if TYPE_CHECKING:  # a type alias the module defines for the type checker only
    from tephra.rollout.backends.vllm_plugin.tephra_weight_transport import TransferGroup

P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")


@contextlib.contextmanager
def stage_range(stage: str) -> Iterator[None]:
    """Name a profiled stage `tephra/<stage>`: a range in torch.profiler's trace (a
    `user_annotation` event around the stage's operators) and, where CUDA is present, an NVTX
    range, so Nsight Systems (`nsys profile`) shows the stages on its timeline."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(record_function(f"tephra/{stage}"))
        if torch.cuda.is_available():
            stack.enter_context(torch.cuda.nvtx.range(f"tephra/{stage}"))
        yield


def profiled(
    stage: str,
) -> Callable[[Callable[Concatenate[RLWorker, P], R]], Callable[Concatenate[RLWorker, P], R]]:
    """Run a worker method under torch.profiler when the driver turned profiling on for this
    step (`RLWorker.set_profile`), writing one Chrome trace per stage and rank."""

    def wrap(fn: Callable[Concatenate[RLWorker, P], R]) -> Callable[Concatenate[RLWorker, P], R]:
        @functools.wraps(fn)
        def run(self: RLWorker, /, *args: P.args, **kwargs: P.kwargs) -> R:
            if self._profile_prefix is None:
                return fn(self, *args, **kwargs)
            activities = [ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(ProfilerActivity.CUDA)
            with profile(activities=activities, record_shapes=False) as prof, stage_range(stage):
                out = fn(self, *args, **kwargs)
            prof.export_chrome_trace(f"{self._profile_prefix}_{stage}_rank{self.rank}.json")
            return out

        return run

    return wrap


def _on_policy_old_log_probs(loss_fn: LossFn) -> LossFn:
    """With one mini-batch and one epoch the sampling policy is the current one, so the
    old log-probs are the current log-probs without their graph; this skips a forward pass."""

    def wrapped(outputs: TensorDict, batch: TensorDict) -> tuple[torch.Tensor, dict[str, float]]:
        if "old_log_probs" not in batch.keys():
            batch["old_log_probs"] = outputs["log_probs"].detach()
        return loss_fn(outputs, batch)

    return wrapped


def _held(part: T | None, role: str) -> T:
    """`part` (an engine, a loss) of `role`, which the stage called needs: a worker group
    that does not hold `role` was sent another role's stage."""
    if part is None:
        raise RuntimeError(f"this worker group holds no {role}: the stage is another role's")
    return part


ROLES = ("actor", "ref", "critic")


def colocated_roles(cfg: PPOConfig) -> tuple[str, ...]:
    """The roles the actor's worker group holds: the actor, and the reference and critic
    unless they have pools of their own (`resources.ref` / `resources.critic`)."""
    return ("actor",) + tuple(r for r in ("ref", "critic") if getattr(cfg.resources, r).ranks == 0)


class RLWorker(Worker):
    _ahead: Future[list[Sample]] | None
    """The generation ahead in flight (`generate_ahead`), set on its first use."""
    _ahead_pool: ThreadPoolExecutor | None

    def __init__(
        self,
        rank: int,
        world_size: int,
        *worker_args: Any,
        cfg: PPOConfig,
        model_path: str,
        tools_file: str | None = None,
        roles: tuple[str, ...] = ROLES,
        reward_actors: list | None = None,
    ) -> None:
        """`roles`: the engines this group holds (the actor's group also generates; a
        reference, critic or reward pool of its own holds that role alone). `reward_actors`:
        the reward pool's ranks (`resources.reward`); this rank's samples go to rank
        `rank % len(reward_actors)` of it to be scored."""
        super().__init__(rank, world_size, *worker_args)
        built = time.perf_counter()
        self.cfg, self.roles = cfg, tuple(roles)
        seed = cfg.trainer.seed
        torch.manual_seed(seed + rank)
        random.seed(seed + rank)
        device = getattr(self, "device", "cpu")
        self.colocated = cfg.resources.rollout.replicas == 0 and "actor" in self.roles
        """Whether this group generates (else rollout replicas of their own do, or this is a
        reference / critic pool)."""
        self.generation = Generator.build(
            cfg,
            model_path,
            tools_file,
            device,
            with_rollout=self.colocated and self.rollout_info().is_output_rank,
            reward_actor=reward_actors[rank % len(reward_actors)] if reward_actors else None,
            server=self._placed_server(model_path),
        )
        self._profile_prefix: str | None = None
        self.samples_scored = 0
        """Samples scored for other ranks (`score_inputs`: a rank of the reward pool)."""
        model = replace(cfg.model, path=model_path, init_seed=seed)
        temperature = cfg.rollout.temperature if cfg.rollout.temperature > 0 else 1.0
        self.actor: Engine | None = None
        if "actor" in self.roles:
            self.actor = get_engine(
                cfg.actor.engine,
                cfg.actor.engine_config(
                    model, "policy", temperature, seed, device=_engine_device(device)
                ),
            )
        self.ref: Engine | None = None
        if "ref" in self.roles and cfg.needs_reference and not cfg.actor.lora.enabled:
            self.ref = get_engine(
                cfg.actor.engine,
                cfg.actor.engine_config(
                    model, "policy", temperature, seed, device=_engine_device(device)
                ),
            )
        self.recipes = enabled_recipes(cfg)
        self.role_engines: dict[str, Engine] = {}
        """The recipes' engines by role name (`EngineRole`: the distillation teacher, PRIME's
        reward model, SPIN's opponent), built where their pool is this group's."""
        self.role_losses: dict[str, LossFn] = {}
        self.role_checkpoints: dict[str, str] = {}
        for role in (role for recipe in self.recipes for role in recipe.roles()):
            if role.pool not in self.roles:
                continue
            path = resolve_model_path(role.model_path, seed) if role.model_path else model_path
            self.role_engines[role.name] = get_engine(
                cfg.actor.engine,
                cfg.actor.engine_config(
                    replace(model, path=path),
                    "policy",
                    temperature,
                    seed,
                    device=_engine_device(device),
                ),
            )
            if role.loss is not None:
                self.role_losses[role.name] = role.loss()
            if role.checkpoint is not None:
                self.role_checkpoints[role.name] = role.checkpoint
        self.critic: Engine | None = None
        if "critic" in self.roles and cfg.algorithm.needs("values"):
            self.critic = get_engine(
                cfg.critic.engine,
                cfg.critic.engine_config(
                    model, "value", temperature, seed, device=_engine_device(device)
                ),
            )
        self.actor_loss = ActorObjective(cfg.actor.objective)
        self.critic_loss = CriticObjective(cfg.critic.objective) if self.critic else None
        self.recipe_actor_loss = next(
            (loss for loss in (r.actor_loss() for r in self.recipes) if loss is not None), None
        )
        """A recipe's actor loss instead of `actor.objective`'s (SPIN's pair loss)."""
        self._weights_group: TransferGroup | None = None
        # The rollout engine loaded the checkpoint from disk, but the engine may have
        # changed it (a value head, untied embeddings, LoRA); one sync makes them equal.
        # (Separate rollout replicas get the same first sync from the driver.)
        if self.colocated:
            self.sync_weights()
        self.startup["build_s"] = round(time.perf_counter() - built, 2)

    def _placed_server(self, model_path: str) -> ServerSettings | None:
        """The settings of a server this group starts on its GPUs (colocated): its GPUs and
        its automatic memory, sleep and graph settings, settled on every rank before any
        server starts, the choice printed once (rank 0); None elsewhere (the config's)."""
        settings = self.cfg.rollout.server
        device = getattr(self, "device", "cpu")
        if not (self.colocated and device.startswith("cuda")) or settings is None or settings.url:
            return None
        placed = colocated_server(self.cfg, self.rank, self.world_size, device, model_path)
        if placed is None:
            return None
        if placed.note is not None and self.rank == 0:
            print(placed.note, flush=True)
        return placed.settings

    def dp_info(self) -> DataParallelInfo:
        """Data-parallel coordinates from the group's first engine (the actor, else the
        reference or critic of a pool of its own): rows go to data-parallel ranks, tensor /
        pipeline / context peers get the same rows; one peer returns them."""
        engines = (self.actor, self.ref, *self.role_engines.values(), self.critic)
        engine = next((e for e in engines if e is not None), None)
        if engine is None:  # a reward pool that only scores: one share per rank
            return super().dp_info()
        return DataParallelInfo(
            dp_rank=engine.dp_rank,
            dp_size=engine.dp_size,
            is_output_rank=engine.is_dp_output_rank,
        )

    def rollout_info(self) -> DataParallelInfo:
        """Generation's data-parallel coordinates: one rollout replica per
        `rollout.tensor_parallel_size` consecutive ranks, held by the first of them (with
        rollout replicas of their own, this group generates nothing: one share per rank)."""
        tp = self.cfg.rollout.tensor_parallel_size if self.colocated else 1
        return DataParallelInfo(
            dp_rank=self.rank // tp,
            dp_size=self.world_size // tp,
            is_output_rank=self.rank % tp == 0,
        )

    @property
    def rollout(self) -> Any:
        """The rollout engine of the generation part (None on a rank that does not generate)."""
        return self.generation.rollout

    # ----- generation and scoring (the generation part's, with this worker's dispatch) -------
    @dispatch(Dispatch.ROLLOUT_SPLIT)
    @profiled("generate")
    def generate(self, items: list[Prompt], sampling: Any, score: bool = True) -> list[Sample]:
        """`Generator.generate` on this rank's share of the prompts, after sending the weights
        again where a sleeping server dropped them."""
        self._resend_dropped_weights()
        return self.generation.generate(items, sampling, score)

    @dispatch(Dispatch.ROLLOUT_SPLIT)
    def collect_scores(self) -> Scores:
        """`Generator.collect_scores` of this rank's last `generate`."""
        return self.generation.collect_scores()

    def score_inputs(self, inputs: list[RewardInput]) -> list[RewardResult]:
        """`Generator.score_inputs` with this rank's scorer: a generating rank's samples, sent
        by its scoring thread to this rank of the reward pool (`resources.reward`)."""
        self.samples_scored += len(inputs)
        return self.generation.score_inputs(inputs)

    @dispatch(Dispatch.BROADCAST)
    def scored_count(self) -> int:
        """Samples this rank of the reward pool scored over the run (`score_inputs`)."""
        return self.samples_scored

    # ----- generation ahead (trainer.mode=one_step_off) -----------------------------------
    @dispatch(Dispatch.ROLLOUT_SPLIT)
    def generate_ahead(self, items: list[Prompt], sampling: Any) -> None:
        """Start `generate(items, sampling)` in a background thread and return at once, so the
        rollout engine samples the next step's batch while this step's passes and update run
        on the training engines (separate weights; the driver takes `generated()` before
        `sync_weights`). One at a time."""
        if getattr(self, "_ahead", None) is not None:
            raise RuntimeError("generate_ahead called while a generation ahead is in flight")
        pool = getattr(self, "_ahead_pool", None)
        if pool is None:
            pool = self._ahead_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ahead")
        self._resend_dropped_weights()  # here, before the update that runs beside the thread
        self._ahead = pool.submit(self.generate, items, sampling)

    def _resend_dropped_weights(self) -> None:
        """A server at sleep_level=2 that slept since the last sync (after a validation
        generation, a dynamic-sampling round) dropped its weights: send the actor's again,
        which are the ones last synced (every update is followed by a sync before the
        next generation starts). Ranks without a rollout engine have nothing to resend (the
        config refuses sleep_level=2 where such ranks exist: they would miss the export's
        collectives)."""
        if self.rollout is not None and self.rollout.weights_dropped:
            self.sync_weights()

    @dispatch(Dispatch.ROLLOUT_SPLIT)
    def generated(self) -> list[Sample]:
        """The samples of the last `generate_ahead` (waits for it; scoring runs as after
        `generate`)."""
        ahead, self._ahead = getattr(self, "_ahead", None), None
        if ahead is None:
            raise RuntimeError("generated called without a generate_ahead before it")
        return ahead.result()

    # ----- forward passes --------------------------------------------------------------
    @dispatch(Dispatch.DP_SPLIT)
    @profiled("old_log_probs")
    def compute_log_probs(self, batch: TensorDict, sum_pi_squared: bool = False) -> TensorDict:
        """The actor's `log_probs` (and `entropy`), plus `sum_pi_squared` when asked (the
        optimal-token-baseline estimators' input, from the same forward pass)."""
        extra = ("sum_pi_squared",) if sum_pi_squared else ()
        actor = _held(self.actor, "actor")
        with actor.eval_mode():
            out = actor.forward(batch, extra_outputs=extra)
        keys = ("log_probs", "entropy", *extra)
        return out.select(*[k for k in keys if k in out.keys()])

    @dispatch(Dispatch.DP_SPLIT)
    @profiled("ref")
    def compute_ref_log_probs(self, batch: TensorDict) -> TensorDict:
        if self.ref is not None:
            with self.ref.eval_mode():
                out = self.ref.forward(batch)
        else:  # LoRA: the base weights with the adapters disabled are the reference
            actor = _held(self.actor, "actor")
            with actor.eval_mode(), actor.reference_mode():
                out = actor.forward(batch)
        return out.select("log_probs")

    @dispatch(Dispatch.DP_SPLIT)
    @profiled("role_log_probs")
    def compute_role_log_probs(self, batch: TensorDict, name: str) -> TensorDict:
        """The log-probs of the sampled response tokens by a recipe's engine `name`."""
        engine = self.role_engines[name]
        with engine.eval_mode():
            out = engine.forward(batch)
        return out.select("log_probs")

    @dispatch(Dispatch.DP_SPLIT)
    @profiled("role_update")
    def update_role(self, batch: TensorDict, name: str) -> dict[str, float]:
        """Train a recipe's engine `name` on its loss (`EngineRole.loss`), mini-batches x
        epochs as the actor."""
        return self._train(self.role_engines[name], self.role_losses[name], batch)

    @dispatch(Dispatch.DP_SPLIT)
    @profiled("values")
    def compute_values(self, batch: TensorDict) -> TensorDict:
        critic = _held(self.critic, "critic")
        with critic.eval_mode():
            out = critic.forward(batch)
        return out.select("values")

    # ----- updates ---------------------------------------------------------------------
    def _train(
        self, engine: Engine, loss_fn: LossFn, batch: TensorDict, skip_flat: bool = False
    ) -> dict[str, float]:
        n = batch.batch_size[0]
        mb = self.cfg.batch.mini_batches
        size = n // mb
        totals: dict[str, float] = {}
        count = 0
        with engine.train_mode():
            for _ in range(self.cfg.batch.epochs):
                for i in range(mb):
                    part = batch[i * size : (i + 1) * size]
                    if skip_flat:
                        part, left_out = skip_zero_advantage_rows(part)
                    metrics = dict(engine.forward_backward(part, loss_fn))
                    if skip_flat:
                        metrics["actor/skipped_rows"] = self._replica_sum(left_out)
                    metrics["grad_norm"] = float(engine.optimizer_step())
                    # a non-finite norm means the engine skipped the update: count it
                    metrics["skipped_update_frac"] = float(not math.isfinite(metrics["grad_norm"]))
                    metrics["lr"] = float(engine.lr_scheduler_step())
                    for k, v in metrics.items():
                        totals[k] = totals.get(k, 0.0) + float(v)
                    count += 1
        return {k: v / count for k, v in totals.items()}

    @dispatch(Dispatch.DP_SPLIT)
    @profiled("actor")
    def update_actor(self, batch: TensorDict) -> dict[str, float]:
        actor = _held(self.actor, "actor")
        if self.recipe_actor_loss is not None:  # e.g. SPIN's pairs: no advantages to skip on
            return self._train(actor, self.recipe_actor_loss, batch)
        loss: LossFn = self.actor_loss
        if self.cfg.batch.mini_batches == 1 and self.cfg.batch.epochs == 1:
            loss = _on_policy_old_log_probs(loss)
        return self._train(actor, loss, batch, skip_flat=can_skip_flat(self.cfg.actor.objective))

    def _replica_sum(self, value: float) -> float:
        """`value` summed over the data-parallel replicas (a collective of every rank; the
        model-parallel peers of a replica hold the same rows, so they count once)."""
        if self.world_size == 1:
            return value
        total = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(total)
        return float(total) * self.dp_info().dp_size / self.world_size

    @dispatch(Dispatch.DP_SPLIT)
    @profiled("critic")
    def update_critic(self, batch: TensorDict) -> dict[str, float]:
        return self._train(_held(self.critic, "critic"), _held(self.critic_loss, "critic"), batch)

    @dispatch(Dispatch.BROADCAST)
    def refresh_role(self, name: str, folder: str) -> None:
        """A recipe's engine `name` becomes a copy of the actor (SPIN's next iteration: the
        opponent is the model trained so far), through a checkpoint in `folder` (the engine
        contract's one way in; every rank writes and reads its shard)."""
        _held(self.actor, "actor").save_checkpoint(Path(folder))
        self.role_engines[name].load_checkpoint(Path(folder))

    # ----- weights and state -----------------------------------------------------------
    @dispatch(Dispatch.BROADCAST)
    @profiled("sync")
    def sync_weights(self) -> int:
        """Stream the actor's weights into the rollout engine as one update (a server backend
        re-buckets them by its own bucket size and counts one weight version), or with
        `actor.lora_sync` resolved to adapter-only, hand it the LoRA adapter alone; returns
        the tensors moved (0 without a colocated rollout: the driver broadcasts to replicas).
        A rank without a rollout engine of its own still exports: the export may be a
        collective of the training ranks."""
        if not self.colocated:
            return 0
        actor = _held(self.actor, "actor")  # a colocated group is the actor's
        if self.cfg.adapter_sync:
            # adapter-only (`actor.lora_sync`): the rollout keeps the base weights it loaded
            # (the engine's frozen ones) and serves the adapter over them
            with actor.eval_mode():
                adapter = actor.export_adapter_weights()  # collective: every rank
            if self.rollout is not None:
                self.rollout.update_adapter(adapter)
            return len(adapter.tensors) if self.rollout is not None else 0
        if self.rollout is None:
            with actor.eval_mode():
                for _ in actor.export_weights(untie_word_embeddings=True):
                    pass
            return 0
        moved = 0

        def tensors() -> Iterator[tuple[str, torch.Tensor]]:
            nonlocal moved
            for bucket in actor.export_weights(untie_word_embeddings=True):
                moved += len(bucket)
                yield from bucket

        # no wake_up() first: a sleeping server wakes its weights, loads, then wakes its KV
        # cache (update_weights), so the cache is not allocated beside the buckets
        with actor.eval_mode():
            self.rollout.update_weights(tensors())
        return moved

    # ----- weights to separate rollout replicas (resources.rollout.replicas > 0) ------------
    @dispatch(Dispatch.RANK_ZERO)
    def weight_group_address(self) -> tuple[str, int]:
        """Where rank 0 hosts the weight-broadcast group: its node's address and a free port."""
        return ray.util.get_node_ip_address(), free_port("0.0.0.0")

    def open_weight_group(
        self, address: str, port: int, world_size: int, backend: str, timeout_s: float
    ) -> None:
        """Rank 0 hosts a private group with the rollout replicas (ranks 1..); others skip."""
        if self.rank == 0:
            self._weights_group = open_group(address, port, 0, world_size, backend, timeout_s)

    def send_weights(self, bucket_mb: float) -> int:
        """Every rank exports (the export may be a collective); rank 0 broadcasts the buckets
        to the replicas, then an end marker. Returns the bytes sent."""
        actor = _held(self.actor, "actor")
        with actor.eval_mode():
            named = (
                pair
                for bucket in actor.export_weights(untie_word_embeddings=True)
                for pair in bucket
            )
            if self.rank != 0:
                for _ in named:  # take part in the export's collectives
                    pass
                return 0
            assert self._weights_group is not None, "open_weight_group comes first"
            device = torch.device(self.device) if self.device.startswith("cuda") else None
            dtype = getattr(torch, resolve_dtype(self.cfg.rollout.dtype, self.device))
            return send_all(self._weights_group, named, dtype, int(bucket_mb * 2**20), device)

    @dispatch(Dispatch.BROADCAST)
    def set_profile(self, prefix: str | None) -> None:
        """Profile the following stage calls into `<prefix>_<stage>_rank<R>.json` (None: off)."""
        if prefix is not None:
            Path(prefix).parent.mkdir(parents=True, exist_ok=True)
        self._profile_prefix = prefix

    @dispatch(Dispatch.BROADCAST)
    def memory_stats(self) -> dict[str, float]:
        """This rank's memory (`memory_metrics.process_memory`): RSS, CUDA peaks."""
        return process_memory()

    @dispatch(Dispatch.BROADCAST)
    def peak_flops(self) -> tuple[float, bool]:
        """This rank's peak FLOP/s in the actor's compute dtype, and whether it is the device's
        published figure (else the best matmul rate measured on this machine)."""
        return device_peak(getattr(self, "device", "cpu"), self.cfg.actor.precision.param_dtype)

    @dispatch(Dispatch.BROADCAST)
    def save_checkpoint(self, folder: str) -> None:
        path = Path(folder)
        if self.actor is not None:
            self.actor.save_checkpoint(path / "actor")
        if self.critic is not None:
            self.critic.save_checkpoint(path / "critic")
        for name, sub in self.role_checkpoints.items():  # a trained or refreshed role engine
            self.role_engines[name].save_checkpoint(path / sub)
        torch.save(
            {"torch": torch.get_rng_state(), "python": random.getstate()}, path / self._rng_file()
        )

    def _rng_file(self) -> str:
        # a reference / critic pool's ranks are numbered from 0 too
        role = "" if "actor" in self.roles else "_".join(self.roles) + "_"
        return f"worker_rng_{role}rank{self.rank}.pt"

    @dispatch(Dispatch.BROADCAST)
    def load_checkpoint(self, folder: str) -> None:
        path = Path(folder)
        if self.actor is not None:
            self.actor.load_checkpoint(path / "actor")
        if self.critic is not None:
            self.critic.load_checkpoint(path / "critic")
        for name, sub in self.role_checkpoints.items():
            self.role_engines[name].load_checkpoint(path / sub)
        state = torch.load(path / self._rng_file(), weights_only=False)
        torch.set_rng_state(state["torch"])
        random.setstate(state["python"])
        self.sync_weights()

    @dispatch(Dispatch.RANK_ZERO)
    def export_hf(self, folder: str) -> str:
        _held(self.actor, "actor").export_hf(folder)
        return folder

    @dispatch(Dispatch.RANK_ZERO)
    def close(self) -> None:
        """Stop the generation part (`Generator.close`); runs on every rank."""
        self.generation.close()


def _engine_device(device: str) -> str:
    return "cuda" if device.startswith("cuda") else "cpu"
