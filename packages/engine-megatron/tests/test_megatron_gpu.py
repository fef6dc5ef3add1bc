"""MegatronEngine on a CUDA device at TP=PP=EP=1: the conformance kit (fp32, against the CPU
transformers reference) for the dense and the MoE model.

Selected with `pytest -m gpu`; skipped where no CUDA device is visible (CI, this CPU). The
single-process tests in test_megatron_single.py also run on CUDA there: the engine takes the
GPU whenever one is visible.
"""

import pytest
import torch

from tephra.engine_megatron import testing as T

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("model", ["dense", "moe"])
def test_conformance_on_cuda(tmp_path, model):
    (passed,) = T.rank_conformance_runs([(model, {}, "alltoall", None)], str(tmp_path))
    assert passed == T.KIT_CHECKS
