"""Random batches in the padded layout, and a plain NLL loss, for the conformance kit."""

from __future__ import annotations

import torch
from tensordict import TensorDict

from tephra.engine_api import batch as B
from tephra.engine_api.loss import Share


def random_batch(
    vocab_size: int,
    num_sequences: int = 8,
    prompt_lengths: tuple[int, int] = (2, 7),
    response_lengths: tuple[int, int] = (1, 7),
    seed: int = 0,
) -> TensorDict:
    """Prompts left-padded, responses right-padded, random lengths, padding token 0.

    returns: padded batch `[num_sequences, max_prompt + max_response]`.
    """
    g = torch.Generator().manual_seed(seed)
    p_lens = torch.randint(*prompt_lengths, (num_sequences,), generator=g)
    r_lens = torch.randint(*response_lengths, (num_sequences,), generator=g)
    P, R = int(p_lens.max()), int(r_lens.max())
    ids = torch.zeros(num_sequences, P + R, dtype=torch.int64)
    attn = torch.zeros_like(ids)
    resp = torch.zeros_like(ids)
    for i in range(num_sequences):
        p, r = int(p_lens[i]), int(r_lens[i])
        ids[i, P - p : P + r] = torch.randint(1, vocab_size, (p + r,), generator=g)
        attn[i, P - p : P + r] = 1
        resp[i, P : P + r] = 1
    return B.make_batch(ids, attn, resp)


def nll_loss_fn(outputs: TensorDict, batch: TensorDict) -> tuple[torch.Tensor, dict[str, float]]:
    """Token-mean negative log-likelihood of the response tokens, as a contribution to the
    global loss: sum(-log p * mask) / global_token_count."""
    mask = batch[B.RESPONSE_MASK].to(outputs["log_probs"].dtype)
    loss = -(outputs["log_probs"] * mask).sum() / batch[B.GLOBAL_TOKEN_COUNT][0]
    return loss, {"nll_contribution": Share(float(loss.detach()))}
