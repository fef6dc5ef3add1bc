"""The RL trainer's configuration: one typed tree composed of the packages' own configs.

    model       tephra.engine_api.ModelConfig          the policy (and critic) checkpoint
    actor       ActorConfig   = engine name + the engine's optimizer, scheduler, micro_batch,
                precision, offload, lora, parallel sections + tephra.algos.ActorObjectiveConfig
    critic      CriticConfig  = the same with tephra.algos.CriticObjectiveConfig
    rollout     backend name, sampling, tephra.rollout's HFSettings / ServerSettings and
                AgentLoopConfig
    algorithm   estimator name + tephra.algos.AdvantageConfig, KL in the reward, DAPO
    reward      tephra.episodes.rewards.RewardConfig
    data, batch, trainer, resources: the controller's own sections

Each option and its default live once, in the package that implements it; this module only
chooses the trainer's defaults for them (the embedded demo) and checks the combinations.
Every name (engine, rollout backend, estimator, loss, aggregation, KL estimator, agent loop,
scorer) is checked against its registry when the config is built, before any process starts.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from tephra.algos import ActorObjectiveConfig, AdvantageConfig, CriticObjectiveConfig
from tephra.algos.advantages import ADVANTAGE_ESTIMATORS
from tephra.algos.kl import KL_ESTIMATORS
from tephra.algos.policy_losses import POLICY_LOSSES
from tephra.algos.rollout_correction import LEVELS, ROLLOUT_CORRECTIONS, RolloutCorrectionConfig
from tephra.controller.evaluation import ValidationConfig
from tephra.controller.models import declared_model_folder
from tephra.controller.watchdog import WatchdogConfig
from tephra.core.errors import ConfigError, RegistryError
from tephra.engine_api.config import (
    EngineConfig,
    EngineSections,
    LoraConfig,
    MicroBatchConfig,
    ModelConfig,
    OptimizerConfig,
    PrecisionConfig,
)
from tephra.episodes.agent.base import AgentLoopConfig
from tephra.episodes.agent.black_box import load_agent_function
from tephra.episodes.agent.tool_calls import TOOL_CALL_PARSERS
from tephra.episodes.environments.registry import get_environment
from tephra.episodes.registry import EPISODES
from tephra.episodes.rewards import RewardConfig, RewardFunctionError, load_reward_function
from tephra.rollout.base import HFSettings, ServerSettings
from tephra.rollout.registry import ROLLOUT_BACKENDS
from tephra.rollout.weight_transport import Placement, choose_transport


def _check_name(field_name: str, value: str, registry: Any) -> None:
    """A registry name, refused as a ConfigError naming the field and the choices."""
    if value not in registry:
        import difflib

        close = difflib.get_close_matches(str(value), registry.names(), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(
            f"{field_name}={value!r} is not a registered {registry.kind}{hint}; "
            f"choose one of {registry.names()}"
        )


@dataclass
class EngineRoleConfig(EngineSections):
    """A trained role: which engine backend, and the engine's own sections (optimizer,
    scheduler, micro_batch, precision, offload, lora, parallel: tephra.engine_api)."""

    engine: str = "fsdp"
    """Training backend registered under the `tephra.engines` entry points (`fsdp`,
    `megatron`); any installed backend package adds its name."""

    def __post_init__(self) -> None:
        from tephra.engine_api.registry import installed_engines

        engines = installed_engines()
        if self.engine not in engines:
            import difflib

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
        from dataclasses import replace

        sections = self.sections()
        if role != "policy":
            sections["lora"] = LoraConfig()  # a value head has no base weights to adapt
        return EngineConfig(
            model=replace(model, role=role),
            **sections,
            temperature=temperature,
            compute_entropy=role == "policy",
            seed=seed,
            device=device,
        )


def _demo_actor_objective() -> ActorObjectiveConfig:
    # seq-mean-token-mean weighs every sample equally (the GRPO paper's form). On the demo
    # (then with division items) `token-mean` let long truncated responses dominate the
    # gradient (62% of samples hit the length cap by step 30, +26.5 points);
    # `seq-mean-token-mean` brought the cap rate near 0 (+29 points).
    return ActorObjectiveConfig(loss_agg_mode="seq-mean-token-mean")


@dataclass
class ActorConfig(EngineRoleConfig):
    """The policy: its engine and its loss."""

    optimizer: OptimizerConfig = field(
        default_factory=lambda: OptimizerConfig(lr=3e-5, weight_decay=0.0)
    )
    """AdamW; the demo's lr 3e-5 (5e-5 made responses hit the length cap within 9 steps)."""
    precision: PrecisionConfig = field(default_factory=lambda: PrecisionConfig(param_dtype="auto"))
    """fp32 master weights; compute in bf16 where the device computes it faster than fp32
    (`auto`, timed once per machine), else fp32 (set `param_dtype=float32` for exact tests)."""
    micro_batch: MicroBatchConfig = field(
        default_factory=lambda: MicroBatchConfig(max_tokens_per_microbatch=4096)
    )
    """Token budget of one forward/backward micro-batch on one rank."""
    objective: ActorObjectiveConfig = field(default_factory=_demo_actor_objective)
    """Policy loss, aggregation, entropy bonus, KL loss, truncated importance sampling
    (tephra.algos.ActorObjectiveConfig): `actor.objective.policy_loss=gspo`,
    `actor.objective.policy.clip_ratio_high=0.28`, `actor.objective.tis_level=token`."""


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


@dataclass
class RolloutSection:
    """Generation: the backend by name, sampling, and each backend's own settings."""

    backend: str = "hf"
    """Rollout backend from tephra.rollout.ROLLOUT_BACKENDS: `hf` (in-process transformers),
    `vllm`, `sglang` (servers)."""
    dtype: str = "auto"
    """Generation dtype: `float32`, `bfloat16`, `float16`, or `auto`: bfloat16 where the
    workers' device computes it faster than float32 (measured once at start: on a CPU with
    avx512_bf16 the demo's generate took 3.6 s in bf16 vs 5.5 s in fp32; on an AVX2-only
    CPU bf16 matmuls ran 3-7x slower than fp32). The trainer recomputes log-probs in its own
    dtype, so this only changes what is sampled."""
    temperature: float = 1.0
    """Sampling temperature (the trainer's log-probs use the same)."""
    top_p: float = 1.0
    """Nucleus sampling; 1 keeps every token (log-probs then match the trainer exactly)."""
    top_k: int = -1
    """Top-k sampling; -1 keeps every token."""
    max_tokens: int = 32
    """Most response tokens per sample (per model turn with an agent loop)."""
    sleep_when_training: bool = True
    """Colocated (hybrid) mode: `rollout.sleep()` after generation, so the rollout's memory
    is free while the engine trains (a GPU backend frees its weights / KV cache, a server as
    deep as `rollout.<backend>.sleep_level` says; on CPU the hf backend has nothing to free).
    The weight sync wakes it: a server's weights first, then its KV cache after the load."""
    hf: HFSettings = field(default_factory=HFSettings)
    """Settings of the `hf` backend (device is set from the rank's device)."""
    vllm: ServerSettings = field(default_factory=ServerSettings)
    """Settings of the `vllm` server backend."""
    sglang: ServerSettings = field(default_factory=ServerSettings)
    """Settings of the `sglang` server backend."""
    agent_loop: str | None = None
    """Multi-turn rollouts: an episode from tephra.episodes.registry.EPISODES (`tool_agent`:
    the model calls the tools of `tools_file` between turns; `single_turn`). None or "" keeps
    the batched `generate` path."""
    tools_file: str | None = None
    """Tools YAML of the agent loop, or `python` for the bundled sandboxed interpreter."""
    max_in_flight: int = 64
    """Agent loop: most trajectories in flight per rank (their turns are batched together)."""
    agent: AgentLoopConfig = field(
        default_factory=lambda: AgentLoopConfig(
            max_turns=3, max_response_tokens=128, max_tool_response_chars=500
        )
    )
    """Agent-loop budgets (tephra.episodes.agent.AgentLoopConfig): max_turns,
    max_response_tokens (the trained response length), max_tool_response_chars, ..."""

    def __post_init__(self) -> None:
        _check_name("rollout.backend", self.backend, ROLLOUT_BACKENDS)
        if self.agent_loop:
            _check_name("rollout.agent_loop", self.agent_loop, EPISODES)
            _check_name(
                "rollout.agent.tool_call_format", self.agent.tool_call_format, TOOL_CALL_PARSERS
            )
            uses_tools = self.agent_loop == "tool_agent" or (
                self.agent_loop == "environment" and self.agent.environment == "tool"
            )
            if uses_tools and not self.tools_file:
                raise ConfigError(
                    f"rollout.agent_loop={self.agent_loop!r} needs rollout.tools_file"
                    + (" (rollout.agent.environment='tool')" if self.agent.environment else "")
                    + ": a tools YAML, or `python` for the bundled sandboxed interpreter"
                )
            if self.agent_loop == "openai_agent" or self.agent.openai_agent:
                load_agent_function(self.agent.openai_agent)  # its errors come before Ray
            if self.agent_loop == "environment" or self.agent.environment:
                try:  # a file is imported here, so its errors come before Ray starts
                    get_environment(self.agent.environment)
                except RegistryError as exc:
                    raise ConfigError(f"rollout.agent.environment: {exc}") from None
        if self.max_in_flight < 1:
            raise ConfigError(f"rollout.max_in_flight={self.max_in_flight} must be >= 1")
        protocol = getattr(ROLLOUT_BACKENDS.get(self.backend), "protocol_class", None)
        if protocol is not None:
            try:
                protocol().check_settings(getattr(self, self.backend))
            except ConfigError as exc:
                raise ConfigError(f"rollout.{exc}") from None
        if self.max_tokens < 1:
            raise ConfigError(f"rollout.max_tokens={self.max_tokens} must be >= 1")
        from tephra.engine_api.fastest_dtype import AUTO
        from tephra.rollout.base import DTYPES

        if self.dtype not in (*DTYPES, AUTO):  # the backend checks too, but only once Ray runs
            raise ConfigError(
                f"rollout.dtype={self.dtype!r} is not allowed; choose one of {[*DTYPES, AUTO]}"
            )
        if not math.isfinite(self.temperature) or self.temperature < 0:
            # NaN passes `< 0` and sampling then behaved as if it were 1.0
            what = "" if math.isfinite(self.temperature) else "a finite number "
            raise ConfigError(
                f"rollout.temperature={self.temperature} must be {what}>= 0 (1.0 "
                "samples from the policy as it is; 0 is greedy)"
            )
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"rollout.top_p={self.top_p} must be in (0, 1]")

    @property
    def uses_agent_loop(self) -> bool:
        return bool(self.agent_loop)

    @property
    def tensor_parallel_size(self) -> int:
        """Ranks per rollout engine: a server backend's `tensor_parallel_size`, 1 for `hf`
        (one in-process model per rank). Generation's data-parallel size is the world size
        divided by it."""
        settings = getattr(self, self.backend, None)
        return settings.tensor_parallel_size if isinstance(settings, ServerSettings) else 1

    @property
    def response_budget(self) -> int:
        """Most response tokens of one sample: `agent.max_response_tokens` with an agent loop,
        `max_tokens` without."""
        return self.agent.max_response_tokens if self.uses_agent_loop else self.max_tokens

    @property
    def budget_name(self) -> str:
        return "rollout.agent.max_response_tokens" if self.uses_agent_loop else "rollout.max_tokens"


@dataclass
class KLInRewardConfig:
    """KL to the reference policy as a per-token reward penalty (verl's use_kl_in_reward):
    r'_t = r_t - beta * KL_t, with beta fixed or adapted towards a target KL."""

    coef: float = 0.0
    """Initial beta; 0 turns the penalty off."""
    estimator: str = "k1"
    """KL estimator from tephra.algos.KL_ESTIMATORS (verl's kl_penalty: `kl`/`k1`, `abs`,
    `mse`/`k2`, `low_var_kl`/`k3`)."""
    controller: str = "fixed"
    """`fixed` (beta stays `coef`) or `adaptive` (Ziegler et al. 2019: beta follows
    `target_kl` over `horizon` samples)."""
    target_kl: float = 0.1
    """`adaptive`: the KL per token the controller steers towards."""
    horizon: int = 10000
    """`adaptive`: samples over which beta moves by up to 20%."""

    def __post_init__(self) -> None:
        if self.coef < 0:
            raise ConfigError(f"algorithm.kl_in_reward.coef={self.coef} must be >= 0 (0 = off)")
        _check_name("algorithm.kl_in_reward.estimator", self.estimator, KL_ESTIMATORS)
        if self.estimator.startswith("full"):
            raise ConfigError(
                "algorithm.kl_in_reward.estimator='full' needs full-vocabulary "
                "log-probs, which engines do not return; use 'k1' or 'k3'"
            )
        if self.controller not in ("fixed", "adaptive"):
            raise ConfigError(
                f"algorithm.kl_in_reward.controller={self.controller!r}: choose "
                "'fixed' or 'adaptive'"
            )
        if self.target_kl <= 0 or self.horizon < 1:
            raise ConfigError("algorithm.kl_in_reward.target_kl must be > 0 and horizon >= 1")

    @property
    def enabled(self) -> bool:
        return self.coef > 0


@dataclass
class AlgorithmSection:
    """The estimator by name and its settings, KL in the reward, DAPO's sampling rules."""

    adv_estimator: str = "grpo"
    """Advantage estimator from tephra.algos.ADVANTAGE_ESTIMATORS; what it needs (a critic,
    groups of samples, greedy baselines) is read from the registry's metadata."""
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    """gamma, lam, norm_by_std, passk_k, ... (tephra.algos.AdvantageConfig)."""
    kl_in_reward: KLInRewardConfig = field(default_factory=KLInRewardConfig)
    """KL penalty in the reward (off by default; the KL loss is `actor.objective.use_kl_loss`)."""
    dynamic_sampling: bool = False
    """DAPO dynamic sampling: drop prompt groups whose samples all got the same score (no
    group-relative signal) and generate more prompts until `batch.prompts_per_step` groups
    remain; filtered on the outcome score, before length shaping."""
    max_gen_batches: int = 3
    """Dynamic sampling: at most this many rounds of `batch.prompts_per_step` prompts per
    step; a batch still short of informative groups is filled with flat ones."""
    overlong_buffer: int = 0
    """DAPO soft overlong punishment: the last `overlong_buffer` tokens of the response budget
    cost up to `overlong_penalty_factor` of reward, linearly; 0 turns it off."""
    overlong_penalty_factor: float = 1.0
    """The penalty at the full response budget (added to the score as a negative reward)."""
    rollout_correction: str = "none"
    """What the policy loss does about rollouts sampled by other weights (`trainer.mode=
    one_step_off`) or another engine, from tephra.algos.ROLLOUT_CORRECTIONS: `none`;
    `tis` (truncated importance sampling of exp(old_log_prob - rollout_log_prob), old
    log-probs recomputed); `bypass` (the rollout's log-probs are the old log-probs, the
    recompute is skipped). `rollout_corr/*` mismatch metrics are logged whenever the
    trainer's old log-probs are computed."""
    rollout_correction_level: str = "token"
    """`tis`: one weight per token (`token`) or per sequence (`sequence`: product of its
    tokens' ratios)."""
    rollout_correction_cap: float = 2.0
    """`tis`: truncation C of min(ratio, C), >= 1."""
    rollout_rejection: list[str] = field(default_factory=list)
    """Rejection sampling (verl's `rollout_rs`) from tephra.algos.REJECTION_OPTIONS, e.g.
    [token_k1] or [seq_mean_k3]: tokens (or whole sequences for `seq_*`) whose divergence
    between the trainer's and the rollout's log-probs leaves the bounds are dropped from the
    response mask for the update (the trainer's log-probs are then computed). Empty: none."""
    rollout_rejection_threshold: str | float | None = None
    """Bounds of `rollout_rejection` (verl's `rollout_rs_threshold`): `"lower_upper"` ratio
    bounds for *_k1 options (one number u means 1/u_u), an upper bound for k2 / k3; one for
    all options or one per option, comma-separated."""
    mismatch_probe_rows: int = 8
    """Rows whose log-probs the trainer recomputes every step to log the train/rollout
    mismatch (`rollout_corr/*`) when the step computes none of its own (one mini-batch, one
    epoch, no correction): a random subset, rounded to the data-parallel size. 0 turns the
    probe off. 8 rows cost a small forward pass and catch a dtype or kernel mismatch early."""
    mismatch_alarm_kl: float | None = None
    """Stop the run when `rollout_corr/kl_k3` (KL between the rollout's and the trainer's
    token distributions, estimated on the sampled tokens) exceeds this; None: log only.
    Healthy runs sit near 1e-4 to 1e-3; a wrong dtype or chat template gives 1e-2 and more."""

    def __post_init__(self) -> None:
        _check_name("algorithm.adv_estimator", self.adv_estimator, ADVANTAGE_ESTIMATORS)
        _check_name("algorithm.rollout_correction", self.rollout_correction, ROLLOUT_CORRECTIONS)
        if self.rollout_correction_level not in LEVELS:
            raise ConfigError(
                f"algorithm.rollout_correction_level="
                f"{self.rollout_correction_level!r}: choose one of {list(LEVELS)}"
            )
        if not self.rollout_correction_cap >= 1:
            raise ConfigError(
                f"algorithm.rollout_correction_cap={self.rollout_correction_cap} "
                "must be >= 1 (the truncation C of min(ratio, C))"
            )
        self.correction  # noqa: B018 - validates the rejection options and bounds
        if self.mismatch_probe_rows < 0:
            raise ConfigError(
                f"algorithm.mismatch_probe_rows={self.mismatch_probe_rows} must "
                "be >= 0 (0 turns the mismatch probe off)"
            )
        if self.mismatch_alarm_kl is not None and not (
            math.isfinite(self.mismatch_alarm_kl) and self.mismatch_alarm_kl > 0
        ):
            raise ConfigError(
                f"algorithm.mismatch_alarm_kl={self.mismatch_alarm_kl} must be a "
                "positive number (e.g. 0.01), or null to log without an alarm"
            )
        if self.max_gen_batches < 1:
            raise ConfigError(f"algorithm.max_gen_batches={self.max_gen_batches} must be >= 1")
        if self.overlong_penalty_factor < 0:
            raise ConfigError(
                f"algorithm.overlong_penalty_factor={self.overlong_penalty_factor} must be >= 0"
            )

    @property
    def correction(self) -> RolloutCorrectionConfig:
        return RolloutCorrectionConfig(
            self.rollout_correction,
            self.rollout_correction_level,
            self.rollout_correction_cap,
            tuple(self.rollout_rejection),
            self.rollout_rejection_threshold,
        )

    def needs(self, what: str) -> bool:
        """Whether the estimator's registry metadata says it needs `values`, `groups`,
        `baselines`, `k` or `token_stats` (the trainer's log-probs and sum pi^2)."""
        return bool(ADVANTAGE_ESTIMATORS.meta(self.adv_estimator).get(f"needs_{what}"))

    def reads(self, what: str) -> bool:
        """Whether the estimator's registry metadata says it uses `what` when given
        (`reward_components`: `gdpo`), without needing it."""
        return bool(ADVANTAGE_ESTIMATORS.meta(self.adv_estimator).get(f"reads_{what}"))


DATA_SOURCES = ("reasoning_gym", "parquet", "hf", "colour_squares", "code_problems")
"""`data.source` values."""


@dataclass
class DataSection:
    """Prompts and the held-out set."""

    source: str = "reasoning_gym"
    """`reasoning_gym` (generated by seed), `parquet` (verl format), `hf` (a datasets
    folder saved with save_to_disk, or data files), or `colour_squares` (a synthetic image
    task generated by seed: name the colour of the square; a vision-language model), or
    `code_problems` (24 shipped programming problems with unit tests, 16 train / 8 held out,
    scored by the sandboxed code scorer; `train_size` / `val_size` cap them)."""
    task: str = "basic_arithmetic"
    """reasoning-gym task name."""
    task_config: dict[str, Any] = field(
        default_factory=lambda: {
            "min_terms": 2,
            "max_terms": 2,
            "min_digits": 1,
            "max_digits": 1,
            "allow_negation": False,
            "allow_parentheses": False,
            "operators": ["+", "-", "*"],
        }
    )
    """reasoning-gym task options; the default is basic_arithmetic at its easiest settings
    without division: in reasoning-gym 0.1.25 a division item's answer does not match its
    question ('6 / 2' -> 4, '5 / 8' -> 35): 53 of the 200 held-out items, unanswerable."""
    instruction: str = "Answer with just the final number."
    """Appended to each generated question."""
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
    placeholders in the prompt (source=parquet; needs a vision-language model)."""
    max_prompt_tokens: int = 128
    """Prompts longer than this (chat template and image tokens included) are dropped and
    counted."""

    def __post_init__(self) -> None:
        if self.source not in DATA_SOURCES:
            raise ConfigError(
                f"data.source={self.source!r}: choose one of {', '.join(DATA_SOURCES)}"
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

    mode: str = "sync"
    """`sync`: each step trains on samples of the current weights. `one_step_off`: the batch
    of step k+1 is generated before step k's update, so step k trains on samples one weight
    version old (staleness 1; step 1's are fresh). `async`: rollout replicas
    (`resources.rollout.replicas` >= 1) generate prompt groups continuously, each request to
    the least-loaded replica; a step trains on the first `batch.prompts_per_step` groups that
    finished, dropping those more than `max_staleness` versions old. See the controller README."""
    max_staleness: int = 1
    """`async`: most weight versions a trained sample may lag the trainer by; older groups are
    dropped (counted in `async/dropped_stale_groups`)."""
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
    mini-batch (verl's `balance_batch`; `tephra.controller.balance`); false splits the rows
    in their order. On by default: a rank that draws the long responses holds every other
    rank up at each collective, and the update is the same either way (global normalisers).
    Metrics `balance/max_over_min_tokens_before` / `_after`."""
    steps: int = 36
    """RL steps. The demo, measured on 2 cores with AMX: ~9.5 s per step (17-20 s on an
    AVX2-only CPU, in fp32); held-out greedy accuracy 29.5% -> 76.5% (200 items)."""
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
    """Deadlines of the driver's calls on the workers (`tephra.controller.watchdog`)."""
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
    reports (tephra.controller.evaluation); the default n=1 at temperature 0 is greedy
    accuracy. Metrics: `accuracy/val` (acc@n) and `val/...` overall and per data source."""
    dump_generations: int = 0
    """Every N steps write run_dir/generations/train_step<N>.jsonl (the step's samples with
    their token ids, finish reasons, rewards and advantages), and write every validation's
    generations to val_step<N>.jsonl; 0: never."""
    val_before: bool = True
    """Measure held-out accuracy before training."""
    val_after: bool = True
    """Measure held-out accuracy after training."""
    trackers: list[str] = field(default_factory=lambda: ["console", "jsonl"])
    """Metric sinks from tephra.controller.TRACKERS: console, jsonl, tensorboard, wandb
    (offline), mlflow."""
    project: str = "tephra"
    """Project name for W&B / MLflow."""
    export_hf: bool = True
    """Write the trained policy as a Hugging Face folder to run_dir/hf at the end."""
    progress_bar: bool = True
    """Show a tqdm bar over steps."""
    profile_steps: list[int] = field(default_factory=list)
    """Steps (1-based) to profile with torch.profiler: every stage of those steps writes a
    Chrome trace per rank to run_dir/profile/step<N>_<stage>_rank<R>.json (open it in
    chrome://tracing or Perfetto)."""

    def __post_init__(self) -> None:
        from tephra.controller.checkpoints import RESUME_MODES
        from tephra.controller.trackers import TRACKERS

        if self.mode not in TRAINING_MODES:
            raise ConfigError(f"trainer.mode={self.mode!r}: choose one of {list(TRAINING_MODES)}")
        if self.max_staleness < 0 or self.async_in_flight < 1 or self.async_groups_per_request < 1:
            raise ConfigError(
                f"trainer.max_staleness={self.max_staleness} must be >= 0, "
                f"trainer.async_in_flight={self.async_in_flight} >= 1 and "
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
            _check_name("trainer.trackers", name, TRACKERS)


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
    """A pool of its own for the reference or the critic (verl's resource-pool mapping)."""

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

    def __post_init__(self) -> None:
        if self.ranks < 0 or self.cpus_per_rank < 0 or self.gpus_per_rank < 0:
            raise ConfigError(
                f"resources.<role>: ranks={self.ranks}, cpus_per_rank="
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
    rollout: RolloutPoolSection = field(default_factory=RolloutPoolSection)
    """Rollout replicas on a pool of their own (`replicas` > 0), fed weights by broadcast from
    the training ranks; the training ranks then hold no rollout engine."""
    ref: RolePoolSection = field(default_factory=RolePoolSection)
    """The reference policy on a pool of its own (`ranks` > 0) or colocated with the actor
    (0, the default). Its weights never change, so nothing moves to it but batches."""
    critic: RolePoolSection = field(default_factory=RolePoolSection)
    """The critic on a pool of its own (`ranks` > 0) or colocated with the actor (0, the
    default)."""

    def __post_init__(self) -> None:
        from tephra.controller.worker_group import PLACEMENT_STRATEGIES, check_retain

        if self.placement not in PLACEMENT_STRATEGIES:
            raise ConfigError(
                f"resources.placement={self.placement!r}: choose one of "
                f"{list(PLACEMENT_STRATEGIES)}"
            )
        if self.world_size < 1:
            raise ConfigError(f"resources.world_size={self.world_size} must be >= 1")
        if self.cpus_per_rank < 0 or self.gpus_per_rank < 0:
            raise ConfigError("resources.cpus_per_rank and gpus_per_rank must be >= 0")
        if self.num_cpus is not None and self.num_cpus < 1:
            raise ConfigError(f"resources.num_cpus={self.num_cpus} must be >= 1 (or null: all)")
        check_retain(self.retain_freed_memory)


@dataclass
class PPOConfig:
    """The RL trainer (PPO, GRPO, RLOO, REINFORCE++, ReMax, DAPO, ... by name)."""

    model: ModelConfig = field(default_factory=lambda: ModelConfig(path="smollm2"))
    """The policy checkpoint (tephra.engine_api.ModelConfig): `path` is a local Hugging Face
    folder, `smollm2` (the bundled SmolLM2-135M-Instruct), `tiny` (a tiny random model for
    tests) or `tiny_vlm` (a tiny random Qwen2-VL); gradient_checkpointing, attn_implementation, trust_remote_code."""
    data: DataSection = field(default_factory=DataSection)
    """Prompts and held-out set."""
    batch: BatchSection = field(default_factory=BatchSection)
    """Batch units."""
    rollout: RolloutSection = field(default_factory=RolloutSection)
    """Generation."""
    actor: ActorConfig = field(default_factory=ActorConfig)
    """Policy engine and loss."""
    critic: CriticConfig = field(default_factory=CriticConfig)
    """Value engine and loss (built only when the estimator needs values)."""
    algorithm: AlgorithmSection = field(default_factory=AlgorithmSection)
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
        validate(self)

    @property
    def needs_reference(self) -> bool:
        return self.actor.objective.use_kl_loss or self.algorithm.kl_in_reward.enabled

    def data_parallel_size(self) -> int:
        return self.actor.parallel.data_parallel_size(self.resources.world_size)


def resolve_auto_dtypes(cfg: PPOConfig) -> PPOConfig:
    """`cfg` with every `auto` compute dtype (actor, critic, rollout) made concrete for the
    workers' device, measured once here, so that every process computes in the same dtype
    and the weight sync sends what the rollout holds."""
    from tephra.engine_api.fastest_dtype import resolve_dtype

    r = cfg.resources
    train = "cuda" if r.gpus_per_rank > 0 else "cpu"
    # rollout replicas of their own (disaggregated) generate on their pool's device
    rollout = (
        train if not r.rollout.replicas else "cuda" if r.rollout.gpus_per_replica > 0 else "cpu"
    )

    def role(section):
        p = section.precision
        return replace(
            section, precision=replace(p, param_dtype=resolve_dtype(p.param_dtype, train))
        )

    return replace(
        cfg,
        actor=role(cfg.actor),
        critic=role(cfg.critic),
        rollout=replace(cfg.rollout, dtype=resolve_dtype(cfg.rollout.dtype, rollout)),
    )


def validate(cfg: PPOConfig) -> None:
    """The combinations, checked together with the arithmetic in the message."""
    b, r, a = cfg.batch, cfg.rollout, cfg.algorithm
    ws = cfg.resources.world_size
    try:
        dp = cfg.data_parallel_size()
    except ConfigError as exc:
        raise ConfigError(
            f"resources.world_size={ws} with the actor's parallel sizes: {exc}; "
            "make world_size a multiple of tensor x pipeline x context"
        ) from None
    if b.prompts_per_step % dp:
        raise ConfigError(
            f"batch.prompts_per_step={b.prompts_per_step} must be a multiple of the data-"
            f"parallel size {dp} (resources.world_size={ws} / model-parallel "
            f"{cfg.actor.parallel.model_parallel_size()}): each data-parallel rank trains on "
            "an equal share of prompt groups"
        )
    rollout_tp = r.tensor_parallel_size
    if cfg.resources.rollout.replicas == 0 and ws % rollout_tp:
        raise ConfigError(
            f"rollout.{r.backend}.tensor_parallel_size={rollout_tp} does not divide "
            f"resources.world_size={ws}: each rollout engine takes that many consecutive "
            "ranks; choose a divisor of the world size (or rollout replicas of their own, "
            "resources.rollout.replicas)"
        )
    settings = getattr(r, r.backend, None)
    if (
        cfg.resources.rollout.replicas == 0
        and rollout_tp > 1
        and isinstance(settings, ServerSettings)
        and settings.sleep_level == 2
    ):
        raise ConfigError(
            f"rollout.{r.backend}.sleep_level=2 with rollout.{r.backend}.tensor_parallel_size="
            f"{rollout_tp} colocated: a server that dropped its weights gets them again from "
            "its own rank's export, which the ranks without a server would not join; use "
            f"sleep_level=1, or rollout replicas of their own (resources.rollout.replicas)"
        )
    per_rank = b.samples_per_step // dp
    if per_rank % b.mini_batches:
        raise ConfigError(
            f"each data-parallel rank holds batch.prompts_per_step x samples_per_prompt / dp = "
            f"{b.prompts_per_step} x {b.samples_per_prompt} / {dp} = {per_rank} samples, which "
            f"batch.mini_batches={b.mini_batches} does not divide; choose a divisor of {per_rank}"
        )
    longest = cfg.data.max_prompt_tokens + r.response_budget
    for role in ("actor", "critic"):
        budget = getattr(cfg, role).micro_batch.max_tokens_per_microbatch
        if role == "critic" and not a.needs("values"):
            continue
        if longest > budget:
            raise ConfigError(
                f"a sample can reach data.max_prompt_tokens + {r.budget_name} = "
                f"{cfg.data.max_prompt_tokens} + {r.response_budget} = {longest} tokens, more "
                f"than {role}.micro_batch.max_tokens_per_microbatch={budget}; raise the budget "
                "or lower one of the two"
            )
    if a.needs("groups") and r.temperature == 0:
        raise ConfigError(
            f"rollout.temperature=0 with algorithm.adv_estimator={a.adv_estimator!r}: greedy "
            "sampling gives every sample of a prompt's group the same response, so the "
            "group-relative advantages are all 0 and nothing is learnt; set rollout.temperature "
            "> 0 (e.g. 1.0), or choose an estimator that does not compare samples of one prompt "
            "(e.g. reinforce_plus_plus); greedy evaluation is trainer.val.temperature=0"
        )
    if a.needs("groups") and b.samples_per_prompt < 2:
        raise ConfigError(
            f"algorithm.adv_estimator={a.adv_estimator!r} compares samples of one prompt; "
            f"batch.samples_per_prompt={b.samples_per_prompt} must be >= 2"
        )
    if a.needs("k") and b.samples_per_prompt < a.advantage.passk_k:
        raise ConfigError(
            f"algorithm.adv_estimator={a.adv_estimator!r} with algorithm.advantage.passk_k="
            f"{a.advantage.passk_k} needs at least k samples per prompt; "
            f"batch.samples_per_prompt={b.samples_per_prompt}: raise it or lower passk_k"
        )
    if a.advantage.gdpo_reward_keys is not None and not a.reads("reward_components"):
        raise ConfigError(
            f"algorithm.advantage.gdpo_reward_keys={a.advantage.gdpo_reward_keys} is read by "
            f"algorithm.adv_estimator=gdpo only, not {a.adv_estimator!r}; remove it or set "
            "algorithm.adv_estimator=gdpo"
        )
    if a.needs("baselines") and r.uses_agent_loop:
        raise ConfigError(
            f"algorithm.adv_estimator={a.adv_estimator!r} takes the greedy response's reward "
            "as the baseline, which the trainer generates with plain `generate`; it is not "
            "supported with rollout.agent_loop"
        )
    replicas = cfg.resources.rollout.replicas
    if cfg.trainer.mode == "async":
        if replicas < 1:
            raise ConfigError(
                "trainer.mode=async streams samples from rollout replicas on a pool "
                "of their own; set resources.rollout.replicas >= 1"
            )
        t = cfg.trainer
        per = t.async_groups_per_request
        capacity = t.async_in_flight * replicas * per
        # finished groups count against the bound: with want - 1 waiting, one more request
        # must still fit
        if capacity < b.prompts_per_step + per - 1:
            raise ConfigError(
                f"trainer.mode=async keeps trainer.async_in_flight x resources.rollout.replicas "
                f"x trainer.async_groups_per_request = {t.async_in_flight} x {replicas} x {per} "
                f"= {capacity} groups in flight or waiting, fewer than the "
                f"batch.prompts_per_step + async_groups_per_request - 1 = "
                f"{b.prompts_per_step + per - 1} a step needs; raise async_in_flight or the "
                "replicas"
            )
        if a.dynamic_sampling or a.needs("baselines"):
            raise ConfigError(
                "trainer.mode=async: algorithm.dynamic_sampling and greedy-baseline "
                f"estimators ({a.adv_estimator!r}) need the sync or one_step_off mode"
            )
    if cfg.trainer.partial_rollout:
        if cfg.trainer.mode != "async":
            raise ConfigError(
                f"trainer.partial_rollout=true interrupts generations in flight on "
                f"rollout replicas when weights arrive; it needs trainer.mode=async "
                f"(now {cfg.trainer.mode!r})"
            )
        from tephra.rollout.base import can_pause

        if not can_pause(ROLLOUT_BACKENDS.get(r.backend)):
            pausable = [n for n in ROLLOUT_BACKENDS if can_pause(ROLLOUT_BACKENDS.get(n))]
            raise ConfigError(
                f"trainer.partial_rollout=true: rollout.backend={r.backend!r} cannot "
                "interrupt a generation in flight for a weight update (it has no "
                f"`paused()`); use one of {pausable} or set "
                "trainer.partial_rollout=false"
            )
    if a.dynamic_sampling and b.samples_per_prompt < 2:
        raise ConfigError(
            "algorithm.dynamic_sampling drops groups whose samples all scored the "
            f"same; batch.samples_per_prompt={b.samples_per_prompt} must be >= 2"
        )
    if not 0 <= a.overlong_buffer <= r.response_budget:
        raise ConfigError(
            f"algorithm.overlong_buffer={a.overlong_buffer} must be between 0 (off) and the "
            f"response budget {r.budget_name}={r.response_budget}"
        )
    if a.needs("values") and cfg.critic.engine != cfg.actor.engine:
        raise ConfigError(
            f"critic.engine={cfg.critic.engine!r} differs from actor.engine="
            f"{cfg.actor.engine!r}; the colocated worker runs one backend"
        )
    loss = cfg.actor.objective.policy_loss
    if (
        POLICY_LOSSES.meta(loss).get("old_log_probs") == "rollout"
        and a.rollout_correction != "bypass"
    ):
        raise ConfigError(
            f"actor.objective.policy_loss={loss!r} takes the rollout log-probs as the old "
            f"log-probs; set algorithm.rollout_correction=bypass with it (now "
            f"{a.rollout_correction!r})"
        )
    if a.rollout_correction != "none" and cfg.actor.objective.tis_level is not None:
        raise ConfigError(
            f"algorithm.rollout_correction={a.rollout_correction!r} with actor.objective."
            f"tis_level={cfg.actor.objective.tis_level!r} would correct twice; use "
            "algorithm.rollout_correction=tis (and its _level / _cap) alone"
        )
    check_role_pools(cfg)
    if cfg.data.has_images:
        check_image_support(cfg)
    weight_path(cfg)
    check_engine_support(cfg)
    check_surroundings(cfg)


def check_surroundings(cfg: PPOConfig) -> None:
    """What the config names outside itself, checked while it loads (before Ray starts, so
    that a typo is one line, not Ray's start-up and then a worker's traceback): the reward
    function, the run folder, the checkpoint to resume from, the Ray cluster, and the CPUs
    and GPUs of this machine. The model folder is checked by `prepare` (it may be built or
    converted on first use)."""
    check_reward_files(cfg.reward)
    check_run_dir(cfg.trainer.run_dir)
    check_resume(cfg.trainer)
    check_resources(cfg.resources)


def check_reward_files(reward: RewardConfig) -> None:
    """The custom reward file exists, defines the function, and its signature takes verl's
    `compute_score(data_source, solution_str, ground_truth, extra_info)` (the file is
    imported here, as each worker imports it later); the reward model folder exists."""
    if reward.custom_function_path:
        try:
            load_reward_function(
                reward.custom_function_path,
                reward.custom_function_name,
                reward.custom_function_kwargs,
            )
        except RewardFunctionError as exc:
            raise ConfigError(f"reward.custom_function_path: {exc}") from None
    if reward.reward_model_path and not Path(reward.reward_model_path).expanduser().is_dir():
        raise ConfigError(
            f"reward.reward_model_path={reward.reward_model_path!r}: no such "
            "folder; give a Hugging Face sequence-classifier folder"
        )


def check_run_dir(run_dir: str) -> None:
    """`trainer.run_dir` is a folder that exists and is writable, or can be created."""
    path = Path(run_dir).expanduser().absolute()
    existing = next(p for p in (path, *path.parents) if p.exists())
    fix = "set trainer.run_dir to a folder you can write"
    if not existing.is_dir():
        raise ConfigError(
            f"trainer.run_dir={run_dir!r} cannot be created: {existing} is a "
            f"file, not a folder; {fix}"
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        what = "is not writable" if existing == path else f"cannot be created in {existing}"
        raise ConfigError(f"trainer.run_dir={run_dir!r} {what} (permission denied); {fix}")


def check_resume(t: TrainerSection) -> None:
    """`trainer.resume_from` is a checkpoint folder; `trainer.resume=must` has a checkpoint
    in run_dir. Only their presence: the files are checked against their manifest (SHA-256,
    slow for big checkpoints) when the trainer resumes."""
    from tephra.controller.checkpoints import MANIFEST, CheckpointManager

    fix = "give a step_<N> folder of a run's checkpoints (run_dir/checkpoints/step_<N>)"
    if t.resume_from:
        folder = Path(t.resume_from).expanduser()
        if not folder.is_dir():
            raise ConfigError(f"trainer.resume_from={t.resume_from!r}: no such folder; {fix}")
        if not (folder / MANIFEST).is_file():
            raise ConfigError(
                f"trainer.resume_from={t.resume_from!r}: {MANIFEST} is missing, "
                f"so it is no complete checkpoint; {fix}"
            )
    elif t.resume == "must":
        root = Path(t.run_dir).expanduser() / "checkpoints"
        if not CheckpointManager(root).committed():
            raise ConfigError(
                f"trainer.resume=must but {root} holds no checkpoint; run once "
                "with trainer.save_every or trainer.save_final set, set "
                "trainer.resume_from, or use trainer.resume=auto"
            )


def check_resources(r: ResourcesSection) -> None:
    """`ray_address=auto` finds a running cluster; a private local session (no address)
    has the CPUs and GPUs the ranks and rollout replicas ask for: Ray would wait for them
    forever (the pool's ready timeout then fails after Ray started)."""
    from tephra.controller.worker_group import find_local_cluster, machine_capacity

    if r.ray_address == "auto":
        find_local_cluster()
    if r.ray_address not in (None, "local") or os.environ.get("RAY_ADDRESS"):
        return  # a cluster: its other nodes may have what this one lacks
    # `ray_init` passes num_cpus to a session it starts without an address
    num_cpus = r.num_cpus if r.ray_address is None else None
    cpus, gpus = machine_capacity(num_cpus)
    p = r.rollout
    for kind, per_rank, per_replica, have, hint in (
        (
            "CPUs",
            r.cpus_per_rank,
            p.cpus_per_replica,
            cpus,
            f"this machine has {cpus:g}" if num_cpus is None else f"resources.num_cpus={num_cpus}",
        ),
        ("GPUs", r.gpus_per_rank, p.gpus_per_replica, gpus, f"this machine has {gpus}"),
    ):
        need = r.world_size * per_rank + p.replicas * per_replica
        if need > have:
            kind_l = kind[:-1].lower()
            replicas = (
                f" + resources.rollout.replicas={p.replicas} x {kind_l}s_per_replica="
                f"{per_replica:g}"
                if p.replicas
                else ""
            )
            raise ConfigError(
                f"resources.world_size={r.world_size} x resources.{kind_l}s_per_rank="
                f"{per_rank:g}{replicas} = {need:g} {kind}, but {hint}; lower world_size or "
                f"{kind_l}s_per_rank, or join a cluster with resources.ray_address"
            )


def weight_path(cfg: PPOConfig) -> str:
    """How the weights travel after each update, in one line (the driver prints it once
    per run); a ConfigError where a hop's transport cannot work with the placement.

    Separate rollout pools first receive from training rank 0 by a broadcast of their own
    (NCCL when both pools have GPUs, gloo otherwise); a server backend's
    `weight_transport` then carries them from the process holding the rollout engine into
    its server (`tephra.rollout.weight_transport.choose_transport`)."""
    r, pool = cfg.resources, cfg.resources.rollout
    hops = []
    if pool.replicas:
        both_gpu = r.gpus_per_rank > 0 and pool.gpus_per_replica > 0
        if both_gpu and (r.gpus_per_rank < 1 or pool.gpus_per_replica < 1):
            raise ConfigError(
                f"resources.gpus_per_rank={r.gpus_per_rank} and resources.rollout."
                f"gpus_per_replica={pool.gpus_per_replica}: with fractions Ray may put a "
                "rollout replica on a training rank's GPU, where the NCCL weight broadcast "
                "between them cannot run (NCCL refuses two ranks of one communicator on one "
                "GPU); give both whole GPUs, or colocate (resources.rollout.replicas=0)"
            )
        hops.append(
            f"training rank 0 -> {pool.replicas} rollout replica(s): "
            f"{'nccl (different GPUs)' if both_gpu else 'gloo'}"
        )
    settings = getattr(cfg.rollout, cfg.rollout.backend, None)
    if not isinstance(settings, ServerSettings):
        hops.append(
            f"{'replica' if pool.replicas else 'trainer'} -> in-process "
            f"{cfg.rollout.backend} rollout: tensors copied in place"
        )
    elif settings.weight_sync == "disk":
        hops.append(f"-> {cfg.rollout.backend} server: safetensors on disk (weight_sync=disk)")
    else:
        gpu = (pool.gpus_per_replica if pool.replicas else r.gpus_per_rank) > 0
        placement = Placement(
            "cuda" if gpu else "cpu",
            same_device=settings.url is None,
            server_gpus=settings.tensor_parallel_size * settings.data_parallel_size,
        )
        backend = cfg.rollout.backend
        protocol = getattr(ROLLOUT_BACKENDS.get(backend), "protocol_class", None)
        transport = choose_transport(
            f"rollout.{backend}.weight_transport",
            settings.weight_transport,
            placement,
            *((protocol.weight_transports, backend) if protocol else ()),
        )
        how = "auto" if settings.weight_transport == "auto" else "set"
        hops.append(
            f"{'replica' if pool.replicas else 'trainer'} -> {backend} server: "
            f"{transport} ({how}; {placement.describe()})"
        )
    return "weight transport: " + "; ".join(hops)


def check_role_pools(cfg: PPOConfig) -> None:
    """A pool of its own for the reference or critic must have a use and must split the
    step's samples as the actor's ranks do (equal shares that divide into mini-batches)."""
    b = cfg.batch
    uses = {
        "ref": (
            cfg.needs_reference and not cfg.actor.lora.enabled,
            "nothing uses a reference: set actor.objective.use_kl_loss=true or "
            "algorithm.kl_in_reward, and no actor.lora (its reference is the actor "
            "with the adapters off)",
        ),
        "critic": (
            cfg.algorithm.needs("values"),
            f"algorithm.adv_estimator={cfg.algorithm.adv_estimator!r} uses no critic",
        ),
    }
    for role, (used, why) in uses.items():
        ranks = getattr(cfg.resources, role).ranks
        if not ranks:
            continue
        if not used:
            raise ConfigError(
                f"resources.{role}.ranks={ranks}, but {why}; set resources.{role}.ranks=0"
            )
        parallel = (cfg.critic if role == "critic" else cfg.actor).parallel
        try:
            dp = parallel.data_parallel_size(ranks)
        except ConfigError as exc:
            raise ConfigError(
                f"resources.{role}.ranks={ranks}: {exc}; make it a multiple of "
                "the role's tensor x pipeline x context sizes"
            ) from None
        if b.samples_per_step % dp or (b.samples_per_step // dp) % b.mini_batches:
            raise ConfigError(
                f"resources.{role}.ranks={ranks} gives {dp} data-parallel ranks, which the "
                f"step's {b.samples_per_step} samples (in batch.mini_batches={b.mini_batches} "
                "mini-batches) do not split into equal shares; choose a data-parallel size "
                f"that divides {b.samples_per_step // b.mini_batches}"
            )


def check_image_support(cfg: PPOConfig) -> None:
    """Images travel through the hf rollout and the fsdp engine in the sync loop only."""
    what = (
        "data.source=colour_squares" if cfg.data.source == "colour_squares" else "data.images=true"
    )
    r, a = cfg.rollout, cfg.algorithm
    refused = [
        (
            r.backend != "hf",
            f"rollout.backend={r.backend!r}: only the hf backend generates "
            "with images; set rollout.backend=hf",
        ),
        (
            cfg.actor.engine != "fsdp",
            f"actor.engine={cfg.actor.engine!r}: only the fsdp engine "
            "trains vision-language models; set actor.engine=fsdp",
        ),
        (
            r.uses_agent_loop,
            f"rollout.agent_loop={r.agent_loop!r}: agent loops do not take "
            "images yet; leave rollout.agent_loop unset",
        ),
        (
            cfg.trainer.mode != "sync",
            f"trainer.mode={cfg.trainer.mode!r}: images are supported "
            "in the sync mode only; set trainer.mode=sync",
        ),
        (
            cfg.resources.rollout.replicas > 0,
            f"resources.rollout.replicas={cfg.resources.rollout.replicas}: separate rollout "
            "replicas do not take images yet; set resources.rollout.replicas=0",
        ),
        (
            a.needs("values"),
            f"algorithm.adv_estimator={a.adv_estimator!r} needs a critic, and "
            "a value model on a vision-language model is not supported; "
            "choose e.g. grpo",
        ),
        (
            a.needs("baselines"),
            f"algorithm.adv_estimator={a.adv_estimator!r} generates greedy "
            "baselines, not supported with images yet; choose e.g. grpo",
        ),
        (
            cfg.actor.lora.enabled,
            "actor.lora: LoRA on a vision-language model is not supported "
            "yet; set actor.lora.rank=0",
        ),
        (
            cfg.actor.parallel.context > 1,
            f"actor.parallel.context={cfg.actor.parallel.context}: Ulysses does not take images "
            "yet; set actor.parallel.context=1",
        ),
    ]
    for bad, why in refused:
        if bad:
            raise ConfigError(f"{what} (prompts with images): {why}")


def check_engine_support(cfg: PPOConfig, model_folder: str | None = None) -> None:
    """Ask the backend whether it supports the options set (before any process starts).
    `model_folder`: the resolved `model.path` (`prepare` asks again with it, once a named
    model is built); by default its config.json is read where it already exists."""
    from tephra.engine_api.registry import get_engine_class

    a = cfg.algorithm
    # CPU ranks are told so; GPU ranks may sit on other nodes than this driver's ("auto")
    device = "auto" if cfg.resources.gpus_per_rank > 0 else "cpu"
    roles = [("actor", cfg.actor, "policy")]
    if a.needs("values"):
        roles.append(("critic", cfg.critic, "value"))
    for section, role_cfg, role in roles:
        engine_cls = get_engine_class(role_cfg.engine)
        # the backend reads the model's config.json where there is one (its shape against the
        # parallel layout); nothing is built or converted here
        model = replace(
            cfg.model, path=model_folder or declared_model_folder(cfg.model.path, cfg.trainer.seed)
        )
        try:
            engine_cls.check_config(
                role_cfg.engine_config(model, role, 1.0, cfg.trainer.seed, device=device),
                world_size=cfg.resources.world_size,
            )
        except ConfigError as exc:
            raise ConfigError(f"{section}.engine={role_cfg.engine!r}: {exc}") from None
