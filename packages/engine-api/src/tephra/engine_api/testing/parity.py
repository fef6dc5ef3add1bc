"""Cross-backend parity: the same model and batch through any registered engine.

`first_steps(engine_name, config, batch, steps)` runs on every rank of a group (or in one
process) and returns the loss and grad norm of each step, so two backends can be compared
number for number: `run_distributed(first_steps, 2, args=("megatron", cfg, batch, 2))`.
"""

from __future__ import annotations

import torch
from tensordict import TensorDict

from tephra.engine_api import batch as B
from tephra.engine_api.config import EngineConfig
from tephra.engine_api.engine import Engine
from tephra.engine_api.registry import get_engine
from tephra.engine_api.testing.batches import nll_loss_fn


def first_steps(
    engine_name: str, config: EngineConfig, batch: TensorDict, steps: int = 1
) -> list[tuple[float, float]]:
    """(loss, grad norm) of `steps` optimizer steps of the token-mean NLL on `batch`.

    Each rank trains on its data-parallel share (contiguous equal chunks).
    """
    return _steps(get_engine(engine_name, config), batch, steps)


def _steps(engine: Engine, batch: TensorDict, steps: int) -> list[tuple[float, float]]:
    n, size = batch.batch_size[0], engine.dp_size
    share = B.trim_padding(batch[engine.dp_rank * n // size : (engine.dp_rank + 1) * n // size])
    out = []
    for _ in range(steps):
        with engine.train_mode():
            loss = engine.forward_backward(share, nll_loss_fn)["loss"]
            grad_norm = engine.optimizer_step()
            engine.lr_scheduler_step()
        out.append((float(loss), float(grad_norm)))
    return out


def adapter_steps(
    engine_name: str, config: EngineConfig, batch: TensorDict, steps: int, adapter_dir: str
) -> tuple[list[tuple[float, float]], dict[str, torch.Tensor]]:
    """`first_steps` of a LoRA engine, then `export_adapter(adapter_dir)` (the same folder on
    every rank) and the merged weights the engine would send a rollout; returns
    (per-step (loss, grad norm), {HF name: merged weight}) so that two backends' adapters
    and merged models can be compared after the same steps."""
    engine = get_engine(engine_name, config)
    out = _steps(engine, batch, steps)
    engine.export_adapter(adapter_dir)
    merged = {n: t.detach().cpu().clone() for b in engine.export_weights() for n, t in b}
    return out, merged
