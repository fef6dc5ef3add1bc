"""Per-token entropy of the policy, for the entropy bonus.

    H_t = -sum_v pi(v | y_<t) log pi(v | y_<t) = logsumexp(z) - sum_v softmax(z)_v z_v
for logits z [batch, seq, vocab]. Engines usually compute it themselves (often in chunks);
this is the reference definition.
"""

from __future__ import annotations

import torch


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy [batch, seq] of the categorical distributions given by `logits` [batch, seq, V]."""
    log_z = torch.logsumexp(logits, dim=-1)
    p = torch.softmax(logits, dim=-1)
    return log_z - (p * logits).sum(-1)
