"""Every parallel layout trains through the app: the first step's loss and grad norm of each
layout equal a reference run's on the same rollouts (1e-5 / 1e-4).

- Layouts with one data-parallel rank (megatron TP=2, PP=2, CP=2, fsdp Ulysses SP=2 on 2 ranks)
  generate exactly
  the single-rank run's samples (each replica rank generates the whole batch with the same
  seeds; one rank returns it), so they are compared with the fsdp single-rank run.
- Layouts with two data-parallel ranks (fsdp on 2 ranks, megatron EP=2 on an MoE model)
  split the prompts over the ranks, so their samples are those of any 2-rank run; megatron
  EP=2 is compared with fsdp on 2 ranks, and fsdp on 2 ranks with its own single-rank run on
  the same batch in the engine kit (tests of packages/engine-fsdp).
One Ray session for the module."""

from __future__ import annotations

import pytest

from tephra.apps.ppo.main import parse_config, run
from tephra.controller.testing import SMOKE_REWARD
from tephra.controller.trackers import read_jsonl


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A tiny dense model with 2 KV heads (tensor parallel splits them) and a tiny MoE."""
    import torch
    from transformers import AutoTokenizer, Qwen2MoeConfig, Qwen2MoeForCausalLM

    from tephra.rollout.testing import build_tiny_model

    root = tmp_path_factory.mktemp("models")
    dense = build_tiny_model(root / "dense", num_heads=2, num_kv_heads=2, seed=3)
    tok = AutoTokenizer.from_pretrained(dense.path)
    torch.manual_seed(0)
    moe = Qwen2MoeForCausalLM(Qwen2MoeConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        shared_expert_intermediate_size=64, num_experts=4, num_experts_per_tok=2,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
        max_position_embeddings=1024, tie_word_embeddings=False, norm_topk_prob=False,
        decoder_sparse_step=1, mlp_only_layers=[], initializer_range=0.1,
        eos_token_id=dense.eos_token_id, pad_token_id=dense.pad_token_id))
    moe.generation_config.eos_token_id = dense.eos_token_id
    moe.generation_config.pad_token_id = dense.pad_token_id
    moe.save_pretrained(root / "moe")
    tok.save_pretrained(root / "moe")
    return {"dense": dense.path, "moe": str(root / "moe")}


def first_step(tmp_path, name, model, *overrides, steps=1):
    """The first step's metrics of a run of `steps` steps (the later ones must be finite)."""
    reward = tmp_path / "reward.py"
    reward.write_text(SMOKE_REWARD)
    run(parse_config(["-p", "smoke", f"model.path={model}", f"trainer.steps={steps}",
                      f"reward.custom_function_path={reward}",
                      f"trainer.run_dir={tmp_path / name}", *overrides]))
    rows = read_jsonl(tmp_path / name / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert all(r["actor/grad_norm"] > 0 for r in rows)
    return rows[0]


def assert_same_step(ref, other, label):
    assert ref["actor/grad_norm"] > 0
    for key in ("reward/mean", "response/length_mean", "perf/trained_tokens"):
        assert ref[key] == other[key], (label, key, ref[key], other[key])
    for key, tol in (("actor/pg_loss", 1e-5), ("actor/entropy", 1e-5), ("actor/grad_norm", 1e-4)):
        assert abs(ref[key] - other[key]) <= tol, (label, key, ref[key], other[key])


@pytest.mark.multiproc
def test_model_parallel_layouts_equal_the_single_rank_run(ray_session, models, tmp_path):
    ref = first_step(tmp_path, "fsdp1", models["dense"])
    for name, overrides in [
        ("tp2", ["actor.parallel.tensor=2"]),
        ("pp2", ["actor.parallel.pipeline=2"]),
        ("cp2", ["actor.parallel.context=2"]),
    ]:
        row = first_step(tmp_path, name, models["dense"], "actor.engine=megatron",
                         "resources.world_size=2", *overrides, steps=2 if name == "cp2" else 1)
        assert_same_step(ref, row, name)
    # fsdp with Ulysses sequence parallelism over the 2 ranks: one data-parallel replica
    sp2 = first_step(tmp_path, "fsdp_sp2", models["dense"], "resources.world_size=2",
                     "actor.parallel.context=2", steps=2)
    assert_same_step(ref, sp2, "fsdp_sp2")


@pytest.mark.multiproc
def test_data_parallel_layouts_agree(ray_session, models, tmp_path):
    fsdp2 = first_step(tmp_path, "fsdp2", models["moe"], "resources.world_size=2")
    ep2 = first_step(tmp_path, "ep2", models["moe"], "actor.engine=megatron",
                     "resources.world_size=2", "actor.parallel.expert=2")
    assert_same_step(fsdp2, ep2, "ep2")
