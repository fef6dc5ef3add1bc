"""`HeadTransform`: what a model does around its linear output head, which every method of
this package applies inside its pass over the vocabulary.

With x = W h (the plain head, [tokens, vocab]) the logits the softmax sees are

    u = logit_scale * (hidden_scale * x + bias)              (bias: [vocab] or none)
    y = softcap * tanh(u / softcap)                          (when softcap is set; else y = u)
    z = y / temperature

over the first `vocab_size` rows of W only (all rows when None). Families: Cohere's
logit_scale and Granite's 1 / logits_scaling (logit_scale), MiniCPM3's and Inkling's division
of the last hidden state (hidden_scale), Gemma 2's final_logit_softcapping (softcap), Phi's
head bias (bias), Inkling's unpadded vocabulary (vocab_size).

Backward, with g = dL/dz from the softmax (chunked.py):
    dL/du = (g / temperature) * (1 - tanh(u / softcap)^2)     (g / temperature without cap)
    dL/dx = logit_scale * hidden_scale * dL/du,    dL/dbias = logit_scale * sum_tokens dL/du
and tanh(u / softcap) = z * temperature / softcap is read back from the logits themselves.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tephra.kernels.errors import KernelInputError


@dataclass(frozen=True, eq=False)
class HeadTransform:
    """The scalars, bias and vocabulary cut of a model's output head (see the module
    docstring for the formula). The default is the plain head z = W h / temperature."""

    hidden_scale: float = 1.0
    """Multiplies the last hidden state before the head (MiniCPM3: 1 / logits_scaling)."""
    logit_scale: float = 1.0
    """Multiplies the head's output, bias included (Cohere: logit_scale)."""
    softcap: float | None = None
    """cap in cap * tanh(logits / cap), applied after logit_scale (Gemma 2: 30.0)."""
    bias: torch.Tensor | None = None
    """The head's bias [vocab] (same dtype and device as the weight); it gets a gradient."""
    vocab_size: int | None = None
    """Only the first vocab_size rows of the weight (and bias) are logits (Inkling's
    unpadded_vocab_size); None: all of them."""

    def __post_init__(self) -> None:
        for name in ("hidden_scale", "logit_scale"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and float(value) > 0):
                raise KernelInputError(
                    f"HeadTransform.{name}={value!r}; expected a finite number > 0 "
                    "(1.0 when the model does not scale)"
                )
        cap = self.softcap
        if cap is not None and not (
            isinstance(cap, (int, float)) and math.isfinite(cap) and float(cap) > 0
        ):
            raise KernelInputError(
                f"HeadTransform.softcap={cap!r}; expected a finite number > 0 or None (no cap)"
            )
        if self.vocab_size is not None and (
            not isinstance(self.vocab_size, int) or self.vocab_size < 1
        ):
            raise KernelInputError(
                f"HeadTransform.vocab_size={self.vocab_size!r}; expected a positive int or "
                "None (every row of the weight)"
            )
        if self.bias is not None and (
            not isinstance(self.bias, torch.Tensor) or self.bias.dim() != 1
        ):
            raise KernelInputError(
                "HeadTransform.bias must be a 1-D tensor [vocab] (the output head's bias) or None"
            )

    @property
    def scale(self) -> float:
        """The factor on W h: logit_scale * hidden_scale."""
        return float(self.logit_scale) * float(self.hidden_scale)

    @property
    def is_plain(self) -> bool:
        """True when z = W h / temperature (nothing to apply)."""
        return (
            self.scale == 1.0
            and self.softcap is None
            and self.bias is None
            and self.vocab_size is None
        )


PLAIN = HeadTransform()
"""The plain head: z = W h / temperature."""


def check_head(head: HeadTransform, weight: torch.Tensor, *, weight_name: str = "weight") -> None:
    """Raise KernelInputError when `head` does not fit `weight` [vocab, hidden]."""
    if not isinstance(head, HeadTransform):
        raise KernelInputError(
            f"head={head!r}; expected a tephra.kernels.HeadTransform (or None for the plain head)"
        )
    bias = head.bias
    if bias is not None:
        if bias.shape[0] != weight.shape[0]:
            raise KernelInputError(
                f"HeadTransform.bias has {bias.shape[0]} entries but {weight_name} has "
                f"{weight.shape[0]} rows; the bias must be [vocab] like the head's rows"
            )
        if bias.dtype != weight.dtype or bias.device != weight.device:
            raise KernelInputError(
                f"HeadTransform.bias is {bias.dtype} on {bias.device} but {weight_name} is "
                f"{weight.dtype} on {weight.device}; cast the bias to match"
            )
    if head.vocab_size is not None and head.vocab_size > weight.shape[0]:
        raise KernelInputError(
            f"HeadTransform.vocab_size={head.vocab_size} exceeds the {weight.shape[0]} rows of "
            f"{weight_name}; expected at most the head's rows"
        )


def apply_head_(
    x: torch.Tensor,
    head: HeadTransform,
    bias32: torch.Tensor | None,
    inv_temp: float,
) -> torch.Tensor:
    """In place: x = W h (fp32 [C, V]) -> z = softcap(logit_scale (hidden_scale x + b)) / T.
    `bias32` is the head's bias (the rows of this x) in fp32, or None."""
    if head.scale != 1.0:
        x.mul_(head.scale)
    if bias32 is not None:
        x.add_(bias32, alpha=float(head.logit_scale))
    if head.softcap is not None:
        x.div_(head.softcap).tanh_().mul_(head.softcap)
    if inv_temp != 1.0:
        x.mul_(inv_temp)
    return x


def softcap_slope(z: torch.Tensor, head: HeadTransform, inv_temp: float) -> torch.Tensor:
    """1 - tanh(u / cap)^2 = dy/du from the final logits z = cap tanh(u / cap) / T [C, V]."""
    assert head.softcap is not None
    t = z * (1.0 / (inv_temp * head.softcap))
    return t.mul_(t).neg_().add_(1.0)


def grad_through_head_(
    g: torch.Tensor,
    slope: torch.Tensor | None,
    head: HeadTransform,
    grad_bias: torch.Tensor | None,
) -> torch.Tensor:
    """In place: g = dL/dy [C, V] (y: the logits before the temperature, i.e. dL/dz / T) ->
    dL/d(W h). `slope` is softcap_slope's (None without a cap); `grad_bias` [V] fp32, when
    given, accumulates logit_scale * sum_tokens dL/du."""
    if slope is not None:
        g.mul_(slope)
    if grad_bias is not None:
        grad_bias.add_(g.sum(0), alpha=float(head.logit_scale))
    if head.scale != 1.0:
        g.mul_(head.scale)
    return g


def head_rows(
    weight: torch.Tensor, head: HeadTransform
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The weight rows (and bias entries) that are logits: the first vocab_size (views, so
    the cut rows get a zero gradient through autograd)."""
    if head.vocab_size is None:
        return weight, head.bias
    rows = head.vocab_size
    return weight[:rows], (head.bias[:rows] if head.bias is not None else None)
