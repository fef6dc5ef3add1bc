"""tephra.kernels: per-token log-prob and entropy of a linear lm head without [tokens, vocab]
logits. `linear_logprob_entropy` picks the Triton kernels on CUDA and the chunked torch path
elsewhere; `vocab_parallel_logprob_entropy` is the tensor-parallel variant."""

from tephra.kernels.chunked import chunked_logprob_entropy
from tephra.kernels.errors import KernelInputError
from tephra.kernels.head_transform import HeadTransform
from tephra.kernels.logprob_entropy import (
    METHOD_ENV_VAR,
    METHODS,
    linear_logprob_entropy,
    resolve_method,
    triton_available,
)
from tephra.kernels.reference import naive_logprob_entropy
from tephra.kernels.vocab_parallel import vocab_parallel_logprob_entropy

__all__ = [
    "METHOD_ENV_VAR",
    "METHODS",
    "HeadTransform",
    "KernelInputError",
    "chunked_logprob_entropy",
    "linear_logprob_entropy",
    "naive_logprob_entropy",
    "resolve_method",
    "triton_available",
    "vocab_parallel_logprob_entropy",
]
