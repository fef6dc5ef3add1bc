"""The same HF model and batch give the same numbers under engine-fsdp and engine-megatron.

This is what makes the engine contract real: the backends are interchangeable by name.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from safetensors.torch import load_file

from tephra.engine_api.config import EngineConfig, SchedulerConfig, apply_overrides
from tephra.engine_api.testing import adapter_steps, first_steps, random_batch, run_distributed
from tephra.engine_fsdp.schedulers import build_scheduler
from tephra.engine_megatron.lr_schedule import LrSchedule

VOCAB = 256


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("parity-qwen2")
    config = transformers.Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(config).save_pretrained(path)
    return str(path)


def config(path: str, **parallel) -> EngineConfig:
    return EngineConfig(
        model={"path": path},
        optimizer={"lr": 1e-3, "weight_decay": 0.0, "grad_clip": 0.0},
        micro_batch={"max_tokens_per_microbatch": 64},
        parallel=parallel,
        temperature=0.8,
    )


@pytest.mark.multiproc
def test_fsdp_and_megatron_tp2_agree_on_the_first_steps(hf_folder):
    batch = random_batch(VOCAB, num_sequences=8, seed=11)
    fsdp = run_distributed(first_steps, world_size=2, args=("fsdp", config(hf_folder), batch, 2))
    megatron = run_distributed(
        first_steps, world_size=2, args=("megatron", config(hf_folder, tensor=2), batch, 2)
    )
    (fsdp_loss, fsdp_norm), (mg_loss, mg_norm) = fsdp[0][0], megatron[0][0]
    assert abs(fsdp_loss - mg_loss) <= 1e-5, (fsdp_loss, mg_loss)
    assert abs(fsdp_norm - mg_norm) <= 1e-4 * max(1.0, fsdp_norm), (fsdp_norm, mg_norm)
    # the second step starts from the first step's update: the optimizers agree too
    assert abs(fsdp[0][1][0] - megatron[0][1][0]) <= 1e-5


@pytest.mark.multiproc
def test_fsdp_and_megatron_lora_agree(hf_folder, tmp_path):
    """LoRA (peft's adapters on all linears, rank 8) through both engines, two AdamW steps
    with weight decay: the same losses and grad norms, the same adapter files (peft's names)
    and the same merged weights for the rollout. Megatron at TP=2 without and with sequence
    parallelism (the adapters' A or B whole on every rank, the other split like the
    weight), FSDP sharded over 2 ranks."""
    batch = random_batch(VOCAB, num_sequences=8, seed=11)
    lora = {"lora.rank": 8, "lora.alpha": 16.0, "optimizer.weight_decay": 0.01}
    runs = {
        "fsdp": ("fsdp", config(hf_folder)),
        "tp2": ("megatron", config(hf_folder, tensor=2)),
        "tp2_sp": ("megatron", config(hf_folder, tensor=2, sequence_parallel=True)),
    }
    got = {}
    for key, (engine, cfg) in runs.items():
        folder = str(tmp_path / key)
        cfg = apply_overrides(cfg, lora)
        steps, merged = run_distributed(adapter_steps, 2, (engine, cfg, batch, 2, folder))[0]
        got[key] = steps, merged, load_file(f"{folder}/adapter_model.safetensors")
    (want_steps, want_merged, want_adapter) = got["fsdp"]
    assert len(want_adapter) == 2 * 7 * 2  # A and B of 7 linears in each of 2 layers
    base = load_file(f"{hf_folder}/model.safetensors")
    for key in ("tp2", "tp2_sp"):
        steps, merged, adapter = got[key]
        for (loss, norm), (want_loss, want_norm) in zip(steps, want_steps):
            assert abs(loss - want_loss) <= 1e-5, (key, loss, want_loss)
            assert abs(norm - want_norm) <= 1e-4 * max(1.0, want_norm), (key, norm, want_norm)
        assert adapter.keys() == want_adapter.keys()
        for name, want in want_adapter.items():
            assert (adapter[name] - want).abs().max() <= 1e-5, (key, name)
        assert merged.keys() == want_merged.keys()
        for name, want in want_merged.items():
            assert (merged[name] - want).abs().max() <= 1e-5, (key, name)
    # the adapters moved, and only they: the merged q_proj differs from the base by B @ A
    q = "model.layers.0.self_attn.q_proj.weight"
    a = want_adapter["base_model.model." + q.replace(".weight", ".lora_A.weight")]
    b = want_adapter["base_model.model." + q.replace(".weight", ".lora_B.weight")]
    assert float(b.abs().max()) > 1e-4
    assert (got["tp2"][1][q] - (base[q] + 2.0 * b @ a)).abs().max() <= 1e-5


@pytest.mark.parametrize(
    "cfg",
    [
        dict(name="constant"),
        dict(name="constant", warmup_steps=4),
        dict(name="cosine", total_steps=10, min_lr_ratio=0.2),
        dict(name="cosine", warmup_steps=3, total_steps=12, min_lr_ratio=0.1),
        dict(name="wsd", total_steps=10, decay_ratio=0.25, min_lr_ratio=0.1),  # 2.5 decay steps
        dict(name="wsd", warmup_steps=2, total_steps=10, decay_ratio=0.3, min_lr_ratio=0.05),
        dict(name="wsd", warmup_steps=6, total_steps=10, decay_ratio=0.8),  # decay inside warmup
    ],
)
def test_both_engines_follow_the_transformers_schedules(cfg, reference_lrs):
    """FSDP's torch LambdaLR and Megatron's LrSchedule set, at every step, the lr of
    transformers' own scheduler of that shape (`reference_lrs`), not merely each other's: the
    engines once warmed up differently ((s+1)/W against s/W) and started the wsd decay at other
    steps, and the parity tests, run without warmup, could not see it."""
    sched_cfg = SchedulerConfig(**cfg)
    steps = 15
    want = reference_lrs(sched_cfg, 2e-3, steps)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2e-3)
    fsdp = build_scheduler(opt, sched_cfg)
    groups = [{"lr": None}]
    megatron = LrSchedule(lambda: groups, 2e-3, sched_cfg)
    for step in range(steps):
        assert opt.param_groups[0]["lr"] == pytest.approx(want[step], rel=1e-12, abs=1e-15), step
        assert groups[0]["lr"] == pytest.approx(want[step], rel=1e-12, abs=1e-15), step
        opt.step()
        fsdp.step()
        megatron.step()
