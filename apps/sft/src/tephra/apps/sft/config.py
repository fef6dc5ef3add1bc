"""SFT configuration."""

from __future__ import annotations

from dataclasses import dataclass, field

from tephra.engine_api.errors import ConfigError


@dataclass
class SFTModel:
    path: str = "smollm2"
    """Hugging Face folder; `smollm2` (bundled) or `tiny` (tests) as in apps/ppo."""
    dtype: str = "bfloat16"
    """Compute dtype."""
    lora_rank: int = 0
    """LoRA rank (0: full fine-tuning)."""


@dataclass
class SFTData:
    train_files: list[str] = field(default_factory=list)
    """Parquet or jsonl files with a `messages` column; empty: generated arithmetic chats."""
    size: int = 256
    """Number of generated conversations when train_files is empty."""
    seed: int = 0
    """Seed of the generated conversations and of the data order."""
    max_seq_tokens: int = 512
    """Conversations longer than this are dropped (and counted)."""


@dataclass
class SFTTrain:
    steps: int = 20
    """Optimizer steps."""
    sequences_per_step: int = 8
    """Conversations per optimizer step (global)."""
    max_tokens_per_microbatch: int = 4096
    """Token budget of a micro-batch on one rank."""
    lr: float = 1e-4
    """Peak learning rate."""
    run_dir: str = "runs/sft"
    """Metrics and export go here."""
    export_hf: bool = True
    """Write run_dir/hf at the end."""
    trackers: list[str] = field(default_factory=lambda: ["console", "jsonl"])
    """Metric sinks."""


@dataclass
class SFTResources:
    world_size: int = 1
    """Data-parallel ranks."""
    cpus_per_rank: float = 2.0
    """CPUs per rank."""
    ray_address: str | None = None
    """Ray cluster address (None: local)."""


@dataclass
class SFTConfig:
    model: SFTModel = field(default_factory=SFTModel)
    """Model."""
    data: SFTData = field(default_factory=SFTData)
    """Conversations."""
    train: SFTTrain = field(default_factory=SFTTrain)
    """Loop."""
    resources: SFTResources = field(default_factory=SFTResources)
    """Ray placement."""

    def __post_init__(self) -> None:
        if self.train.sequences_per_step % self.resources.world_size:
            raise ConfigError(
                f"train.sequences_per_step={self.train.sequences_per_step} must be a multiple "
                f"of resources.world_size={self.resources.world_size}")
        if self.data.max_seq_tokens > self.train.max_tokens_per_microbatch:
            raise ConfigError(
                f"data.max_seq_tokens={self.data.max_seq_tokens} exceeds "
                f"train.max_tokens_per_microbatch={self.train.max_tokens_per_microbatch}")
