"""Temperature / top-k / top-p sampling as one transformers logits processor that also
records the log-prob of each sampled token under the temperature-scaled, untruncated
distribution.

Why not transformers' own warpers: generate's `scores` are after top-k/top-p (truncated
tokens are -inf), and keeping `output_logits` for every step costs [rows, steps, vocab]
floats. This processor is the only one in the list, so it sees the raw logits, keeps one
[rows, vocab] log-softmax, and gathers the sampled token's value on the next call.

Why it samples itself (generate then runs greedy and takes the one token left at 0): torch's
`multinomial`, which generate's sampling calls, draws an exponential variate per vocabulary
entry, which was 12% of a CPU generation's time with a 49k vocabulary; inverse-CDF sampling
draws one uniform per row and is exact for the same distribution.

Each row draws its uniform from its own `torch.Generator` (seeded per sample by the caller),
so a sample's tokens do not depend on which other rows share its batch: the same prompts give
the same samples whether generated in one call or split over data-parallel ranks.
"""

from __future__ import annotations

from typing import cast

import torch
from transformers import LogitsProcessor


def sample_rows(logits: torch.Tensor, uniforms: torch.Tensor | None = None) -> torch.Tensor:
    """One token per row drawn from softmax(logits) (-inf entries never). [rows, vocab] ->
    [rows]; `uniforms` as in `sample_probs`."""
    return sample_probs(torch.softmax(logits.float(), dim=-1), uniforms)


def row_uniforms(generators: list[torch.Generator], device: torch.device) -> torch.Tensor:
    """One float64 uniform in [0, 1) per row, row r's from `generators[r]` (CPU generators:
    the draws are the same on every device)."""
    draws = torch.cat([torch.rand(1, dtype=torch.float64, generator=g) for g in generators])
    return draws.to(device)


SAMPLE_BLOCK = 256
"""Vocabulary entries per block of the two-level inverse CDF in `sample_probs`."""


def sample_probs(probs: torch.Tensor, uniforms: torch.Tensor | None = None) -> torch.Tensor:
    """One token per row drawn from probs [rows, vocab] (rows need not be normalised; zero
    entries never come), by inverse CDF with one uniform per row (`uniforms` [rows] float64
    in [0, 1), else drawn from the global torch generator): u in (0, 1] picks the first token whose cumulative probability reaches u times
    the row's total. Two levels, so no scan runs over the whole vocabulary: the cumulative
    mass of blocks of SAMPLE_BLOCK tokens picks a block, a float64 scan inside it the token
    (rounding moves a token's probability by ~1e-7 of itself)."""
    rows, vocab = probs.shape
    pad = (-vocab) % SAMPLE_BLOCK
    blocks = torch.nn.functional.pad(probs, (0, pad)) if pad else probs
    blocks = blocks.view(rows, -1, SAMPLE_BLOCK)
    mass = blocks.sum(-1).double()  # [rows, blocks]; fp32 sums of 256 (a float64 sum copies)
    cdf = mass.cumsum(-1)
    if uniforms is None:
        uniforms = torch.rand(rows, dtype=torch.float64, device=probs.device)
    u = 1.0 - uniforms.view(rows, 1)
    target = u * cdf[:, -1:]
    # the first block reaching the target has mass > 0: cdf only grows through such blocks
    block = torch.searchsorted(cdf, target).clamp_max(blocks.shape[1] - 1)
    inner = blocks[torch.arange(rows, device=probs.device), block.squeeze(1)].double().cumsum(-1)
    # what is left of the target inside the block, kept in (0, the block's sum] against
    # rounding, so that the first token reaching it has probability > 0
    rest = target - (cdf.gather(1, block) - mass.gather(1, block))
    rest = torch.minimum(rest, inner[:, -1:]).clamp_min(torch.finfo(torch.float64).tiny)
    token = torch.searchsorted(inner, rest).clamp_max(SAMPLE_BLOCK - 1)
    return (block * SAMPLE_BLOCK + token).squeeze(1).clamp_max(vocab - 1)


def truncate_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set logits outside the top-k and outside the top-p nucleus to -inf. [rows, vocab].

    Nucleus: sort by probability, keep token i if the probability mass strictly before it
    is < top_p (so the most likely token is always kept).
    """
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        mass_before = probs.cumsum(-1) - probs
        drop_sorted = mass_before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


class SampledLogProbRecorder(LogitsProcessor):
    """A `LogitsProcessor` for greedy `generate`: returns scores whose argmax is the token
    (temperature 0: the raw logits; else a sample, every other entry -inf) and records
    log-probs.

    Call k sees the tokens sampled by calls < k in `input_ids[:, -1]`; `finish(last_tokens)`
    gathers the final step. `log_probs()` -> [rows, steps] float32. `generators`: row r's
    uniforms come from `generators[r]` (None: the global torch generator).
    """

    def __init__(
        self,
        temperature: float,
        top_k: int,
        top_p: float,
        prompt_len: int,
        generators: list[torch.Generator] | None = None,
    ) -> None:
        self.generators = generators
        self.temperature = temperature
        self.top_k = top_k
        self.top_p = top_p
        self.prompt_len = prompt_len
        self._previous: torch.Tensor | None = None
        self._recorded: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self._previous is not None:
            self._gather(input_ids[:, -1])
        scores = scores.float()
        scale = self.temperature if self.temperature > 0 else 1.0
        scaled = scores / scale if scale != 1.0 else scores
        self._previous = torch.log_softmax(scaled, dim=-1)
        if self.temperature == 0:
            return scores  # greedy: argmax of the raw logits
        u = row_uniforms(self.generators, scores.device) if self.generators is not None else None
        if self.top_k > 0 or self.top_p < 1.0:
            tokens = sample_rows(truncate_top_k_top_p(scaled, self.top_k, self.top_p), u)
        else:  # the untruncated distribution is the one just computed
            tokens = sample_probs(self._previous.exp(), u)
        # generate takes the argmax of what this returns: the sampled token, in scores' buffer
        return scores.fill_(float("-inf")).scatter_(1, tokens[:, None], 0.0)

    def _gather(self, tokens: torch.Tensor) -> None:
        previous = cast(torch.Tensor, self._previous)  # set by the step before
        self._recorded.append(previous.gather(1, tokens[:, None].long()).squeeze(1))
        self._previous = None

    def finish(self, sequences: torch.Tensor) -> torch.Tensor:
        """Log-probs [rows, steps] given generate's output sequences [rows, prompt + steps]."""
        if self._previous is not None:
            self._gather(sequences[:, -1])
        steps = sequences.shape[1] - self.prompt_len
        if len(self._recorded) != steps:
            raise RuntimeError(
                f"recorded {len(self._recorded)} log-prob steps for {steps} generated tokens; "
                "another logits processor or a cache reuse changed the generation loop"
            )
        if not self._recorded:
            return torch.zeros(sequences.shape[0], 0)
        return torch.stack(self._recorded, dim=1)
