"""Cross-backend parity: the same model and batch through any registered engine.

`first_steps(engine_name, config, batch, steps)` runs on every rank of a group (or in one
process) and returns the loss and grad norm of each step, so two backends can be compared
number for number: `run_distributed(first_steps, 2, args=("megatron", cfg, batch, 2))`.
"""

from __future__ import annotations

from tensordict import TensorDict

from tephra.engine_api import batch as B
from tephra.engine_api.config import EngineConfig
from tephra.engine_api.registry import get_engine
from tephra.engine_api.testing.batches import nll_loss_fn


def first_steps(
    engine_name: str, config: EngineConfig, batch: TensorDict, steps: int = 1
) -> list[tuple[float, float]]:
    """(loss, grad norm) of `steps` optimizer steps of the token-mean NLL on `batch`.

    Each rank trains on its data-parallel share (contiguous equal chunks).
    """
    engine = get_engine(engine_name, config)
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
