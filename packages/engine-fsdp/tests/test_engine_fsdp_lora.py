"""LoRA: only adapters train, the merged export is base + (alpha / r) B @ A, and
reference_mode() gives the base model's log-probs."""

import pytest
import torch
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

from tephra.engine_api import ConfigError
from tephra.engine_api.testing import random_batch
from tephra.engine_fsdp import FSDPEngine
from tephra.engine_fsdp.testing import TINY_VOCAB, tiny_engine_config, train_step

RANK, ALPHA = 4, 8.0


def full(t):
    t = t.detach()
    return (t.full_tensor() if isinstance(t, DTensor) else t).clone()


def exported(engine):
    with engine.eval_mode():
        return {n: t.clone() for bucket in engine.export_weights() for n, t in bucket}


def test_lora_trains_adapters_only_and_exports_merged(tmp_path):
    batch = random_batch(TINY_VOCAB, num_sequences=8, seed=3)
    engine = FSDPEngine.build(tiny_engine_config(**{"lora.rank": RANK, "lora.alpha": ALPHA}))
    params_before = {n: full(p) for n, p in engine.hf_model.named_parameters()}
    base_export = exported(engine)
    with engine.eval_mode():
        base_lp = engine.forward(batch)["log_probs"]
    for _ in range(2):
        train_step(engine, batch)
    params_after = {n: full(p) for n, p in engine.hf_model.named_parameters()}
    adapters = [n for n in params_before if ".lora_B." in n]
    assert adapters, "no adapters were injected"
    for name, before in params_before.items():
        changed = not torch.equal(before, params_after[name])
        # lora_A moves too once lora_B is non-zero (first step only moves B)
        assert changed == (".lora_" in name), name
    merged = exported(engine)
    assert set(merged) == set(base_export)
    assert not any("lora" in n or "base_layer" in n for n in merged)
    n_adapted = 0
    for name, weight in merged.items():
        prefix = name[: -len(".weight")]
        a_name = f"{prefix}.lora_A.default.weight"
        if a_name not in params_after:
            assert torch.equal(weight, base_export[name]), name
            continue
        a, b = params_after[a_name], params_after[f"{prefix}.lora_B.default.weight"]
        want = params_after[f"{prefix}.base_layer.weight"] + (ALPHA / RANK) * (b @ a)
        torch.testing.assert_close(weight, want, atol=1e-6, rtol=0)
        n_adapted += 1
    assert n_adapted == 2 * 7  # q k v o gate up down in 2 layers
    engine.export_hf(tmp_path / "merged")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").state_dict()
    for name, weight in merged.items():
        assert torch.equal(loaded[name], weight), name
    with engine.eval_mode():
        trained_lp = engine.forward(batch)["log_probs"]
        with engine.reference_mode():
            ref_lp = engine.forward(batch)["log_probs"]
    assert torch.equal(ref_lp, base_lp)
    assert (trained_lp - base_lp).abs().max() > 1e-3


def test_reference_mode_needs_lora():
    engine = FSDPEngine.build(tiny_engine_config())
    with pytest.raises(ConfigError, match="lora.rank"), engine.reference_mode():
        pass


def test_lora_value_model_trains_adapters_and_head():
    engine = FSDPEngine.build(tiny_engine_config(**{"model.role": "value", "lora.rank": RANK}))
    trainable = {n for n, p in engine.hf_model.named_parameters() if p.requires_grad}
    assert {"score.weight", "score.bias"} <= trainable
    assert all(".lora_" in n for n in trainable - {"score.weight", "score.bias"})
    with engine.eval_mode():
        names = [n for b in engine.export_weights() for n, _ in b]
    assert "score.weight" in names and not any("lora" in n for n in names)


def test_checkpoint_before_first_step_and_per_step_optimizer_params(tmp_path):
    """A checkpoint saved (and loaded) before the first optimizer step changes nothing, and
    `set_optimizer_params` steps exactly as an engine built with those settings: the two
    things a server that swaps several clients' adapters on one engine relies on."""
    batch = random_batch(TINY_VOCAB, num_sequences=4, seed=5)
    lora = {"lora.rank": RANK, "lora.alpha": ALPHA}
    tuned = {"optimizer.lr": 3e-2, "optimizer.betas": [0.8, 0.9], "optimizer.grad_clip": 0.0}
    reference = FSDPEngine.build(tiny_engine_config(**lora, **tuned))
    train_step(reference, batch)
    engine = FSDPEngine.build(tiny_engine_config(**lora))
    engine.save_checkpoint(tmp_path / "before")
    engine.load_checkpoint(tmp_path / "before")
    engine.set_optimizer_params(
        lr=3e-2, betas=(0.8, 0.9), eps=1e-8, weight_decay=0.0, grad_clip=0.0
    )
    train_step(engine, batch)
    want, got = exported(reference), exported(engine)
    assert max(float((got[k] - want[k]).abs().max()) for k in want) == 0.0
