"""The loss-function protocol shared by every engine and every algorithm."""

from __future__ import annotations

from typing import Protocol

import torch
from tensordict import TensorDict

from tephra.core.metrics import Share, reduce_metrics, shares_of

__all__ = ["LossFn", "Share", "reduce_metrics", "shares_of"]


class LossFn(Protocol):
    """`loss_fn(outputs, batch) -> (loss, metrics)`.

    outputs: what `Engine.forward` returns for this micro-batch, with a graph
        (`log_probs`, `entropy` or `values`, `[b, t]`).
    batch: the micro-batch (`[b, t]`), including `global_token_count` and
        `global_seq_count` (`[b]`, the same value in every row): the normalisers of the
        whole step over all micro-batches and data-parallel ranks.
    returns: a scalar tensor, this micro-batch's contribution to the step's loss (so that
        the sum over micro-batches and ranks is the loss), and float metrics. The engine
        averages each metric over the micro-batches and ranks of the call, except a `Share`
        (this micro-batch's part of a step total, e.g. a loss term aggregated with the
        global normalisers), which it adds up.
    """

    def __call__(
        self, outputs: TensorDict, batch: TensorDict
    ) -> tuple[torch.Tensor, dict[str, float]]: ...
