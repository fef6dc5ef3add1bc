"""SFT configuration: the same pieces as the RL trainer (model, an engine role with its
optimizer / scheduler / micro-batch / precision / LoRA / parallel sections, Ray resources)
plus the SFT data and loop."""

from __future__ import annotations

from dataclasses import dataclass, field

from tephra.controller.config.tree import (
    DataSection,
    EngineRoleConfig,
    ResourcesSection,
    check_trainable_attention,
)
from tephra.core.errors import ConfigError
from tephra.engine_api.config import (
    MicroBatchConfig,
    ModelConfig,
    OptimizerConfig,
    PrecisionConfig,
)


@dataclass
class SFTPolicy(EngineRoleConfig):
    """The trained model's engine (any installed backend) and its sections."""

    optimizer: OptimizerConfig = field(
        default_factory=lambda: OptimizerConfig(lr=1e-4, weight_decay=0.0)
    )
    """AdamW; SmolLM2 on the arithmetic chats: probe NLL 1.538 -> 0.144 in 20 steps at 1e-4."""
    precision: PrecisionConfig = field(default_factory=lambda: PrecisionConfig(param_dtype="auto"))
    """fp32 master weights; bf16 compute where the device computes it faster than fp32
    (`auto`, timed once per machine), else fp32."""
    micro_batch: MicroBatchConfig = field(
        default_factory=lambda: MicroBatchConfig(max_tokens_per_microbatch=4096)
    )
    """Token budget of a micro-batch on one rank."""


SFT_SOURCES = ("chats", "colour_squares", "tool_calls")
"""`data.source` values."""


@dataclass
class SFTData:
    """Conversations: `messages` rows (chat messages; assistant turns are trained)."""

    source: str = "chats"
    """`chats`: the conversations of `train_files` (generated arithmetic chats when empty).
    `colour_squares`: transcripts of the synthetic image task of `tephra.controller.
    data.colour_squares` (the RL trainer's `data.source=colour_squares`), `size` of them drawn
    by `seed`: its question about an image, answered with the colour name; needs a
    vision-language model and policy.engine=fsdp.
    `tool_calls`: `size` transcripts (drawn by `seed`) of apps/ppo's tool_demo task, a product of
    two 4-digit numbers answered by one hermes `<tool_call>` to the python tool, the tool's
    output, then the number."""
    train_files: list[str] = field(default_factory=list)
    """Parquet or jsonl files with a `messages` column; empty: generated arithmetic chats."""
    val_files: list[str] = field(default_factory=list)
    """Held-out conversations for the validation loss; empty: the last `val_size` of the
    training conversations are held out instead."""
    val_size: int = 16
    """Conversations held out of the training set when `val_files` is empty (0: none)."""
    size: int = 256
    """Number of generated conversations (arithmetic chats when train_files is empty, or
    colour_squares transcripts); the last `val_size` of them are held out."""
    seed: int = 0
    """Seed of the generated conversations and of the data order."""
    max_seq_tokens: int = 512
    """Conversations longer than this (image tokens included) are dropped (and counted)."""
    images: bool = False
    """The files are verl multimodal rows: an `images` column and `<image>` placeholders in
    the messages (needs a vision-language model and policy.engine=fsdp)."""

    def __post_init__(self) -> None:
        if self.val_size < 0 or self.size < 1 or self.max_seq_tokens < 1:
            raise ConfigError("data.val_size must be >= 0, data.size and data.max_seq_tokens >= 1")
        if self.source not in SFT_SOURCES:
            raise ConfigError(f"data.source={self.source!r}: choose one of {list(SFT_SOURCES)}")
        if self.source == "tool_calls":
            if self.train_files or self.images:
                raise ConfigError(
                    "data.source=tool_calls generates its transcripts; leave data.train_files "
                    "empty and data.images=false, or use data.source=chats for files"
                )
            if self.seed in (DataSection.train_seed, DataSection.val_seed):
                # apps/ppo's tool_demo draws its RL prompts and held-out items by those seeds
                raise ConfigError(
                    f"data.seed={self.seed} draws apps/ppo's tool_demo prompts (data.train_seed="
                    f"{DataSection.train_seed}, data.val_seed={DataSection.val_seed}); choose "
                    "another seed so that SFT never trains on them"
                )
        if self.source == "colour_squares":
            if self.train_files or self.val_files or self.images:
                raise ConfigError(
                    "data.source=colour_squares generates its transcripts (images included); "
                    "leave data.train_files and data.val_files empty and data.images=false, or "
                    "use data.source=chats for files"
                )
            if self.seed == DataSection.val_seed:
                # the RL trainer measures held-out accuracy on the items of that seed
                raise ConfigError(
                    f"data.seed={self.seed} draws the RL trainer's held-out colour_squares items "
                    f"(apps/ppo data.val_seed={DataSection.val_seed}); choose another seed so "
                    "that SFT never trains on them"
                )


@dataclass
class SFTTrain:
    """The loop, validation, checkpoints, trackers."""

    steps: int = 20
    """Optimizer steps."""
    sequences_per_step: int = 8
    """Conversations per optimizer step (global)."""
    run_dir: str = "runs/sft"
    """Metrics, checkpoints and the export go here (a second run with the same run_dir
    resumes from its latest checkpoint)."""
    resume: bool = True
    """Continue from the latest checkpoint in run_dir when there is one."""
    save_every: int = 0
    """Checkpoint every N steps (0: never)."""
    keep_checkpoints: int = 2
    """How many checkpoints to keep."""
    val_every: int = 0
    """Validation loss every N steps (0: only before and after training)."""
    export_hf: bool = True
    """Write run_dir/hf at the end."""
    trackers: list[str] = field(default_factory=lambda: ["console", "jsonl"])
    """Metric sinks."""

    def __post_init__(self) -> None:
        if self.steps < 0 or self.sequences_per_step < 1:
            raise ConfigError("train.steps must be >= 0 and train.sequences_per_step >= 1")


@dataclass
class SFTConfig:
    """Supervised fine-tuning on chat conversations."""

    model: ModelConfig = field(default_factory=lambda: ModelConfig(path="smollm2"))
    """Hugging Face folder; `smollm2` (bundled) or `tiny` (tests)."""
    policy: SFTPolicy = field(default_factory=SFTPolicy)
    """Engine backend and its sections (`policy.engine=megatron`, `policy.scheduler.name=cosine`,
    `policy.lora.rank=8`, `policy.parallel.tensor=2`)."""
    data: SFTData = field(default_factory=SFTData)
    """Conversations."""
    train: SFTTrain = field(default_factory=SFTTrain)
    """Loop."""
    resources: ResourcesSection = field(default_factory=ResourcesSection)
    """Ray placement."""

    def __post_init__(self) -> None:
        check_trainable_attention(self.model, self.resources)
        for pool in ("rollout", "ref", "critic", "reward"):
            section = getattr(self.resources, pool)
            if section != type(section)():
                raise ConfigError(
                    f"resources.{pool}={section}: SFT trains one policy on the colocated ranks "
                    f"(resources.world_size) and has no {pool} pool; remove resources.{pool}.* "
                    "from the SFT config (the pool is the RL trainer's, apps/ppo)"
                )
        dp = self.policy.parallel.data_parallel_size(self.resources.world_size)
        if self.train.sequences_per_step % dp:
            raise ConfigError(
                f"train.sequences_per_step={self.train.sequences_per_step} must be a multiple "
                f"of the data-parallel size {dp}"
            )
        budget = self.policy.micro_batch.max_tokens_per_microbatch
        if self.data.max_seq_tokens > budget:
            raise ConfigError(
                f"data.max_seq_tokens={self.data.max_seq_tokens} exceeds "
                f"policy.micro_batch.max_tokens_per_microbatch={budget}"
            )
