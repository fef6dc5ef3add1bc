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
from pathlib import Path

import torch
from tensordict import TensorDict

from tephra.apps.sft.config import SFTConfig
from tephra.core.config import load_config, split_cli
from tephra.controller.dispatch import Dispatch, dispatch
from tephra.controller.worker_group import Worker
from tephra.engine_api.errors import TephraError

PRESETS = Path(__file__).parent / "presets"


def nll_loss(outputs: TensorDict, batch: TensorDict):
    """This micro-batch's share of the step's token-mean NLL over assistant tokens."""
    mask = batch["response_mask"].float()
    total = -(outputs["log_probs"] * mask).sum() / batch["global_token_count"][0]
    return total, {"nll_sum": float(-(outputs["log_probs"].detach() * mask).sum())}


class SFTWorker(Worker):
    def __init__(self, rank, world_size, master_addr, master_port, threads, engine_name, engine_cfg):
        super().__init__(rank, world_size, master_addr, master_port, threads)
        from tephra.engine_api.registry import get_engine

        self.engine = get_engine(engine_name, engine_cfg)

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

    @dispatch(Dispatch.RANK_ZERO)
    def export_hf(self, folder: str) -> str:
        self.engine.export_hf(folder)
        return folder


def run(cfg: SFTConfig) -> dict:
    from transformers import AutoTokenizer

    from tephra.apps.ppo.models import resolve_model_path
    from tephra.apps.sft.chat_data import (
        arithmetic_conversations,
        load_conversations,
        pad_batch,
        tokenize_conversation,
    )
    from tephra.controller.trackers import Trackers
    from tephra.controller.worker_group import ResourcePool, WorkerGroup, ray_init
    from tephra.engine_api.config import (
        EngineConfig,
        LoraConfig,
        MicroBatchConfig,
        ModelConfig,
        OptimizerConfig,
        PrecisionConfig,
    )

    t0 = time.perf_counter()
    path = resolve_model_path(cfg.model.path)
    tok = AutoTokenizer.from_pretrained(path)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    convs = ([c for f in cfg.data.train_files for c in load_conversations(f)]
             if cfg.data.train_files else arithmetic_conversations(cfg.data.size, cfg.data.seed))
    examples = [tokenize_conversation(tok, c, i) for i, c in enumerate(convs)]
    kept = [e for e in examples if len(e[0]) <= cfg.data.max_seq_tokens]
    if len(kept) < len(examples):
        print(f"dropped {len(examples) - len(kept)} conversations longer than "
              f"data.max_seq_tokens={cfg.data.max_seq_tokens}", flush=True)
    engine_cfg = EngineConfig(
        model=ModelConfig(path=path),
        optimizer=OptimizerConfig(lr=cfg.train.lr, weight_decay=0.0),
        micro_batch=MicroBatchConfig(max_tokens_per_microbatch=cfg.train.max_tokens_per_microbatch),
        precision=PrecisionConfig(param_dtype=cfg.model.dtype),
        lora=LoraConfig(rank=cfg.model.lora_rank), compute_entropy=False, device="auto")
    run_dir = Path(cfg.train.run_dir).expanduser().resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    r = cfg.resources
    ray_init(r.ray_address)
    wg = WorkerGroup(SFTWorker, ResourcePool(r.world_size, r.cpus_per_rank),
                     {"engine_name": "fsdp", "engine_cfg": engine_cfg}, name="sft")
    trackers = Trackers(cfg.train.trackers, run_dir, "tephra-sft", run_dir.name, {})
    rng = random.Random(cfg.data.seed)
    order: list[int] = []
    n = cfg.train.sequences_per_step
    # held-out-free progress measure: the NLL of a fixed probe batch before and after
    probe = pad_batch(kept[: max(n, r.world_size)], pad)
    tokens = float(probe["response_mask"].sum())
    loss_before = float(wg.nll(probe)["nll"].sum()) / tokens
    try:
        for step in range(1, cfg.train.steps + 1):
            if len(order) < n:
                extra = list(range(len(kept)))
                rng.shuffle(extra)
                order += extra
            idx, order = order[:n], order[n:]
            metrics = wg.train_step(pad_batch([kept[i] for i in idx], pad))
            trackers.log(metrics, step)
        loss_after = float(wg.nll(probe)["nll"].sum()) / tokens
        if cfg.train.export_hf:
            wg.export_hf(str(run_dir / "hf"))
    finally:
        trackers.close()
        wg.shutdown()
    summary = {"loss_before": loss_before, "loss_after": loss_after, "steps": cfg.train.steps,
               "seconds": round(time.perf_counter() - t0, 1), "run_dir": str(run_dir)}
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def parse_config(argv: list[str]) -> SFTConfig:
    presets, overrides = split_cli(argv)
    return load_config(SFTConfig, presets, overrides, preset_dir=PRESETS)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    try:
        summary = run(parse_config(argv))
    except TephraError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
