"""Tinker's datums as engine batches, and Tinker's built-in losses as engine loss functions.

A Tinker datum holds the model input x_0..x_{n-1} and, per input position i, the target
token y_i it predicts (the next token: y_i = x_{i+1} for i < n - 1) with loss inputs
aligned to the targets. The engine scores the tokens of one sequence, so the datum becomes
the row x_0..x_{n-1}, y_{n-1} with every target position (1..n) in the response mask, and
the engine's per-token log-prob at position i + 1 is log p(y_i | x_0..x_i).

Tinker's losses are sums over tokens (not means), so the engine's micro-batch losses here
are not divided by the step's token count:
- `cross_entropy`: L = -sum_i w_i log p(y_i | x_<=i)
- `importance_sampling`: L = -sum_i exp(log p(y_i) - log q(y_i)) A_i, q the sampler's
  log-probs (`logprobs`), A the advantages (`advantages`).
"""

from __future__ import annotations

import numpy as np
import torch
from tensordict import TensorDict

from tephra.apps.serve.errors import UserError
from tephra.apps.serve.wire import Datum
from tephra.engine_api import batch as B

WEIGHTS = "tinker_weights"
SAMPLER_LOG_PROBS = "tinker_sampler_logprobs"
ADVANTAGES = "tinker_advantages"

LOSS_INPUTS = {
    "cross_entropy": ("target_tokens", "weights"),
    "importance_sampling": ("target_tokens", "logprobs", "advantages"),
}
"""The losses served and the `loss_fn_inputs` each needs (`weights` defaults to ones)."""


def _column(datum: Datum, name: str, index: int, n: int) -> np.ndarray:
    if name not in datum.inputs:
        if name == "weights":
            return np.ones(n, dtype=np.float32)
        raise UserError(f"datum {index}: loss_fn_inputs has no {name!r}")
    value = datum.inputs[name].reshape(-1)
    if len(value) != n:
        raise UserError(
            f"datum {index}: loss_fn_inputs[{name!r}] has {len(value)} values for "
            f"{n} input tokens; give one per input token"
        )
    return value


def to_batch(data: list[Datum], loss_fn: str) -> TensorDict:
    """The engine batch (right-padded `[B, T]`) of `data` for `loss_fn`."""
    if loss_fn not in LOSS_INPUTS:
        raise UserError(
            f"forward_backward: loss_fn={loss_fn!r} is not served; tephra serve has "
            f"{sorted(LOSS_INPUTS)}"
        )
    if not data:
        raise UserError("forward_backward: no datums")
    rows, per_token = [], []
    for i, datum in enumerate(data):
        n = len(datum.tokens)
        if n == 0:
            raise UserError(f"datum {i}: model_input is empty")
        targets = _column(datum, "target_tokens", i, n).astype(np.int64)
        if list(targets[:-1]) != datum.tokens[1:]:
            raise UserError(
                f"datum {i}: target_tokens must be the next tokens of model_input "
                "(target_tokens[i] == model_input[i + 1]); the engine scores the tokens of "
                "one sequence"
            )
        rows.append([*datum.tokens, int(targets[-1])])
        fields = {WEIGHTS: _column(datum, "weights", i, n)}
        if loss_fn == "importance_sampling":
            fields[SAMPLER_LOG_PROBS] = _column(datum, "logprobs", i, n)
            fields[ADVANTAGES] = _column(datum, "advantages", i, n)
        per_token.append(fields)
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.int64)
    attn = torch.zeros_like(ids)
    resp = torch.zeros_like(ids)
    columns = {k: torch.zeros(len(rows), width) for k in per_token[0]}
    for r, (row, fields) in enumerate(zip(rows, per_token)):
        ids[r, : len(row)] = torch.tensor(row)
        attn[r, : len(row)] = 1
        resp[r, 1 : len(row)] = 1
        for k, v in fields.items():
            columns[k][r, 1 : len(row)] = torch.from_numpy(np.asarray(v, dtype=np.float32))
    return B.make_batch(ids, attn, resp, **columns)


def per_datum_log_probs(log_probs: torch.Tensor, batch: TensorDict) -> list[np.ndarray]:
    """Each datum's log p(y_i | x_<=i), i = 0..n-1, from the engine's `[B, T]` log-probs."""
    lengths = B.sequence_lengths(batch).tolist()
    return [log_probs[r, 1:n].detach().float().numpy() for r, n in enumerate(lengths)]


def cross_entropy(outputs: TensorDict, batch: TensorDict) -> tuple[torch.Tensor, dict]:
    mask = batch[B.RESPONSE_MASK].float()
    loss = -(outputs["log_probs"] * batch[WEIGHTS] * mask).sum()
    return loss, {}


def importance_sampling(outputs: TensorDict, batch: TensorDict) -> tuple[torch.Tensor, dict]:
    mask = batch[B.RESPONSE_MASK].float()
    ratio = torch.exp(outputs["log_probs"] - batch[SAMPLER_LOG_PROBS]) * mask
    loss = -(ratio * batch[ADVANTAGES]).sum()
    return loss, {}


LOSSES = {"cross_entropy": cross_entropy, "importance_sampling": importance_sampling}


def elementwise_losses(
    loss_fn: str, log_probs: list[np.ndarray], batch: TensorDict
) -> list[np.ndarray]:
    """Each datum's per-token loss, for the `elementwise_loss` output."""
    lengths = B.sequence_lengths(batch).tolist()
    out = []
    for r, (lp, n) in enumerate(zip(log_probs, lengths)):
        if loss_fn == "cross_entropy":
            out.append(-lp * batch[WEIGHTS][r, 1:n].numpy())
        else:
            ratio = np.exp(lp - batch[SAMPLER_LOG_PROBS][r, 1:n].numpy())
            out.append(-ratio * batch[ADVANTAGES][r, 1:n].numpy())
    return out
