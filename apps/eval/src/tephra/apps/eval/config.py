"""The evaluation app's configuration: the same sections as the RL trainer's where they mean
the same (model, data, rollout, reward), plus the validation settings and where to write."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from tephra.controller.config.tree import DataSection
from tephra.controller.data.swe_tasks import check_swe_setup
from tephra.controller.run.evaluation import ValidationConfig
from tephra.core.config import load_config, split_cli
from tephra.engine_api.config import ModelConfig
from tephra.episodes.config import EpisodeRolloutConfig
from tephra.episodes.rewards import RewardConfig

PRESETS = Path(__file__).parent / "presets"


@dataclass
class EvalConfig:
    """Evaluate a model folder, or a run's export and checkpoints."""

    model: ModelConfig = field(default_factory=lambda: ModelConfig(path="smollm2"))
    """The model to evaluate (ignored with `run_dir`): a local Hugging Face folder, `smollm2`
    (the bundled SmolLM2-135M-Instruct, the demo's starting point) or `tiny`."""
    run_dir: str | None = None
    """A trainer's run folder: its `hf/` export and every checkpoint under `checkpoints/`
    (exported to Hugging Face folders first) are evaluated, and a plot across steps drawn."""
    start_model: bool = True
    """With `run_dir`: also evaluate the model the run started from (the `model.path` of the
    run's `config.yaml`) as step 0, so the curve shows the change RL made, not only the change
    between checkpoints. One more model to evaluate; false skips it."""
    data: DataSection = field(
        default_factory=lambda: DataSection(
            source="reasoning_gym",
            task="basic_arithmetic",
            task_config={
                "min_terms": 2,
                "max_terms": 2,
                "min_digits": 1,
                "max_digits": 1,
                "allow_negation": False,
                "allow_parentheses": False,
                "operators": ["+", "-", "*"],
            },
            instruction="Answer with just the final number.",
        )
    )
    """Held-out prompts: by default the held-out items of apps/ppo's demo (its `default`
    preset's reasoning-gym task, seed `val_seed`), so that a demo run's models are evaluated
    on the items it validated on; `data.source=parquet data.val_files=[...]` for others."""
    rollout: EpisodeRolloutConfig = field(default_factory=EpisodeRolloutConfig)
    """Generation backend and its settings (`hf`, `vllm`, `sglang`), dtype, max_tokens."""
    val: ValidationConfig = field(
        default_factory=lambda: ValidationConfig(n=4, temperature=1.0, ks=[1, 2, 4])
    )
    """Samples per prompt, temperature, top_p, and the k of pass@k / maj@k."""
    reward: RewardConfig = field(default_factory=lambda: RewardConfig(executor="serial"))
    """Scoring: rule scorers by data_source, a custom function, or a reward model."""
    out_dir: str = "runs/eval"
    """Where eval.json, eval.md, generations_<model>.jsonl and curves.png go."""
    reuse: bool = True
    """Keep a model's numbers from `out_dir/eval.json` instead of evaluating it again when its
    folder's files (names, sizes, modification times) and every setting that changes the
    numbers (data, rollout, val, reward, seed) are the same: evaluating a run while it trains
    only evaluates the checkpoints that are new since the last time. False evaluates all."""
    seed: int = 0
    """Seed of the sampling."""


def parse_config(argv: list[str]) -> EvalConfig:
    presets, overrides = split_cli(argv)
    cfg = load_config(EvalConfig, presets, overrides, preset_dir=PRESETS)
    if cfg.data.source == "swe_tasks":
        check_swe_setup(cfg.rollout.agent_loop, cfg.rollout.agent.environment)
    return cfg
