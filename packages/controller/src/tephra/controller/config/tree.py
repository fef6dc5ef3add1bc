"""The RL trainer's configuration: one typed tree composed of the packages' own configs.

    model       tephra.engine_api.ModelConfig          the policy (and critic) checkpoint
    actor       ActorConfig   = engine name + the engine's optimizer, scheduler, micro_batch,
                precision, offload, lora, parallel sections + tephra.algos.ActorObjectiveConfig
    critic      CriticConfig  = the same with tephra.algos.CriticObjectiveConfig
    rollout     tephra.episodes.config.EpisodeRolloutConfig: tephra.rollout.config.RolloutSection
                (backend, sampling, HFSettings / ServerSettings) + the agent loop
    algorithm   tephra.algos.algorithm_config.AlgorithmConfig: estimator name + AdvantageConfig,
                KL in the reward, DAPO, rollout correction
    reward      tephra.episodes.rewards.RewardConfig
    data, batch, trainer, resources: the controller's own sections

Each option and its default live once, in the package that implements it; this module only
chooses the trainer's neutral defaults for them and checks the combinations. Nothing here is
tuned for one task: the policy (`model.path`) has no default, and the embedded demo's choices
(SmolLM2, its 36 steps, lr 3e-5, the loss aggregation measured on it) are the apps/ppo
`default` preset, applied under every run of that app.
Every name (engine, rollout backend, estimator, loss, aggregation, KL estimator, agent loop,
scorer) is checked against its registry when the config is built, before any process starts.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

from tephra.algos import ActorObjectiveConfig, CriticObjectiveConfig
from tephra.algos.algorithm_config import AlgorithmConfig
from tephra.controller.cluster.watchdog import WatchdogConfig
from tephra.controller.cluster.worker_group import PLACEMENT_STRATEGIES, check_retain
from tephra.controller.run.checkpoints import RESUME_MODES
from tephra.controller.run.evaluation import ValidationConfig
from tephra.controller.run.trackers import TRACKERS
from tephra.core.errors import ConfigError
from tephra.core.registry import check_registered
from tephra.engine_api.config import (
    EngineConfig,
    EngineSections,
    LoraConfig,
    MicroBatchConfig,
    ModelConfig,
    MoEConfig,
    OptimizerConfig,
    PrecisionConfig,
)
from tephra.engine_api.registry import installed_engines
from tephra.episodes.config import EpisodeRolloutConfig
from tephra.episodes.environments.swe import get_task
from tephra.episodes.rewards import RewardConfig
from tephra.rollout.base import ServerSettings
from tephra.rollout.registry import ROLLOUT_BACKENDS


@dataclass
class EngineRoleConfig(EngineSections):
    """A trained role: which engine backend, and the engine's own sections (optimizer,
    scheduler, micro_batch, precision, offload, lora, parallel: tephra.engine_api)."""

    engine: str = "fsdp"
    """Training backend registered under the `tephra.engines` entry points (`fsdp`,
    `megatron`); any installed backend package adds its name."""

    def __post_init__(self) -> None:
        engines = installed_engines()
        if self.engine not in engines:
            close = difflib.get_close_matches(self.engine, sorted(engines), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(
                f"engine={self.engine!r} is not an installed engine backend{hint}; installed: "
                f"{sorted(engines)} (install e.g. tephra-engine-megatron for `megatron`)"
            )

    def engine_config(
        self, model: ModelConfig, role: str, temperature: float, seed: int, device: str = "auto"
    ) -> EngineConfig:
        """The `EngineConfig` this role builds on every rank."""

        sections = self.sections()
        if role != "policy":
            sections["lora"] = LoraConfig()  # a value head has no base weights to adapt
            sections["moe"] = MoEConfig()  # the rollout's routes are the policy's
        return EngineConfig(
            model=replace(model, role=role),
            **sections,
            temperature=temperature,
            compute_entropy=role == "policy",
            seed=seed,
            device=device,
        )


LORA_SYNC = ("auto", "adapter", "merged")
"""`actor.lora_sync` choices."""


@dataclass
class ActorConfig(EngineRoleConfig):
    """The policy: its engine and its loss."""

    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """AdamW of the policy (tephra.engine_api.OptimizerConfig's defaults; the apps/ppo demo
    sets lr 3e-5 and no weight decay in its `default` preset)."""
    precision: PrecisionConfig = field(default_factory=lambda: PrecisionConfig(param_dtype="auto"))
    """fp32 master weights; compute in bf16 where the device computes it faster than fp32
    (`auto`, timed once per machine), else fp32 (set `param_dtype=float32` for exact tests)."""
    micro_batch: MicroBatchConfig = field(
        default_factory=lambda: MicroBatchConfig(max_tokens_per_microbatch=4096)
    )
    """Token budget of one forward/backward micro-batch on one rank."""
    objective: ActorObjectiveConfig = field(default_factory=ActorObjectiveConfig)
    """Policy loss, aggregation, entropy bonus, KL loss, truncated importance sampling
    (tephra.algos.ActorObjectiveConfig; the apps/ppo demo sets
    `loss_agg_mode=seq-mean-token-mean`): `actor.objective.policy_loss=gspo`,
    `actor.objective.policy.clip_ratio_high=0.28`, `actor.objective.tis_level=token`."""
    lora_sync: str = "auto"
    """What a weight sync sends the rollout when `actor.lora.rank > 0`: `adapter` (the LoRA
    matrices and their rank / alpha alone, which the rollout applies over its unchanged base
    weights: a few MB instead of the whole model), `merged` (every weight with the adapter
    merged in), or `auto` (the default: `adapter` where the rollout backend serves adapters and
    the rollout is colocated, else `merged`). Ignored without LoRA."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.lora_sync not in LORA_SYNC:
            raise ConfigError(
                f"actor.lora_sync={self.lora_sync!r}: choose one of {list(LORA_SYNC)} (adapter "
                "sends the LoRA matrices alone, merged the full merged weights, auto the first "
                "where the rollout supports it)"
            )


@dataclass
class CriticConfig(EngineRoleConfig):
    """The value model (built only when the estimator needs values, e.g. `gae`)."""

    optimizer: OptimizerConfig = field(
        default_factory=lambda: OptimizerConfig(lr=1e-5, weight_decay=0.0)
    )
    """AdamW of the critic."""
    precision: PrecisionConfig = field(default_factory=lambda: PrecisionConfig(param_dtype="auto"))
    """Compute dtype of the critic (`auto`: as the actor's)."""
    micro_batch: MicroBatchConfig = field(
        default_factory=lambda: MicroBatchConfig(max_tokens_per_microbatch=4096)
    )
    """Token budget of one critic micro-batch on one rank."""
    objective: CriticObjectiveConfig = field(default_factory=CriticObjectiveConfig)
    """Clipped value loss (tephra.algos.CriticObjectiveConfig)."""


DATA_SOURCES = ("reasoning_gym", "parquet", "hf", "colour_squares", "code_problems", "swe_tasks")
"""`data.source` values."""


@dataclass
class DataSection:
    """Prompts and the held-out set."""

    source: str | None = None
    """Where the prompts come from, required (the library picks no task; apps/ppo's `default`
    preset sets the demo's reasoning-gym task): `reasoning_gym` (generated by seed), `parquet`
    (verl format), `hf` (a datasets folder saved with save_to_disk, or data files), or
    `colour_squares` (a synthetic image task generated by seed: name the colour of the square;
    a vision-language model), or `code_problems` (24 shipped programming problems with unit
    tests, 16 train / 8 held out, scored by the sandboxed code scorer; `train_size` /
    `val_size` cap them), or `swe_tasks` (36 shipped tiny Python repositories with a bug and
    failing tests, 26 train / 10 held out, run by the `swe` environment: needs
    rollout.agent_loop=environment and rollout.agent.environment=swe)."""
    task: str = ""
    """reasoning-gym task name, required with `source=reasoning_gym` (e.g. `basic_arithmetic`)."""
    task_config: dict[str, Any] = field(default_factory=dict)
    """reasoning-gym task options (`create_dataset` keywords); empty: the task's own defaults."""
    instruction: str = ""
    """Appended to each generated question on a line of its own (empty: the question alone).
    The reasoning-gym scorer reads the last number of the response, so a numeric task asks
    for the number (the demo: `Answer with just the final number.`)."""
    train_size: int = 2000
    """Number of reasoning-gym training prompts."""
    val_size: int = 200
    """Held-out prompts for greedy accuracy (the same items before, during and after)."""
    train_seed: int = 1
    """Seed that generates the training prompts."""
    val_seed: int = 9999
    """Seed of the held-out prompts (different from train_seed, so they are unseen)."""
    train_files: list[str] = field(default_factory=list)
    """Parquet files (source=parquet) or `name[:split]` (source=hf) of the training set."""
    val_files: list[str] = field(default_factory=list)
    """Same for the held-out set."""
    images: bool = False
    """The parquet files are verl multimodal rows: an `images` column and `<image>`
    placeholders in the prompt, and/or a `videos` column (lists of frames) and `<video>`
    placeholders (source=parquet; needs a vision-language model)."""
    max_frames: int = 8
    """At most this many frames of each video, spread evenly over it (rounded down to a
    multiple of 2: two frames make one temporal patch of the Qwen2-VL family)."""
    max_prompt_tokens: int = 128
    """Prompts longer than this (chat template and image tokens included) are dropped and
    counted."""
    swe_tasks: list[str] = field(default_factory=list)
    """source=swe_tasks: the shipped tasks to train on, by name (empty: the 26 of the
    training split); the held-out set is always the 10 held-out tasks."""

    def __post_init__(self) -> None:
        # unset is allowed here (a section built before its source is chosen); the trainer's
        # tree refuses it (PPOConfig), naming the choices
        if self.source is not None and self.source not in DATA_SOURCES:
            raise ConfigError(
                f"data.source={self.source!r}: choose one of {', '.join(DATA_SOURCES)}"
            )
        for name in self.swe_tasks:
            get_task(name, "data.swe_tasks")
        if self.source == "reasoning_gym" and not self.task:
            raise ConfigError(
                "data.task is not set: data.source=reasoning_gym generates the items of one "
                "reasoning-gym task; name it, e.g. data.task=basic_arithmetic (with its options "
                "in data.task_config; apps/ppo's default preset holds the demo's)"
            )
        if self.max_frames < 2:
            raise ConfigError(
                f"data.max_frames={self.max_frames}: a video needs at least 2 frames (one "
                "temporal patch); set data.max_frames >= 2"
            )
        if self.images and self.source != "parquet":
            raise ConfigError(
                f"data.images=true reads the `images` column of parquet files; "
                f"data.source={self.source!r} is not parquet (set "
                "data.source=parquet, or data.images=false)"
            )
        if self.source in ("parquet", "hf") and not (self.train_files or self.val_files):
            raise ConfigError(
                f"data.source={self.source!r} needs data.train_files (training) "
                "or data.val_files (evaluation)"
            )
        if self.source in ("reasoning_gym", "colour_squares") and self.train_seed == self.val_seed:
            raise ConfigError(
                "data.train_seed and data.val_seed must differ, or the held-out "
                "items are training items"
            )
        if self.max_prompt_tokens < 1:
            raise ConfigError(f"data.max_prompt_tokens={self.max_prompt_tokens} must be >= 1")

    @property
    def has_images(self) -> bool:
        """Whether the prompts carry images."""
        return self.images or self.source == "colour_squares"


@dataclass
class BatchSection:
    """Batch units of one RL step."""

    prompts_per_step: int = 4
    """Prompts sampled per RL step (global, over all data-parallel ranks)."""
    samples_per_prompt: int = 8
    """Responses per prompt (the group of GRPO/RLOO)."""
    mini_batches: int = 1
    """Optimizer steps per RL step: the step's samples are cut into this many mini-batches."""
    epochs: int = 1
    """Passes over the step's samples."""

    def __post_init__(self) -> None:
        for name in ("prompts_per_step", "samples_per_prompt", "mini_batches", "epochs"):
            if getattr(self, name) < 1:
                raise ConfigError(f"batch.{name}={getattr(self, name)} must be >= 1")

    @property
    def samples_per_step(self) -> int:
        return self.prompts_per_step * self.samples_per_prompt


TRAINING_MODES = ("sync", "one_step_off", "async")
"""`trainer.mode` values."""


@dataclass
class TrainerSection:
    """The loop, validation, checkpoints, trackers."""

    RETIRED_KEYS: ClassVar[dict[str, str]] = {
        "max_staleness": "use trainer.async_window (the weight versions a trained sample may "
        "lag the trainer by; admission now holds that bound, nothing is dropped)"
    }
    mode: str = "sync"
    """`sync`: each step trains on samples of the current weights. `one_step_off`: the batch
    of step k+1 is generated before step k's update, so step k trains on samples one weight
    version old (staleness 1; step 1's are fresh). `async`: rollout replicas
    (`resources.rollout.replicas` >= 1) generate prompt groups continuously, each request to
    the least-loaded replica; a prompt is admitted only if it can be trained within
    `async_window` versions, and a step trains the first `batch.prompts_per_step` groups that
    finished unless a slower one would miss its deadline. See the controller README."""
    async_window: int = 1
    """`async`: most weight versions a trained sample may lag the trainer by (its oldest
    token's version to the step it trains in, queue time included). Held by admission, not by
    dropping: a prompt is sent only while the steps up to trainer version + window have a free
    slot ((window + 1) x `batch.prompts_per_step` groups admitted and untrained at most), and a
    finished group overtakes slower ones by at most `window` steps. 0: each step's prompts are
    sent after the previous update (on-policy, no overlap); 1-2 keep the replicas busy."""
    async_in_flight: int = 2
    """`async`: requests (`async_groups_per_request` prompt groups each) queued per replica;
    more keeps replicas busy across a weight sync, fewer keeps samples fresher."""
    async_groups_per_request: int = 1
    """`async`: prompt groups per request to a replica. More decode more rows at once (where
    decoding is memory-bound, as on a GPU, a step costs nearly the same for 32 rows as for
    8); fewer let the scheduler balance long-tail samples across replicas finer."""
    partial_rollout: bool = False
    """`async` only: when new weights reach a replica, its in-flight generations stop at the
    next token, keep their tokens and log-probs, and continue under the new weights (as in
    verl / AReaL) instead of the update waiting for them to finish. Each response token records
    the weight version that produced it; a sample's `weight_version` is its oldest (the one it
    started under), which the staleness bound uses. With an agent loop, a turn interrupted
    by an update goes on under the new weights, later turns run under the newest, and tool
    tokens take the version of the turn they answer. Every built-in backend does it: `hf` stops
    at the next token, `vllm` / `sglang` abort the server's requests and resubmit prompt +
    tokens so far (rollout README). Off by default: samples then come from one version each."""
    overlap_generation: bool = True
    """`one_step_off`: generate the next batch in a worker thread while this step's passes
    and update run (the rollout engine holds its own weights until `sync_weights`). It keeps
    the rollout engine awake during training; false generates ahead serially. Same numbers
    either way; dynamic sampling and greedy baselines always generate serially."""
    balance_batch: bool = True
    """With several data-parallel ranks, give each rank as equal a share of the step's
    tokens (prompt + response) as Karmarkar-Karp finds, with equal row counts, inside each
    mini-batch (verl's `balance_batch`; `tephra.controller.step.balance`); false splits the rows
    in their order. On by default: a rank that draws the long responses holds every other
    rank up at each collective, and the update is the same either way (global normalisers).
    Metrics `balance/max_over_min_tokens_before` / `_after`."""
    steps: int = 1
    """RL steps of the run. 1 by default (one step checks a set-up end to end); set the run's
    length (the apps/ppo demo's 36 are in its `default` preset)."""
    critic_warmup: int = 0
    """The first N steps update the critic only: the actor's weights and optimizer state are
    left untouched (verl's `critic_warmup`; VAPO's value pretraining), so the critic learns the
    policy's values before its advantages steer the policy. Needs an estimator with a critic."""
    seed: int = 0
    """Seed of data order, sampling and initialisation."""
    run_dir: str = "runs/ppo"
    """Where metrics, checkpoints, plots and the export go (a second run with the same
    run_dir resumes from its latest checkpoint)."""
    resume: str = "auto"
    """`auto`: continue from the latest intact checkpoint in run_dir when there is one;
    `off`: start fresh; `must`: fail unless there is one to continue from."""
    max_restarts: int = 1
    """When a worker process dies (killed, out of memory) or a stage passes its watchdog
    deadline, the worker group is rebuilt and the run continues from the latest intact
    checkpoint, at most this many times (0: fail with the watchdog's message)."""
    watchdog: WatchdogConfig = field(default_factory=WatchdogConfig)
    """Deadlines of the driver's calls on the workers (`tephra.controller.cluster.watchdog`)."""
    resume_from: str | None = None
    """A `step_<N>` checkpoint folder (of this or another run) to continue from instead."""
    accept_changed_data: bool = False
    """Continue a checkpoint's position in the data although the training prompts changed
    since it was saved (their fingerprint differs). Off: such a resume is refused before Ray
    starts, since the saved position would repeat some prompts and skip others."""
    save_every: int = 0
    """Checkpoint every N steps (0: only at the end when `save_final`)."""
    save_final: bool = False
    """Checkpoint after the last step."""
    keep_checkpoints: int = 2
    """How many checkpoints to keep."""
    val_every: int = 0
    """Validation every N steps (0: only before and after training)."""
    val: ValidationConfig = field(default_factory=ValidationConfig)
    """How validation samples (n per prompt, temperature, top_p) and which pass@k / maj@k it
    reports (tephra.controller.run.evaluation); the default n=1 at temperature 0 is greedy
    accuracy. Metrics: `accuracy/val` (acc@n) and `val/...` overall and per data source."""
    dump_generations: int = 0
    """Every N steps write run_dir/generations/train_step<N>.jsonl (the step's samples with
    their token ids, finish reasons, the rollout's log-probs, rewards and advantages), and
    write every validation's generations to val_step<N>.jsonl; 0: never."""
    val_before: bool = True
    """Measure held-out accuracy before training."""
    val_after: bool = True
    """Measure held-out accuracy after training."""
    trackers: list[str] = field(default_factory=lambda: ["console", "jsonl"])
    """Metric sinks from tephra.controller.TRACKERS: console, jsonl, tensorboard, wandb
    (offline), mlflow, clearml (offline), swanlab (offline)."""
    project: str = "tephra"
    """Project name for W&B / MLflow / ClearML / SwanLab."""
    export_hf: bool = True
    """Write the trained policy as a Hugging Face folder to run_dir/hf at the end."""
    progress_bar: bool = True
    """Show a tqdm bar over steps."""
    profile_steps: list[int] = field(default_factory=list)
    """Steps (1-based) to profile with torch.profiler: every stage of those steps writes a
    Chrome trace per rank to run_dir/profile/step<N>_<stage>_rank<R>.json (open it in
    chrome://tracing or Perfetto)."""

    def __post_init__(self) -> None:
        if self.mode not in TRAINING_MODES:
            raise ConfigError(f"trainer.mode={self.mode!r}: choose one of {list(TRAINING_MODES)}")
        if not isinstance(self.critic_warmup, int) or self.critic_warmup < 0:
            raise ConfigError(
                f"trainer.critic_warmup={self.critic_warmup} must be >= 0 (steps that update "
                "the critic only; 0: none)"
            )
        if not isinstance(self.async_window, int) or self.async_window < 0:
            raise ConfigError(
                f"trainer.async_window={self.async_window} must be an integer >= 0 (weight "
                "versions a trained sample may lag the trainer by; 1 or 2 keep the replicas "
                "busy, 0 is on-policy)"
            )
        if self.async_in_flight < 1 or self.async_groups_per_request < 1:
            raise ConfigError(
                f"trainer.async_in_flight={self.async_in_flight} must be >= 1 and "
                f"trainer.async_groups_per_request={self.async_groups_per_request} "
                ">= 1"
            )
        if self.resume not in RESUME_MODES:
            raise ConfigError(f"trainer.resume={self.resume!r}: choose one of {list(RESUME_MODES)}")
        if any(s < 1 for s in self.profile_steps):
            raise ConfigError(f"trainer.profile_steps={self.profile_steps}: steps are 1-based")

        for name in (
            "steps",
            "max_restarts",
            "save_every",
            "keep_checkpoints",
            "val_every",
            "dump_generations",
        ):
            if getattr(self, name) < 0:
                raise ConfigError(f"trainer.{name}={getattr(self, name)} must be >= 0")
        for name in self.trackers:
            check_registered("trainer.trackers", name, TRACKERS)


@dataclass
class RolloutPoolSection:
    """A separate pool of rollout replicas (disaggregated placement)."""

    replicas: int = 0
    """Rollout replicas, one Ray actor each with its own engine (an `hf` model or a server it
    starts). 0: the rollout engine is colocated with the training ranks (the hybrid engine)."""
    cpus_per_replica: float = 1.0
    """CPUs (and torch threads) per replica."""
    gpus_per_replica: float = 0.0
    """GPUs per replica (the replica's `hf` model or server runs on them)."""

    def __post_init__(self) -> None:
        if self.replicas < 0 or self.cpus_per_replica < 0 or self.gpus_per_replica < 0:
            raise ConfigError(
                "resources.rollout.replicas, cpus_per_replica and gpus_per_replica must be >= 0"
            )


@dataclass
class RolePoolSection:
    """A pool of its own for the reference, the critic or the model-based rewards (verl's
    resource-pool mapping)."""

    ranks: int = 0
    """Ranks of the role's own worker group (one Ray actor each; the role's engine parallel
    sizes divide them, data parallel is what remains). 0: the role lives in the colocated
    worker with the actor, the default, which needs no extra processes or memory for a
    second copy of the framework."""
    cpus_per_rank: float = 1.0
    """CPUs (and torch threads) per rank of the role's pool; 1 by default: a forward-only
    reference is light, raise it for a critic that trains."""
    gpus_per_rank: float = 0.0
    """GPUs per rank of the role's pool; 0 by default, as for the training ranks
    (`resources.gpus_per_rank`), so the default runs on a CPU machine."""

    def check(self, name: str) -> None:
        """Refuse negative sizes, naming the pool (`resources.<name>`)."""
        if self.ranks < 0 or self.cpus_per_rank < 0 or self.gpus_per_rank < 0:
            raise ConfigError(
                f"resources.{name}: ranks={self.ranks}, cpus_per_rank="
                f"{self.cpus_per_rank} and gpus_per_rank={self.gpus_per_rank} "
                "must be >= 0 (ranks=0: colocated with the actor)"
            )


@dataclass
class ResourcesSection:
    """Ray placement of the ranks."""

    ray_address: str | None = None
    """Ray cluster address (host:port, or "auto" for the cluster running on this machine);
    None joins the cluster the RAY_ADDRESS variable names, else starts a private local session."""
    num_cpus: int | None = None
    """CPUs of the local Ray session (None: all)."""
    ray_dashboard: bool = False
    """Start Ray's dashboard (an HTTP server on 127.0.0.1:8265) with a local session; off by
    default: nothing outside the run needs it. A local session always has Ray's token
    authentication on, with a token made per session."""
    world_size: int = 1
    """Ranks of the colocated worker group (one Ray actor each): data parallel times the
    actor's tensor x pipeline x context parallel sizes."""
    cpus_per_rank: float = 2.0
    """CPUs (and torch threads) per rank."""
    gpus_per_rank: float = 0.0
    """GPUs per rank (each rank then computes on the GPU Ray assigned to it, the engines and
    the hf rollout alike)."""
    placement: str = "PACK"
    """Ray placement strategy of the ranks' bundles: `PACK` (as few nodes as possible),
    `SPREAD`, `STRICT_PACK` (one node), `STRICT_SPREAD` (one rank per node)."""
    retain_freed_memory: bool | None = None
    """Whether the ranks and rollout replicas keep freed host memory for reuse (glibc's mmap
    and trim thresholds raised): a CPU step then reuses its large tensors' memory instead of
    paying page faults for it again (0.5-0.8 s of a 2-3 s update on a 2-core CPU), at the
    price of resident memory staying near its peak. None: on for processes without GPUs;
    true needs glibc (Linux)."""
    memory_per_rank_gb: float = 0.0
    """Host memory (GiB) Ray reserves for each rank of the colocated group: Ray places no more
    ranks on a node than its memory holds, instead of letting them run it out of memory.
    0: none reserved."""
    rollout: RolloutPoolSection = field(default_factory=RolloutPoolSection)
    """Rollout replicas on a pool of their own (`replicas` > 0), fed weights by broadcast from
    the training ranks; the training ranks then hold no rollout engine."""
    ref: RolePoolSection = field(default_factory=RolePoolSection)
    """The reference policy on a pool of its own (`ranks` > 0) or colocated with the actor
    (0, the default). Its weights never change, so nothing moves to it but batches."""
    critic: RolePoolSection = field(default_factory=RolePoolSection)
    """The critic on a pool of its own (`ranks` > 0) or colocated with the actor (0, the
    default)."""
    reward: RolePoolSection = field(default_factory=RolePoolSection)
    """The model-based rewards on a pool of their own (`ranks` > 0): the reward model
    (`reward.reward_model_path`), the LLM judge (`reward.judge`) and PRIME's reward model
    (`algorithm.prime`). The generating ranks send their samples there, so each sample is
    scored once, by one reward rank, and the models load once per reward rank instead of in
    every scoring process. 0 (default): colocated, every generating rank scores its own
    samples in its own process. Either way a vLLM judge without `reward.judge.vllm.url` is
    one server for the run, started by the driver."""

    def __post_init__(self) -> None:
        if self.placement not in PLACEMENT_STRATEGIES:
            raise ConfigError(
                f"resources.placement={self.placement!r}: choose one of "
                f"{list(PLACEMENT_STRATEGIES)}"
            )
        if self.world_size < 1:
            raise ConfigError(f"resources.world_size={self.world_size} must be >= 1")
        if self.cpus_per_rank < 0 or self.gpus_per_rank < 0:
            raise ConfigError("resources.cpus_per_rank and gpus_per_rank must be >= 0")
        if self.memory_per_rank_gb < 0:
            raise ConfigError(
                f"resources.memory_per_rank_gb={self.memory_per_rank_gb} must be >= 0 (0: none)"
            )
        if self.num_cpus is not None and self.num_cpus < 1:
            raise ConfigError(f"resources.num_cpus={self.num_cpus} must be >= 1 (or null: all)")
        check_retain(self.retain_freed_memory)
        for name in ("ref", "critic", "reward"):
            getattr(self, name).check(name)


MODEL_PATH_FIX = (
    "set model.path to a local Hugging Face folder or a bundled name: `smollm2` (the "
    "bundled SmolLM2-135M-Instruct), `tiny` (a tiny random model), e.g. model.path=smollm2; "
    "`uv run apps/ppo` sets model.path=smollm2 in its default preset"
)
"""What a config without a policy is told (the policy has no library default)."""

DATA_SOURCE_FIX = (
    f"set data.source to one of {', '.join(DATA_SOURCES)} (reasoning_gym needs data.task, "
    "parquet and hf data.train_files), e.g. data.source=reasoning_gym "
    "data.task=basic_arithmetic; `uv run apps/ppo` sets the demo's data (reasoning-gym "
    "basic_arithmetic) in its default preset, laid under every run"
)
"""What a config without a data source is told (the prompts have no library default)."""


def check_trainable_attention(model: ModelConfig, resources: ResourcesSection) -> None:
    """Refuse flex attention on CPU ranks (`resources.gpus_per_rank=0`) while the config loads:
    torch's flex attention has no backward on CPU, so the first update would fail after Ray
    started."""
    if model.attn_implementation == "flex_attention" and resources.gpus_per_rank == 0:
        raise ConfigError(
            "model.attn_implementation='flex_attention' with resources.gpus_per_rank=0 (CPU "
            "ranks): torch's flex attention has no backward on CPU, so no step could train; "
            "use model.attn_implementation=sdpa on CPU, or flex attention on GPU ranks "
            "(resources.gpus_per_rank=1)"
        )


def adapter_sync_obstacle(cfg: PPOConfig) -> str | None:
    """Why the weight sync of `cfg` cannot send the LoRA adapter alone (None: it can)."""
    r = cfg.rollout
    backend = ROLLOUT_BACKENDS.get(r.backend)
    if not backend.supports_adapters:
        return f"rollout.backend={r.backend!r} cannot serve an adapter over its base weights"
    if backend.max_adapter_rank is not None and cfg.actor.lora.rank > backend.max_adapter_rank:
        return (
            f"rollout.backend={r.backend!r} serves adapters of rank <= "
            f"{backend.max_adapter_rank}, and actor.lora.rank={cfg.actor.lora.rank}"
        )
    if cfg.resources.rollout.replicas:
        return (
            f"resources.rollout.replicas={cfg.resources.rollout.replicas}: rollout replicas of "
            "their own receive the merged weights by broadcast"
        )
    settings = getattr(r, r.backend, None)
    if isinstance(settings, ServerSettings) and settings.sleep_level == 2:
        return (
            f"rollout.{r.backend}.sleep_level=2 drops the server's base weights while it "
            "sleeps, and only a full sync sends them again"
        )
    return None


@dataclass
class PPOConfig:
    """The RL trainer (PPO, GRPO, RLOO, REINFORCE++, ReMax, DAPO, ... by name)."""

    REQUIRED_HINTS: ClassVar[dict[str, str]] = {"model": MODEL_PATH_FIX}
    model: ModelConfig
    """The policy checkpoint (tephra.engine_api.ModelConfig), required: `path` is a local
    Hugging Face folder, `smollm2` (the bundled SmolLM2-135M-Instruct), `tiny` (a tiny random
    model for tests) or `tiny_vlm` / `tiny_qwen2_5_vl` / `tiny_llava` (a tiny random Qwen2-VL /
    Qwen2.5-VL / LLaVA); gradient_checkpointing, attn_implementation, trust_remote_code."""
    data: DataSection = field(default_factory=DataSection)
    """Prompts and held-out set; `data.source` is required."""
    batch: BatchSection = field(default_factory=BatchSection)
    """Batch units."""
    rollout: EpisodeRolloutConfig = field(default_factory=EpisodeRolloutConfig)
    """Generation."""
    actor: ActorConfig = field(default_factory=ActorConfig)
    """Policy engine and loss."""
    critic: CriticConfig = field(default_factory=CriticConfig)
    """Value engine and loss (built only when the estimator needs values)."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """Advantage estimator, KL in reward, DAPO."""
    reward: RewardConfig = field(default_factory=lambda: RewardConfig(executor="serial"))
    """Scoring (tephra.episodes.rewards.RewardConfig): rule scorers by data_source, a custom
    function from a file, or a reward model. Each rank scores its own samples; `serial` by
    default because the demo's scorers take microseconds."""
    trainer: TrainerSection = field(default_factory=TrainerSection)
    """Loop, validation, checkpoints, trackers."""
    resources: ResourcesSection = field(default_factory=ResourcesSection)
    """Ray placement."""

    def __post_init__(self) -> None:
        if self.data.source is None:
            raise ConfigError(f"data.source is not set: {DATA_SOURCE_FIX}")
        check_trainable_attention(self.model, self.resources)

    @property
    def policy_path(self) -> str:
        """`model.path`, which the RL trainer requires: its tokenizer, rollout engine and named
        models come from that folder, so `model.hf_config` alone is refused (naming the fix)."""
        if self.model.path is None:
            raise ConfigError(
                f"model.path is not set (model.hf_config={self.model.hf_config!r}): the RL "
                f"trainer reads the policy's tokenizer and weights from a folder; {MODEL_PATH_FIX}"
            )
        return self.model.path

    @property
    def needs_reference(self) -> bool:
        return (
            self.algorithm.prime.enabled
            or self.actor.objective.use_kl_loss
            or self.algorithm.kl_in_reward.enabled
        )

    def data_parallel_size(self) -> int:
        return self.actor.parallel.data_parallel_size(self.resources.world_size)

    @property
    def adapter_sync(self) -> bool:
        """Whether weight syncs send the LoRA adapter alone (`actor.lora_sync`, with `auto`
        resolved: adapter-only where the backend serves adapters, the rollout is colocated
        and a server never drops its weights)."""
        if not self.actor.lora.enabled or self.actor.lora_sync == "merged":
            return False
        return self.actor.lora_sync == "adapter" or not adapter_sync_obstacle(self)
