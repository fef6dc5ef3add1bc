"""Loss aggregation: per-token losses [batch, seq] -> one scalar, with explicit normalisers.

A step's batch is split into micro-batches and across data-parallel ranks. Every mode here
divides by a GLOBAL normaliser (response tokens or sequences of the whole step), so each
call returns this micro-batch's contribution and

    sum over micro-batches and ranks of aggregate_loss(...) == aggregate_loss(full batch)

exactly, whatever the split. (Dividing by a per-micro-batch count, then averaging, weights
tokens of short micro-batches more; that bias is what the explicit normaliser removes.)

Modes, with m the response mask, L the per-token loss, n_b = sum_t m[b, t] the response
tokens of sequence b, N = global token count, S = global sequence count, C = norm constant:
    token-mean               sum_{b,t} m L / N
    token-sum                sum_{b,t} m L                      (no normaliser)
    seq-mean-token-sum       sum_b (sum_t m L) / S
    seq-mean-token-mean      sum_b (sum_t m L / n_b) / S
    seq-mean-token-sum-norm  sum_b (sum_t m L / C) / S          (Dr. GRPO, Liu et al. 2025)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from tephra.algos.errors import InputError
from tephra.algos.inputs import check_same_shape
from tephra.algos.masked import masked_count, masked_sum
from tephra.algos.registry import Registry

# (loss_mat [batch, seq], mask [batch, seq], step tokens [], step sequences [], norm_constant)
Aggregator = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float | None], torch.Tensor
]

AGGREGATION_MODES: Registry[Aggregator] = Registry("loss aggregation mode")


@AGGREGATION_MODES.register("token-mean")
def _token_mean(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    tokens: torch.Tensor,
    seqs: torch.Tensor,
    norm_constant: float | None,
) -> torch.Tensor:
    """Every response token of the step weighs the same (DAPO's token-level loss)."""
    return masked_sum(loss_mat, mask) / tokens


@AGGREGATION_MODES.register("token-sum")
def _token_sum(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    tokens: torch.Tensor,
    seqs: torch.Tensor,
    norm_constant: float | None,
) -> torch.Tensor:
    """The plain sum over the step's response tokens (verl's `token-sum`): the gradient grows
    with the batch's token count; pair it with a learning rate that expects that."""
    return masked_sum(loss_mat, mask)


@AGGREGATION_MODES.register("seq-mean-token-sum")
def _seq_mean_token_sum(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    tokens: torch.Tensor,
    seqs: torch.Tensor,
    norm_constant: float | None,
) -> torch.Tensor:
    """Sum over a sequence's tokens, mean over sequences (longer responses weigh more)."""
    return masked_sum(loss_mat, mask) / seqs


@AGGREGATION_MODES.register("seq-mean-token-mean")
def _seq_mean_token_mean(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    tokens: torch.Tensor,
    seqs: torch.Tensor,
    norm_constant: float | None,
) -> torch.Tensor:
    """Mean over a sequence's tokens, then mean over sequences (original GRPO)."""
    per_seq = masked_sum(loss_mat, mask, dim=-1)
    n = masked_count(mask, dim=-1).clamp(min=1).to(loss_mat.dtype)
    return (per_seq / n).sum() / seqs


@AGGREGATION_MODES.register("seq-mean-token-sum-norm")
def _seq_mean_token_sum_norm(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    tokens: torch.Tensor,
    seqs: torch.Tensor,
    norm_constant: float | None,
) -> torch.Tensor:
    """Token sum divided by a constant (not the sequence length), mean over sequences
    (Dr. GRPO: removes the length bias of seq-mean-token-mean)."""
    if norm_constant is None or norm_constant <= 0:
        raise InputError(
            f"norm_constant={norm_constant!r}: mode 'seq-mean-token-sum-norm' needs a positive "
            f"constant, e.g. the maximum response length in tokens"
        )
    return masked_sum(loss_mat, mask) / norm_constant / seqs


def _as_count(name: str, value: float | torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    t = torch.as_tensor(value, device=like.device)
    if t.numel() != 1:
        raise InputError(
            f"{name} must be a scalar (one number for the whole step), got shape "
            f"{tuple(t.shape)}; pass batch['{name}'][0]"
        )
    t = t.reshape(()).to(like.dtype)
    # Checking positivity of a device tensor would sync the device every micro-batch;
    # plain numbers are checked, tensors are trusted (engines compute them).
    if not isinstance(value, torch.Tensor) and not value > 0:
        raise InputError(
            f"{name}={value!r} must be > 0 (count over the whole step); use "
            f"global_normalisers(masks) to compute it"
        )
    return t


def aggregate_loss(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    *,
    global_token_count: float | torch.Tensor,
    global_seq_count: float | torch.Tensor,
    norm_constant: float | None = None,
) -> torch.Tensor:
    """This micro-batch's contribution to the step's loss.

    loss_mat: [batch, seq] per-token losses; mask: [batch, seq] response mask (1 = trained).
    global_token_count / global_seq_count: response tokens / sequences of the whole step
    over all micro-batches and ranks (`global_normalisers`). norm_constant: only for
    `seq-mean-token-sum-norm`. Returns a scalar; masked positions never contribute.
    """
    fn = AGGREGATION_MODES.get(mode)
    check_same_shape(loss_mat=loss_mat, mask=mask)
    if loss_mat.dtype in (torch.float16, torch.bfloat16):
        # A bf16 sum over thousands of tokens (or a bf16 token count: 12345 -> 12352) is off
        # by percents; reduce in float32.
        loss_mat = loss_mat.float()
    tokens = _as_count("global_token_count", global_token_count, loss_mat)
    seqs = _as_count("global_seq_count", global_seq_count, loss_mat)
    return fn(loss_mat, mask, tokens, seqs, norm_constant)


def global_normalisers(masks: Sequence[torch.Tensor]) -> tuple[float, float]:
    """(response tokens, sequences with at least one response token) over all the
    micro-batch masks of a step, for callers without an engine (an engine computes the same
    numbers across its ranks). Rows with no response token (padding rows) are not counted."""
    tokens = sum(int(masked_count(m)) for m in masks)
    seqs = sum(int(((m > 0).any(dim=-1)).sum()) for m in masks)
    if tokens == 0:
        raise InputError(
            "global_normalisers: the masks hold no response token; nothing to train on in this step"
        )
    return float(tokens), float(seqs)
