"""The order in which a step's training batch goes to the data-parallel ranks, and the calls
that send it in that order and put per-row results back in the batch's own order."""

from __future__ import annotations

from typing import Any

import torch
from tensordict import TensorDict

from tephra.controller.cluster.worker_group import WorkerGroup
from tephra.controller.step.balance import balanced_order, max_over_min
from tephra.engine_api.batch import KEEP_TOGETHER, units


def check_units_whole(groups: list[range], rows: int, shares: int) -> None:
    """Refuse a batch whose units of rows (`KEEP_TOGETHER`) the contiguous split into
    `shares` equal parts (data-parallel ranks x mini-batches) would cut: every unit must
    have the same size, and the units must split evenly."""
    if len(groups) == rows:
        return
    sizes = {len(u) for u in groups}
    if len(sizes) > 1 or len(groups) % shares:
        raise ValueError(
            f"the batch's {len(groups)} units of rows ({KEEP_TOGETHER}, sizes {sorted(sizes)}) "
            f"do not split whole into {shares} data-parallel shares x mini-batches; make "
            "the pairs per step a multiple of the data-parallel size x batch.mini_batches"
        )


class BatchOrder:
    """One step's row order for the actor's data-parallel ranks (`trainer.balance_batch`)."""

    def __init__(self) -> None:
        self.order: torch.Tensor | None = None
        """The step's row order for the data-parallel ranks (None: as it is)."""
        self.inverse: torch.Tensor | None = None
        """Its inverse, which puts per-row results back in the batch's order."""

    def plan(
        self, batch: TensorDict, dp: int, balance: bool, mini_batches: int
    ) -> dict[str, float]:
        """Choose the order in which this step's training batch goes to `dp` data-parallel
        ranks (`balance`: token-balanced within each of `mini_batches`,
        `tephra.controller.step.balance`); returns the `balance/*` metrics (several data-parallel
        ranks only)."""
        self.order = self.inverse = None
        groups = units(batch)
        check_units_whole(groups, batch.batch_size[0], dp * mini_batches)
        if dp == 1:
            return {}
        tokens = batch["attention_mask"].sum(-1).tolist()
        before = max_over_min(tokens, None, dp)
        if balance:
            # balance whole units (rows that share a micro-batch, `KEEP_TOGETHER`)
            per_unit = [sum(tokens[r] for r in u) for u in groups]
            unit_order = balanced_order(per_unit, dp, mini_batches)
            self.order = torch.tensor([r for u in unit_order for r in groups[u]])
            self.inverse = torch.argsort(self.order)
        return {
            "balance/max_over_min_tokens_before": before,
            "balance/max_over_min_tokens_after": max_over_min(
                tokens, self.order.tolist() if self.order is not None else None, dp
            ),
        }

    def call(
        self, group: WorkerGroup, ordered: bool, method: str, batch: TensorDict, **options: Any
    ) -> Any:
        """A `DP_SPLIT` call of `batch` on `group`, in the planned order when `ordered` (the
        actor's group) and the batch is the step's; per-row results come back in the batch's
        own order. Another batch (the mismatch probe's rows) goes as it is. `options`
        (scalars: every rank gets them whole) go to the method as keywords."""
        if self.order is None or not ordered or batch.batch_size[0] != len(self.order):
            return group.call(method, batch, **options)
        out = group.call(method, batch[self.order], **options)
        return out[self.inverse] if isinstance(out, TensorDict) else out
