"""Every parallel layout trains through the app and equals the single-rank fsdp run: the same
samples and rewards (token ids compared exactly) and the first step's loss and grad norm
within 1e-5 / 1e-4; the runs of two steps (CP=2, Ulysses SP=2) are recomputed step by step
from their dumped samples in plain transformers and torch, step 1's AdamW update included.

Generation is split over the ranks by its own data parallelism (every rank of the hf rollout
generates a disjoint share of the prompts, model-parallel peers included), and each sample
is seeded by its place in the whole batch (`SamplingParams.seed`), so any layout on any
number of ranks generates the single-rank run's samples:
- one data-parallel replica over 2 ranks: megatron TP=2, PP=2, CP=2, fsdp Ulysses SP=2;
- two data-parallel ranks: fsdp on 2 ranks (`resources.world_size=2`, the done-when check of
  issue #39), megatron EP=2 on an MoE model.
A tiny DeepSeek-V3 (MLA, YaRN, sigmoid-routed experts) on megatron, one rank, against its step
recomputed in plain transformers (issue #63).
One Ray session for the module."""

from __future__ import annotations

import json

import pytest

from tephra.apps.ppo.main import parse_config, run
from tephra.controller.run.trackers import read_jsonl
from tephra.controller.testing import SMOKE_REWARD
from tephra.engine_megatron.testing import TINY_DEEPSEEK_V3, TINY_MOE


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A tiny dense model with 2 KV heads (tensor parallel splits them), a tiny MoE and a tiny
    DeepSeek-V3."""
    import torch
    from transformers import (
        AutoTokenizer,
        DeepseekV3Config,
        DeepseekV3ForCausalLM,
        Qwen2MoeConfig,
        Qwen2MoeForCausalLM,
    )

    from tephra.rollout.testing import build_tiny_model

    root = tmp_path_factory.mktemp("models")
    dense = build_tiny_model(root / "dense", num_heads=2, num_kv_heads=2, seed=3)
    tok = AutoTokenizer.from_pretrained(dense.path)
    torch.manual_seed(0)
    moe_config = {k: v for k, v in TINY_MOE.items() if k != "model_type"}
    moe = Qwen2MoeForCausalLM(
        Qwen2MoeConfig(
            **{
                **moe_config,
                # the rollout's tokenizer, and 2 query heads: tensor parallelism splits the KV heads
                "vocab_size": len(tok),
                "num_attention_heads": 2,
                "max_position_embeddings": 1024,
                "initializer_range": 0.1,
                "eos_token_id": dense.eos_token_id,
                "pad_token_id": dense.pad_token_id,
            }
        )
    )
    moe.generation_config.eos_token_id = dense.eos_token_id
    moe.generation_config.pad_token_id = dense.pad_token_id
    moe.save_pretrained(root / "moe")
    tok.save_pretrained(root / "moe")
    ds_config = {k: v for k, v in TINY_DEEPSEEK_V3.items() if k != "model_type"}
    deepseek = DeepseekV3ForCausalLM(
        DeepseekV3Config(
            **{
                **ds_config,
                "vocab_size": len(tok),
                "max_position_embeddings": 1024,
                "initializer_range": 0.1,
                "eos_token_id": dense.eos_token_id,
                "pad_token_id": dense.pad_token_id,
            }
        )
    )
    with torch.no_grad():  # a routing bias off zero: the run must carry it both ways
        for layer in deepseek.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0, 0.1)
    deepseek.generation_config.eos_token_id = dense.eos_token_id
    deepseek.generation_config.pad_token_id = dense.pad_token_id
    deepseek.save_pretrained(root / "deepseek")
    tok.save_pretrained(root / "deepseek")
    return {"dense": dense.path, "moe": str(root / "moe"), "deepseek": str(root / "deepseek")}


def first_step(tmp_path, name, model, *overrides, steps=1, reference=None):
    """The first step's metrics of a run of `steps` steps, with its dumped samples.
    `reference`: for a GRPO run on one rank, the fixtures `(grpo_step_reference,
    smoke_score)`, to recompute its step from its dumped samples (scores, advantages, reward
    mean, on-policy loss and grad norm in plain transformers). `later`: the metrics and
    samples of every step, for `assert_later_steps`."""
    reward = tmp_path / "reward.py"
    reward.write_text(SMOKE_REWARD)
    cfg = parse_config(
        [
            "-p",
            "smoke",
            f"model.path={model}",
            f"trainer.steps={steps}",
            f"reward.custom_function_path={reward}",
            "trainer.dump_generations=1",
            f"trainer.run_dir={tmp_path / name}",
            *overrides,
        ]
    )
    run(cfg)
    rows = read_jsonl(tmp_path / name / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    later = []
    for r in rows:
        dumped = tmp_path / name / "generations" / f"train_step{r['step']}.jsonl"
        later.append({**r, "samples": [json.loads(x) for x in dumped.read_text().splitlines()]})
    if reference is not None:
        grpo_step_reference, smoke_score = reference
        first, samples = rows[0], later[0]["samples"]
        assert [s["score"] for s in samples] == [smoke_score(s["response"]) for s in samples]
        want = grpo_step_reference(model, samples)
        assert len({round(x, 6) for x in want["advantages"]}) > 1  # the rewards vary
        assert [s["advantage"] for s in samples] == pytest.approx(want["advantages"], abs=1e-5)
        assert first["reward/mean"] == pytest.approx(want["reward/mean"], abs=1e-6)
        assert first["actor/pg_loss"] == pytest.approx(want["pg_loss"], abs=1e-5)
        assert first["actor/grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4)
    return {**later[0], "later": later, "cfg": cfg}


def assert_later_steps(run, model, grpo_steps_reference, smoke_score, label):
    """Every step of a multi-step run recomputed from its own dumps in plain transformers
    and torch, each from the weights the previous step's update (AdamW, written out there)
    left: the scores, advantages, reward mean, pg loss and grad norm of step 2 come from
    weights that step 1 moved, through the layout's optimizer step and weight sync."""
    steps = run["later"]
    assert len(steps) > 1, label
    wants = grpo_steps_reference(run["cfg"], model, [s["samples"] for s in steps])
    for got, want in zip(steps, wants, strict=True):
        where = (label, got["step"])
        samples = got["samples"]
        assert [s["score"] for s in samples] == [smoke_score(s["response"]) for s in samples]
        assert len({round(x, 6) for x in want["advantages"]}) > 1, where  # the rewards vary
        assert [s["advantage"] for s in samples] == pytest.approx(want["advantages"], abs=1e-5)
        assert got["reward/mean"] == pytest.approx(want["reward/mean"], abs=1e-6), where
        assert got["actor/pg_loss"] == pytest.approx(want["pg_loss"], abs=1e-5), where
        assert got["actor/grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4), where


def assert_same_step(ref, other, label):
    # the samples themselves: token ids and rewards exactly
    got = [(s["prompt_ids"], s["response_ids"], s["score"]) for s in other["samples"]]
    assert got == [(s["prompt_ids"], s["response_ids"], s["score"]) for s in ref["samples"]], label
    for key in ("reward/mean", "response/length_mean", "perf/trained_tokens"):
        assert ref[key] == other[key], (label, key, ref[key], other[key])
    for key, tol in (("actor/pg_loss", 1e-5), ("actor/entropy", 1e-5), ("actor/grad_norm", 1e-4)):
        assert abs(ref[key] - other[key]) <= tol, (label, key, ref[key], other[key])


@pytest.mark.multiproc
def test_model_parallel_layouts_equal_the_single_rank_run(
    ray_session, models, tmp_path, grpo_step_reference, grpo_steps_reference, smoke_score
):
    ref = first_step(
        tmp_path, "fsdp1", models["dense"], reference=(grpo_step_reference, smoke_score)
    )
    for name, overrides in [
        ("tp2", ["actor.parallel.tensor=2"]),
        ("pp2", ["actor.parallel.pipeline=2"]),
        ("cp2", ["actor.parallel.context=2"]),
    ]:
        row = first_step(
            tmp_path,
            name,
            models["dense"],
            "actor.engine=megatron",
            "resources.world_size=2",
            *overrides,
            steps=2 if name == "cp2" else 1,
        )
        assert_same_step(ref, row, name)
        if name == "cp2":  # its second step, from weights its own update and sync left
            assert_later_steps(row, models["dense"], grpo_steps_reference, smoke_score, name)
    # fsdp with Ulysses sequence parallelism over the 2 ranks: one data-parallel replica
    sp2 = first_step(
        tmp_path,
        "fsdp_sp2",
        models["dense"],
        "resources.world_size=2",
        "actor.parallel.context=2",
        steps=2,
    )
    assert_same_step(ref, sp2, "fsdp_sp2")
    assert_later_steps(sp2, models["dense"], grpo_steps_reference, smoke_score, "fsdp_sp2")


@pytest.mark.multiproc
def test_two_data_parallel_ranks_equal_one(
    ray_session, models, tmp_path, grpo_step_reference, smoke_score
):
    """`-p smoke resources.world_size=2` (fsdp, dp=2) against `resources.world_size=1`."""
    one = first_step(tmp_path, "ws1", models["dense"], reference=(grpo_step_reference, smoke_score))
    two = first_step(tmp_path, "ws2", models["dense"], "resources.world_size=2")
    assert_same_step(one, two, "ws2")


@pytest.mark.multiproc
def test_data_parallel_layouts_equal_the_single_rank_run(
    ray_session, models, tmp_path, grpo_step_reference, smoke_score
):
    ref = first_step(tmp_path, "fsdp1", models["moe"], reference=(grpo_step_reference, smoke_score))
    fsdp2 = first_step(tmp_path, "fsdp2", models["moe"], "resources.world_size=2")
    assert_same_step(ref, fsdp2, "fsdp2")
    ep2 = first_step(
        tmp_path,
        "ep2",
        models["moe"],
        "actor.engine=megatron",
        "resources.world_size=2",
        "actor.parallel.expert=2",
    )
    assert_same_step(ref, ep2, "ep2")


@pytest.mark.multiproc
def test_reference_and_critic_on_pools_of_their_own_equal_the_colocated_run(
    ray_session, models, tmp_path, critic_step_reference
):
    """PPO with a critic and a KL loss: the reference and the critic on pools of their own
    (`resources.ref.ranks=1`, `resources.critic.ranks=1`) against all three colocated, and
    the colocated critic's step against the one written out in plain transformers; the
    checkpoint holds the critic and each group's RNG state."""
    ppo = [
        "-p",
        "ppo_critic",
        "actor.objective.use_kl_loss=true",
        "actor.objective.kl_loss_coef=0.01",
        "resources.cpus_per_rank=0.5",
    ]
    colocated = first_step(tmp_path, "colocated", models["dense"], *ppo)
    pools = first_step(
        tmp_path,
        "pools",
        models["dense"],
        *ppo,
        "resources.ref.ranks=1",
        "resources.critic.ranks=1",
        "resources.ref.cpus_per_rank=0.5",
        "resources.critic.cpus_per_rank=0.5",
        "trainer.save_final=true",
    )
    assert_same_step(colocated, pools, "pools")
    for key, tol in (("actor/kl_loss", 1e-5), ("critic/loss", 1e-5), ("critic/grad_norm", 1e-4)):
        assert abs(colocated[key] - pools[key]) <= tol, (key, colocated[key], pools[key])
    # the critic's step (GAE advantages, value loss, gradient norm over the two mini-batches)
    want = critic_step_reference(colocated["cfg"], colocated["samples"])
    got = [s["advantage"] for s in colocated["samples"]]
    assert got == pytest.approx(want["advantages"], abs=1e-5)
    assert colocated["critic/loss"] == pytest.approx(want["vf_loss"], rel=1e-5)
    assert colocated["critic/grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4)
    saved = tmp_path / "pools" / "checkpoints" / "step_1"
    assert (saved / "critic").is_dir() and (saved / "worker_rng_critic_rank0.pt").exists()
    assert (saved / "worker_rng_ref_rank0.pt").exists() and (saved / "worker_rng_rank0.pt").exists()


@pytest.mark.multiproc
def test_deepseek_v3_on_megatron_equals_its_transformers_step(
    ray_session, models, tmp_path, grpo_step_reference, smoke_score
):
    """`actor.engine=megatron` on a DeepSeek-V3 folder (MLA with YaRN, a dense first layer,
    group-limited sigmoid routing with its correction bias, a shared expert), generated by the
    hf rollout (transformers): scores, advantages, reward mean, pg loss and the gradient norm
    recomputed from the dumped samples in plain transformers; two steps run."""
    first_step(
        tmp_path,
        "deepseek",
        models["deepseek"],
        "actor.engine=megatron",
        steps=2,
        reference=(grpo_step_reference, smoke_score),
    )
