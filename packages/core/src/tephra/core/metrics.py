"""How a loss function's metrics add up over a mini-batch's micro-batches and ranks.

An engine calls the loss function once per micro-batch and reduces what it returns over the
micro-batches and data-parallel ranks of one `forward_backward`. A metric is averaged there
(an entropy, a clip fraction: each micro-batch's own mean), unless the loss function returns
it as a `Share`: this micro-batch's part of a step total, such as a loss aggregated with the
step's global normalisers (`tephra.algos.aggregate_loss`), whose parts add up to the total.
Averaging those would report the total divided by the number of micro-batches and ranks."""

from __future__ import annotations

from collections.abc import Mapping, Set


class Share(float):
    """A metric value that is one micro-batch's share of a step total: engines add the
    shares of a `forward_backward` call's micro-batches and ranks instead of averaging."""


def shares_of(metrics: Mapping[str, float]) -> set[str]:
    """The names of the metrics returned as a `Share`."""
    return {name for name, value in metrics.items() if isinstance(value, Share)}


def reduce_metrics(sums: Mapping[str, float], shares: Set[str], count: float) -> dict[str, float]:
    """Metrics summed over `count` micro-batches (all ranks): a share stays the sum, every
    other metric becomes the mean over the micro-batches."""
    return {name: v if name in shares else v / max(count, 1.0) for name, v in sums.items()}
