"""The same HF model and batch give the same numbers under engine-fsdp and engine-megatron.

This is what makes the engine contract real: the backends are interchangeable by name.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from tephra.engine_api.config import EngineConfig, SchedulerConfig
from tephra.engine_api.testing import first_steps, random_batch, run_distributed
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


@pytest.mark.parametrize(
    "cfg",
    [
        dict(name="constant", warmup_steps=4),
        dict(name="cosine", warmup_steps=3, total_steps=12, min_lr_ratio=0.1),
        dict(name="wsd", warmup_steps=2, total_steps=10, decay_ratio=0.3, min_lr_ratio=0.05),
        dict(name="wsd", warmup_steps=6, total_steps=10, decay_ratio=0.8),  # decay inside warmup
    ],
)
def test_both_engines_run_one_learning_rate_schedule(cfg):
    """FSDP's torch LambdaLR and Megatron's LrSchedule set the same lr at every step: the
    engines warmed up differently ((s+1)/W against s/W) and started the wsd decay at other
    steps, and the parity tests, run without warmup, could not see it."""
    sched_cfg = SchedulerConfig(**cfg)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2e-3)
    fsdp = build_scheduler(opt, sched_cfg)
    groups = [{"lr": None}]
    megatron = LrSchedule(lambda: groups, 2e-3, sched_cfg)
    assert groups[0]["lr"] == pytest.approx(2e-3 / sched_cfg.warmup_steps)  # the first step moves
    for _ in range(14):
        assert groups[0]["lr"] == pytest.approx(opt.param_groups[0]["lr"], rel=1e-12, abs=0)
        opt.step()
        fsdp.step()
        megatron.step()
