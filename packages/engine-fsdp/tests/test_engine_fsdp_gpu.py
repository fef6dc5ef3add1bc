"""FSDPEngine on a CUDA device: the conformance kit in fp32 (against the CPU reference model),
and bf16 compute with fp32 master weights against the same steps in fp32 on CPU.

Selected with `pytest -m gpu`; skipped where no CUDA device is visible (CI, this CPU).
"""

import pytest
import torch

from tephra.engine_api.testing import CHECKS, random_batch, run_conformance
from tephra.engine_fsdp import FSDPEngine
from tephra.engine_fsdp.testing import TINY_VOCAB, conformance_spec, tiny_engine_config, train_step

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_conformance_on_cuda(tmp_path):
    spec = conformance_spec(tmp_path, device="cuda")
    assert run_conformance(spec) == list(CHECKS)
    engine = spec.make_engine({})
    assert engine.device.type == "cuda"
    assert next(engine.hf_model.parameters()).device.type == "cuda"


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"micro_batch.use_packing": True},
        {"model.gradient_checkpointing": True, "lora.rank": 4},
    ],
)
def test_bf16_on_cuda_tracks_fp32_on_cpu(overrides):
    batch = random_batch(TINY_VOCAB, num_sequences=8, seed=3)
    cpu = FSDPEngine.build(tiny_engine_config(**overrides))
    gpu = FSDPEngine.build(
        tiny_engine_config(**overrides, device="cuda", **{"precision.param_dtype": "bfloat16"})
    )
    assert gpu.device.type == "cuda"
    for _ in range(3):
        (loss, norm), (want_loss, want_norm) = train_step(gpu, batch), train_step(cpu, batch)
        assert loss == pytest.approx(want_loss, rel=2e-2)
        assert norm == pytest.approx(want_norm, rel=5e-2)
    with gpu.eval_mode(), cpu.eval_mode():
        got, want = gpu.forward(batch)["log_probs"], cpu.forward(batch)["log_probs"]
    mask = batch["response_mask"].bool()
    assert (got.float().cpu()[mask] - want[mask]).abs().max() < 0.1
    # weight sync: the same names as the CPU engine's, full and finite
    exported = dict(w for bucket in gpu.export_weights() for w in bucket)
    reference = dict(w for bucket in cpu.export_weights() for w in bucket)
    assert exported.keys() == reference.keys()
    for name, tensor in exported.items():
        assert tensor.shape == reference[name].shape and torch.isfinite(tensor).all(), name


@pytest.mark.parametrize("params", [True, False])
def test_offload_keeps_the_tensors_in_host_memory_between_steps(params):
    """offload.params keeps the parameter shards on the host (FSDP copies them in for each
    forward); offload.optimizer keeps Adam's state there outside train_mode. The steps equal
    the ones without offload."""
    from torch.distributed.tensor import DTensor

    batch = random_batch(TINY_VOCAB, num_sequences=4, seed=5)
    plain = FSDPEngine.build(tiny_engine_config(device="cuda"))
    off = FSDPEngine.build(
        tiny_engine_config(
            **{"device": "cuda", "offload.params": params, "offload.optimizer": True}
        )
    )
    for _ in range(2):
        (la, ga), (lb, gb) = train_step(plain, batch), train_step(off, batch)
        assert la == pytest.approx(lb, rel=1e-5) and ga == pytest.approx(gb, rel=1e-4)
    shards = [p.to_local() if isinstance(p, DTensor) else p for p in off.hf_model.parameters()]
    assert {s.device.type for s in shards} == ({"cpu"} if params else {"cuda"})
    state = [
        v
        for s in off.optimizer.state.values()
        for k, v in s.items()
        if isinstance(v, torch.Tensor) and k != "step"
    ]
    assert state and {v.device.type for v in state} == {"cpu"}
