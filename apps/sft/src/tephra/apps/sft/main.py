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

import ray
import torch
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
from tephra.controller.cluster.stop import StopNow, StopSignal
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
from tephra.core.app_help import app_main
from tephra.core.config import load_config, split_cli, to_dict
from tephra.core.errors import ConfigError
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


def run(cfg: SFTConfig) -> dict:
    """Train as `cfg` says; returns the summary (also written to run_dir/summary.json).

    The first SIGINT / SIGTERM stops after the step in progress, checkpointed when checkpoints
    are on (`train.save_every`); a second one stops at once. Either way the summary says
    `"status": "stopped"` and the app exits 130 / 143."""
    t0 = time.perf_counter()
    path = resolve_model_path(cast(str, cfg.model.path))  # validated: set for SFT
    tok = AutoTokenizer.from_pretrained(path)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    train, val = load_examples(cfg, tok, path)
    run_dir = Path(cfg.train.run_dir).expanduser().resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    r = cfg.resources
    owns_ray = not ray.is_initialized()
    ray_init(r.ray_address, r.num_cpus)
    stop = StopSignal()
    ckpt = CheckpointManager(run_dir / "checkpoints", cfg.train.keep_checkpoints)
    loop = SFTLoop(cfg, ckpt, random.Random(cfg.data.seed))
    try:
        with stop.installed():
            summary = train_and_export(cfg, path, run_dir, loop, (train, val, pad), stop)
    except StopNow:  # a second signal: the workers were stopped on the way out
        summary = {"steps": loop.step}
    finally:
        if stop.requested and owns_ray:  # the process exits on the signal: Ray's exit hook
            ray.shutdown()  # would stop its daemons too late
    if stop.requested:
        latest = ckpt.latest()
        summary = stop.summary(summary["steps"], latest)
        print(
            f"stopped by {stop.name} after step {summary['steps']} of {cfg.train.steps}"
            + (f"; the same command resumes from {latest}" if latest else ""),
            flush=True,
        )
    else:
        summary = {"status": "completed", **summary}
    summary |= {"seconds": round(time.perf_counter() - t0, 1), "run_dir": str(run_dir)}
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def train_and_export(
    cfg: SFTConfig,
    path: str,
    run_dir: Path,
    loop: SFTLoop,
    data: tuple[list, list, int],
    stop: StopSignal,
) -> dict:
    """The worker group's life: resume, the steps (until done or `stop` is asked), the
    validation losses and the export; `steps` and the losses of the run. `data`: the
    training and held-out examples and the pad token id."""
    train, val, pad = data
    r = cfg.resources
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
    trackers = Trackers(cfg.train.trackers, run_dir, "tephra-sft", run_dir.name, to_dict(cfg))
    try:
        loop.resume(wg)
        loss_before = validation_loss(wg, val, pad) if val else None
        loop.train(wg, data, trackers, stop)
        if stop.requested:
            return {"steps": loop.step}
        loss_after = validation_loss(wg, val, pad) if val else None
        if loss_after is not None:
            trackers.log({"val/loss": loss_after}, loop.step)
        if cfg.train.export_hf:
            wg.export_hf(str(run_dir / "hf"))
    finally:
        trackers.close()
        try:  # a second signal while the workers exit: Ray's shutdown kills them
            wg.shutdown(grace_s=0.0 if stop.immediate else 10.0)
        finally:
            pool.release()
    return {"loss_before": loss_before, "loss_after": loss_after, "steps": loop.step}


class SFTLoop:
    """The step counter, the data order and its random state, and their checkpoints."""

    def __init__(self, cfg: SFTConfig, ckpt: CheckpointManager, rng: random.Random) -> None:
        self.cfg, self.ckpt, self.rng = cfg, ckpt, rng
        self.step, self.saved_at = 0, 0
        self.order: list[int] = []

    def resume(self, wg: Any) -> None:
        latest = self.ckpt.resolve("auto" if self.cfg.train.resume else "off")
        if latest is None:
            return
        state = self.ckpt.load_trainer_state(latest)
        wg.load_checkpoint(str(latest))
        self.step, self.order = int(state["step"]), list(state["order"])
        self.saved_at = self.step
        self.rng.setstate(_rng_state(state["rng"]))
        print(f"resumed from {latest} at step {self.step}", flush=True)

    def save(self, wg: Any) -> None:
        wg.save_checkpoint(str(self.ckpt.begin(self.step)))
        self.ckpt.commit(self.step, {"order": self.order, "rng": _rng_json(self.rng.getstate())})
        self.saved_at = self.step

    def train(
        self, wg: Any, data: tuple[list, list, int], trackers: Trackers, stop: StopSignal
    ) -> None:
        """Steps until `train.steps`, or until `stop` is asked: then the last completed step
        is checkpointed when checkpoints are on and it is not saved yet."""
        train, val, pad = data
        t = self.cfg.train
        n = t.sequences_per_step
        while self.step < t.steps and not stop.requested:
            if len(self.order) < n:
                extra = list(range(len(train)))
                self.rng.shuffle(extra)
                self.order += extra
            idx, self.order = self.order[:n], self.order[n:]
            metrics = wg.train_step(pad_batch([train[i] for i in idx], pad))
            self.step += 1
            if val and t.val_every and self.step % t.val_every == 0:
                metrics["val/loss"] = validation_loss(wg, val, pad)
            trackers.log(metrics, self.step)
            if t.save_every and self.step % t.save_every == 0:
                self.save(wg)
        if stop.requested and t.save_every and self.step > self.saved_at:
            self.save(wg)


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
    app_main(sys.argv[1:] if argv is None else argv, HELP, parse_config, to_dict, run)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
