"""The naive reference: full [tokens, vocab] logits, log_softmax, gather, entropy.

It is what every other implementation is tested and benchmarked against, and the simplest
statement of the contract:

    z      = (hidden @ weight.T) / temperature          [tokens, vocab], computed in fp32
             (with a HeadTransform: softcap(logit_scale (hidden_scale W h + bias)) / T over
             the first vocab_size rows; see head_transform.py)
    logp_i = z[i, labels_i] - logsumexp(z[i])           0 where labels_i == ignore_index
    H_i    = -sum_v softmax(z[i])_v * log_softmax(z[i])_v   (for every position)
    Q_i    = sum_v softmax(z[i])_v ** 2                      (on request; every position)
"""

from __future__ import annotations

import torch

from tephra.kernels.head_transform import PLAIN, HeadTransform

LogprobEntropy = tuple[torch.Tensor, torch.Tensor | None, *tuple[torch.Tensor, ...]]
"""(log_probs, entropy or None when not computed), plus sum_pi_squared as a third element
when asked for: what every method returns."""


def naive_logprob_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    ignore_index: int = -100,
    *,
    compute_entropy: bool = True,
    compute_sum_pi_squared: bool = False,
    head: HeadTransform | None = None,
) -> LogprobEntropy:
    """Per-token log-prob of `labels` and entropy, materialising the logits.

    hidden [tokens, hidden], weight [vocab, hidden], labels [tokens] ->
    (log_probs [tokens] fp32, entropy [tokens] fp32 or None), plus sum_pi_squared [tokens]
    fp32 (no gradient) as a third element when `compute_sum_pi_squared`. Plain autograd gives
    the gradients (to `head.bias` too).
    """
    head = head or PLAIN
    rows = head.vocab_size or weight.shape[0]
    logits = hidden.float() @ weight[:rows].float().T
    logits = logits * head.scale
    if head.bias is not None:
        logits = logits + head.logit_scale * head.bias[:rows].float()
    if head.softcap is not None:
        logits = head.softcap * torch.tanh(logits / head.softcap)
    logits = logits / temperature
    log_p = torch.log_softmax(logits, dim=-1)
    valid = labels != ignore_index
    picked = log_p.gather(-1, torch.where(valid, labels, 0).unsqueeze(-1)).squeeze(-1)
    log_probs = torch.where(valid, picked, torch.zeros_like(picked))
    entropy = -(log_p.exp() * log_p).sum(-1) if compute_entropy else None
    if compute_sum_pi_squared:
        return log_probs, entropy, (2 * log_p.detach()).exp().sum(-1)
    return log_probs, entropy
