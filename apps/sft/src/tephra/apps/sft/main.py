"""`uv run apps/sft [--preset NAME] [key=value ...]`: supervised fine-tuning on chats.

The loss is the mean negative log-likelihood of assistant tokens only:
    loss = - sum_{b,t} m[b,t] log p(x[b,t] | x[b,<t]) / sum_{b,t} m[b,t]
with m the assistant mask, summed over every micro-batch and rank of a step.
"""

from __future__ import annotations

import json
import random
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

import torch
import yaml
from tensordict import TensorDict
from transformers import AutoConfig, AutoTokenizer

from tephra.apps.sft.chat_data import (
    arithmetic_conversations,
    colour_square_conversations,
    load_conversations,
    load_image_conversations,
    pad_batch,
    tokenize_conversation,
    tool_call_conversations,
)
from tephra.apps.sft.cli import HELP
from tephra.apps.sft.config import SFTConfig
from tephra.controller.cluster.dispatch import Dispatch, dispatch
from tephra.controller.cluster.worker_group import (
    DataParallelInfo,
    ResourcePool,
    Worker,
    WorkerGroup,
    ray_init,
)
from tephra.controller.run.checkpoints import CheckpointManager
from tephra.controller.run.models import resolve_model_path
from tephra.controller.run.trackers import Trackers
from tephra.core.app_help import answer_help, split_print_config
from tephra.core.config import load_config, split_cli, to_dict
from tephra.core.errors import ConfigError, tephra_cause
from tephra.engine_api.multimodal import is_vision_config
from tephra.engine_api.registry import get_engine
from tephra.rollout.multimodal import VisionProcessor

PRESETS = Path(__file__).parent / "presets"


def nll_loss(outputs: TensorDict, batch: TensorDict) -> tuple[torch.Tensor, dict[str, float]]:
    """This micro-batch's share of the step's token-mean NLL over assistant tokens."""
    mask = batch["response_mask"].float()
    total = -(outputs["log_probs"] * mask).sum() / batch["global_token_count"][0]
    return total, {"nll_sum": float(-(outputs["log_probs"].detach() * mask).sum())}


class SFTWorker(Worker):
    def __init__(
        self, rank: int, world_size: int, *worker_args: Any, cfg: SFTConfig, model_path: str
    ) -> None:
        super().__init__(rank, world_size, *worker_args)

        model = replace(cfg.model, path=model_path)
        device = getattr(self, "device", "cpu")
        self.engine = get_engine(
            cfg.policy.engine,
            cfg.policy.engine_config(
                model,
                "policy",
                1.0,
                cfg.data.seed,
                device="cuda" if device.startswith("cuda") else "cpu",
            ),
        )

    def dp_info(self) -> DataParallelInfo:
        e = self.engine
        return DataParallelInfo(
            dp_rank=e.dp_rank, dp_size=e.dp_size, is_output_rank=e.is_dp_output_rank
        )

    @dispatch(Dispatch.DP_SPLIT)
    def train_step(self, batch: TensorDict) -> dict[str, float]:
        with self.engine.train_mode():
            metrics = dict(self.engine.forward_backward(batch, nll_loss))
            metrics["grad_norm"] = float(self.engine.optimizer_step())
            metrics["lr"] = float(self.engine.lr_scheduler_step())
        return metrics

    @dispatch(Dispatch.DP_SPLIT)
    def nll(self, batch: TensorDict) -> TensorDict:
        """Per-sequence summed NLL of assistant tokens (for evaluation)."""
        with self.engine.eval_mode():
            out = self.engine.forward(batch)
        nll = -(out["log_probs"] * batch["response_mask"]).sum(-1)
        return TensorDict({"nll": nll}, batch_size=batch.batch_size)

    @dispatch(Dispatch.BROADCAST)
    def save_checkpoint(self, folder: str) -> None:
        self.engine.save_checkpoint(Path(folder) / "policy")

    @dispatch(Dispatch.BROADCAST)
    def load_checkpoint(self, folder: str) -> None:
        self.engine.load_checkpoint(Path(folder) / "policy")

    @dispatch(Dispatch.RANK_ZERO)
    def export_hf(self, folder: str) -> str:
        self.engine.export_hf(folder)
        return folder


def validation_loss(wg: Any, examples: list, pad: int) -> float:
    """Token-mean NLL of the assistant tokens of `examples` (padded to the DP size)."""

    rows = list(examples)
    extra = (-len(rows)) % wg.dp_size
    batch = pad_batch(rows + rows[:extra], pad)
    nll = wg.nll(batch)["nll"][: len(rows)]
    return float(nll.sum()) / float(batch["response_mask"][: len(rows)].sum())


def load_examples(cfg: SFTConfig, tok: Any, model_path: str) -> tuple[list, list]:
    """(training, held-out) tokenized conversations of `cfg.data`; those longer than
    data.max_seq_tokens are dropped, and without data.val_files the last data.val_size are
    held out. Fails before Ray starts."""

    d = cfg.data
    # (ids, mask) pairs, or (ids, mask, images) triples for data with images
    train: list[Any]
    val: list[Any]
    if d.source == "colour_squares":
        train = colour_square_conversations(d.size, d.seed, vision_processor(cfg, model_path))
        val = []
    elif d.images:
        if not d.train_files:
            raise ConfigError(
                "data.images=true needs data.train_files (verl multimodal rows: "
                "messages and images)"
            )
        processor = vision_processor(cfg, model_path)

        def read(files: list[str]) -> list:
            return [e for f in files for e in load_image_conversations(f, processor)]

        train, val = read(d.train_files), read(d.val_files)
    else:
        if d.source == "tool_calls":
            convs = tool_call_conversations(d.size, d.seed)
        elif d.train_files:
            convs = [c for f in d.train_files for c in load_conversations(f)]
        else:
            convs = arithmetic_conversations(d.size, d.seed)
        val_convs = [c for f in d.val_files for c in load_conversations(f)]
        train = [tokenize_conversation(tok, c, i) for i, c in enumerate(convs)]
        val = [tokenize_conversation(tok, c, i) for i, c in enumerate(val_convs)]

    def fit(examples: list) -> list:
        return [e for e in examples if len(e[0]) <= d.max_seq_tokens]

    dropped = len(train) + len(val)
    train, val = fit(train), fit(val)
    dropped -= len(train) + len(val)
    if dropped:
        print(
            f"dropped {dropped} conversations longer than data.max_seq_tokens={d.max_seq_tokens}",
            flush=True,
        )
    if not d.val_files:
        cut = max(len(train) - d.val_size, 0)
        train, val = train[:cut], train[cut:]
    if not train:
        raise ConfigError(
            "no training conversation is left (after data.val_size held out and "
            "long ones dropped); add data or lower data.val_size"
        )
    return train, val


def run(cfg: SFTConfig) -> dict:  # noqa: PLR0915 (older than the limit; to split)
    t0 = time.perf_counter()
    path = resolve_model_path(cast(str, cfg.model.path))  # validated: set for SFT
    tok = AutoTokenizer.from_pretrained(path)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    train, val = load_examples(cfg, tok, path)
    d = cfg.data
    run_dir = Path(cfg.train.run_dir).expanduser().resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    r = cfg.resources
    ray_init(r.ray_address, r.num_cpus)
    pool = ResourcePool(
        r.world_size,
        r.cpus_per_rank,
        r.gpus_per_rank,
        strategy=r.placement,
        retain_freed_memory=r.retain_freed_memory,
        memory_per_rank_gb=r.memory_per_rank_gb,
    )
    try:
        wg = WorkerGroup(SFTWorker, pool, {"cfg": cfg, "model_path": path}, name="sft")
    except BaseException:
        pool.release()
        raise
    ckpt = CheckpointManager(run_dir / "checkpoints", cfg.train.keep_checkpoints)
    trackers = Trackers(cfg.train.trackers, run_dir, "tephra-sft", run_dir.name, to_dict(cfg))
    rng = random.Random(d.seed)
    order: list[int] = []
    step = 0
    latest = ckpt.resolve("auto" if cfg.train.resume else "off")
    try:
        if latest is not None:
            state = ckpt.load_trainer_state(latest)
            wg.load_checkpoint(str(latest))
            step, order = int(state["step"]), list(state["order"])
            rng.setstate(_rng_state(state["rng"]))
            print(f"resumed from {latest} at step {step}", flush=True)
        loss_before = validation_loss(wg, val, pad) if val else None
        n = cfg.train.sequences_per_step
        while step < cfg.train.steps:
            if len(order) < n:
                extra = list(range(len(train)))
                rng.shuffle(extra)
                order += extra
            idx, order = order[:n], order[n:]
            metrics = wg.train_step(pad_batch([train[i] for i in idx], pad))
            step += 1
            if val and cfg.train.val_every and step % cfg.train.val_every == 0:
                metrics["val/loss"] = validation_loss(wg, val, pad)
            trackers.log(metrics, step)
            if cfg.train.save_every and step % cfg.train.save_every == 0:
                wg.save_checkpoint(str(ckpt.begin(step)))
                ckpt.commit(step, {"order": order, "rng": _rng_json(rng.getstate())})
        loss_after = validation_loss(wg, val, pad) if val else None
        if loss_after is not None:
            trackers.log({"val/loss": loss_after}, step)
        if cfg.train.export_hf:
            wg.export_hf(str(run_dir / "hf"))
    finally:
        trackers.close()
        wg.shutdown()
        pool.release()
    summary = {
        "loss_before": loss_before,
        "loss_after": loss_after,
        "steps": step,
        "seconds": round(time.perf_counter() - t0, 1),
        "run_dir": str(run_dir),
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def vision_processor(cfg: SFTConfig, model_path: str) -> VisionProcessor:
    """The image processor of `model_path` (a vision-language model), for data with images;
    refuses what cannot train on images, before Ray starts."""

    what = (
        "data.source=colour_squares" if cfg.data.source == "colour_squares" else "data.images=true"
    )
    if cfg.policy.engine != "fsdp":
        raise ConfigError(
            f"{what} with policy.engine={cfg.policy.engine!r}: only the fsdp "
            "engine trains vision-language models; set policy.engine=fsdp"
        )
    if not is_vision_config(AutoConfig.from_pretrained(model_path)):
        raise ConfigError(
            f"{what} but model.path={cfg.model.path!r} is a text-only model; use "
            "a vision-language model (Qwen2-VL family or LLaVA, or tiny_vlm)"
        )
    return VisionProcessor.from_pretrained(model_path)


def _rng_json(state: tuple) -> list:
    return [state[0], list(state[1]), state[2]]


def _rng_state(data: list) -> tuple:
    return (data[0], tuple(data[1]), data[2])


def parse_config(argv: list[str]) -> SFTConfig:
    presets, overrides = split_cli(argv)
    return load_config(SFTConfig, presets, overrides, preset_dir=PRESETS)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if answer_help(argv, HELP):
        return
    print_only, argv = split_print_config(argv)
    try:
        cfg = parse_config(argv)
        if print_only:
            print(yaml.safe_dump(to_dict(cfg), sort_keys=False), end="", flush=True)
            return
        summary = run(cfg)
    except Exception as exc:  # a worker's TephraError arrives wrapped by Ray
        cause = tephra_cause(exc)
        if cause is None:
            raise
        print(f"error: {cause}", file=sys.stderr)
        raise SystemExit(2) from None
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
