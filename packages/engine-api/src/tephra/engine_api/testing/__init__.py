"""The conformance kit and multi-process helpers for engine backends' tests."""

from tephra.engine_api.testing.batches import nll_loss_fn, random_batch
from tephra.engine_api.testing.conformance import (
    CHECKS,
    ConformanceFailure,
    ConformanceSpec,
    ReferenceModel,
    reference_log_probs,
    run_conformance,
)
from tephra.engine_api.testing.distributed import free_port, run_distributed
from tephra.engine_api.testing.parity import adapter_steps, first_steps

__all__ = [
    "CHECKS",
    "ConformanceFailure",
    "ConformanceSpec",
    "ReferenceModel",
    "adapter_steps",
    "first_steps",
    "free_port",
    "nll_loss_fn",
    "random_batch",
    "reference_log_probs",
    "run_conformance",
    "run_distributed",
]
