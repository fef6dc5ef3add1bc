"""Model families built tiny from a transformers config (Qwen3 with q/k norm, Mistral,
Gemma-3, Qwen3-MoE, MoE models with dense layers: DeepSeek-style first dense layer + shared
expert, every second layer sparse): HF -> Megatron -> HF bit-exact, log-probs and entropy
equal to transformers (1e-5), the conformance kit single-process and under TP=2 + SP / EP=2;
the Gemma-3 settings engine-megatron cannot express are refused by name."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from tephra.engine_api import BatchError, ConfigError, EngineConfig, apply_overrides
from tephra.engine_api.testing import random_batch, run_distributed
from tephra.engine_megatron import testing as T
from tephra.engine_megatron.engine import MegatronEngine


def _reference_outputs(model, batch):
    with torch.no_grad():
        logits = model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            position_ids=batch["position_ids"],
        ).logits.float()
    logp = torch.log_softmax(logits, -1)
    ids = batch["input_ids"]
    lp = torch.zeros(ids.shape)
    lp[:, 1:] = logp[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
    ent = torch.zeros(ids.shape)
    ent[:, 1:] = -(logp[:, :-1].exp() * logp[:, :-1]).sum(-1)
    mask = batch["response_mask"]
    return lp * mask, ent * mask


def _perturbed_folder(cfg, folder):
    """The family's transformers model saved to `folder`, norms and biases moved off their
    initial ones / zeros: a norm applied the wrong way (e.g. weight vs Gemma's 1 + weight)
    or a swapped norm name shows in the log-probs. Returns the model."""
    ref = T.HFReference(cfg, init_seed=3)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in ref.model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn(p.shape, generator=g) * 0.5)
        # DeepSeek-V3's routing bias (a buffer): a bias dropped or misplaced changes the routes
        for name, b in ref.model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.add_(torch.randn(b.shape, generator=g) * 0.1)
    ref.model.save_pretrained(folder)
    return ref.model


@pytest.mark.parametrize("family", sorted(T.FAMILIES))
def test_round_trip_and_log_probs_equal_transformers(tmp_path, family):
    cfg = T.FAMILIES[family]
    model = _perturbed_folder(cfg, tmp_path / "hf")
    engine = MegatronEngine.build(EngineConfig(model={"path": str(tmp_path / "hf")}))
    engine.export_hf(tmp_path / "out")
    original = load_file(tmp_path / "hf" / "model.safetensors")
    exported = load_file(tmp_path / "out" / "model.safetensors")
    assert original.keys() == exported.keys()
    assert all(torch.equal(original[k], exported[k]) for k in original)
    batch = random_batch(cfg["vocab_size"], num_sequences=6, seed=7)
    want_lp, want_ent = _reference_outputs(model, batch)
    out = engine.forward(batch)
    assert (out["log_probs"] - want_lp).abs().max() <= 1e-5
    assert (out["entropy"] - want_ent).abs().max() <= 1e-5


@pytest.mark.parametrize("family", sorted(T.FAMILIES))
def test_conformance_kit_single_process(tmp_path, family):
    (passed,) = T.rank_conformance_runs([(family, {}, "alltoall", None)], str(tmp_path))
    assert passed == T.kit_checks(T.FAMILIES[family])


@pytest.mark.parametrize("family", ["mistral", "gemma3"])
def test_sliding_window_past_the_window_equals_transformers(family):
    """Sequences longer than the window (8): the torch kernel's windowed blocks, packed and
    padded, equal transformers' sliding-window mask (Gemma-3: its sliding layer only); the
    kernels that do not apply a window refuse such sequences."""
    cfg = {**T.FAMILIES[family], "sliding_window": 8}
    batch = random_batch(
        cfg["vocab_size"], num_sequences=3, prompt_lengths=(4, 10), response_lengths=(6, 12), seed=1
    )
    assert int(batch["attention_mask"].sum(-1).min()) > 8
    want_lp, want_ent = _reference_outputs(T.HFReference(cfg).model, batch)
    for packing in (None, False):
        config = apply_overrides(T.base_config(cfg), {"micro_batch.use_packing": packing})
        engine = MegatronEngine.build(config)
        out = engine.forward(batch)
        assert (out["log_probs"] - want_lp).abs().max() <= 1e-5
        assert (out["entropy"] - want_ent).abs().max() <= 1e-5
    engine.attention_kernel = "flash_attn"  # as chosen on a GPU with flash-attn installed
    with pytest.raises(BatchError, match="sliding_window=8"):
        engine.forward(batch)


def test_gemma3_linear_rope_scaling_equals_transformers():
    """Gemma-3's larger checkpoints divide the full-attention layers' RoPE frequencies by a
    factor (`rope_type=linear`); the sliding layers keep theirs."""
    cfg = {
        **T.TINY_GEMMA3,
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        },
    }
    engine = MegatronEngine.build(T.base_config(cfg))
    batch = random_batch(cfg["vocab_size"], num_sequences=4, seed=5)
    want_lp, _ = _reference_outputs(T.HFReference(cfg).model, batch)
    assert (engine.forward(batch)["log_probs"] - want_lp).abs().max() <= 1e-5


_QWEN3_LINEAR = {
    **{k: v for k, v in T.TINY_QWEN3.items() if k != "rope_theta"},
    "rope_parameters": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
}


@pytest.mark.parametrize("family", ["llama31", "qwen2_yarn", "qwen3_linear", "deepseek_v3"])
def test_llama3_and_yarn_rope_scaling_equal_transformers(family):
    """Llama-3.1's llama3 and YaRN scaling over a 16-token original context (and Qwen3 with
    linear scaling), on sequences of up to 60 tokens where the scaled frequencies matter
    (the unscaled model's log-probs differ from the scaled one's by far more than the
    tolerance), packed and padded. DeepSeek-V3:
    YaRN on MLA's RoPE parts (interleaved pairs, the attention factor on them alone) and its
    mscale_all_dim in the softmax scale."""
    cfg = {
        "llama31": T.TINY_LLAMA31,
        "qwen2_yarn": T.TINY_QWEN2_YARN,
        "qwen3_linear": _QWEN3_LINEAR,
        "deepseek_v3": T.TINY_DEEPSEEK_V3,
    }[family]
    batch = random_batch(
        cfg["vocab_size"], num_sequences=3, prompt_lengths=(20, 30), response_lengths=(20, 30)
    )
    assert int(batch["attention_mask"].sum(-1).max()) >= 40
    want_lp, want_ent = _reference_outputs(T.HFReference(cfg).model, batch)
    unscaled = {**cfg, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
    unscaled_lp, _ = _reference_outputs(T.HFReference(unscaled).model, batch)
    # (DeepSeek-V3 rotates 8 of its 24 query/key dims: the difference is smaller there)
    assert (unscaled_lp - want_lp).abs().max() > 1e-4
    for packing in (None, False):
        config = apply_overrides(T.base_config(cfg), {"micro_batch.use_packing": packing})
        out = MegatronEngine.build(config).forward(batch)
        assert (out["log_probs"] - want_lp).abs().max() <= 1e-5
        assert (out["entropy"] - want_ent).abs().max() <= 1e-5


@pytest.mark.parametrize(
    "rope, match",
    [
        ({"rope_type": "dynamic", "factor": 2.0}, r"rope_type='dynamic' \(llama\).*'yarn'"),
        (
            {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [1.0] * 8},
            "rope_type='longrope'",
        ),
        ({"rope_type": "default", "partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
    ],
)
def test_rope_types_it_cannot_compute_are_refused(rope, match):
    cfg = {**T.TINY_LLAMA31, "rope_parameters": {"rope_theta": 1e4, **rope}}
    with pytest.raises(ConfigError, match=match):
        MegatronEngine.check_config(T.base_config(cfg))


_GRAD_BATCH = random_batch(
    128, num_sequences=4, prompt_lengths=(10, 20), response_lengths=(10, 25), seed=2
)


def _assert_gradients_equal(got, want, what) -> None:
    """Every weight's gradient within 2e-5 of transformers' (gradients up to 0.08; the
    read-back through Adam's step leaves 6e-6)."""
    assert got.keys() >= want.keys(), sorted(set(want) - set(got))
    worst = max(want, key=lambda k: abs(got[k] - want[k]).max())
    assert abs(got[worst] - want[worst]).max() <= 2e-5, (what, worst)


def test_deepseek_v3_gradients_equal_transformers():
    """One step's gradient of every weight (MLA's latent projections and norms, the router,
    experts, shared expert) equals plain autograd on transformers' DeepseekV3ForCausalLM."""
    got = T.rank_gradients(T.TINY_DEEPSEEK_V3, {}, _GRAD_BATCH)
    _assert_gradients_equal(got, T.reference_gradients(T.TINY_DEEPSEEK_V3, _GRAD_BATCH), "TP=1")


@pytest.mark.parametrize(
    "change, sections, match",
    [
        ({"attention_bias": True}, {}, "attention_bias=true .*deepseek_v3"),
        ({"rope_interleave": False}, {}, "rope_interleave=false"),
        ({"norm_topk_prob": False}, {}, "norm_topk_prob=false"),
        ({"topk_group": 1}, {}, "num_experts_per_tok=4 with topk_group=1"),
        ({}, {"parallel": {"tensor": 2}}, "tensor=2 without parallel.sequence_parallel"),
        ({}, {"parallel": {"context": 2}}, "parallel.context > 1 .*deepseek_v3"),
        ({}, {"lora": {"rank": 8}}, "lora.rank > 0 .*deepseek_v3"),
        ({}, {"moe": {"routing_replay": "rollout"}}, "routing_replay='rollout' .*deepseek_v3"),
    ],
)
def test_deepseek_v3_settings_it_cannot_express_are_refused(change, sections, match):
    """Refused by `check_config` before any rank starts, each naming the field and the fix."""
    config = T.base_config({**T.TINY_DEEPSEEK_V3, **change})
    config = apply_overrides(
        config, {f"{s}.{k}": v for s, fields in sections.items() for k, v in fields.items()}
    )
    with pytest.raises(ConfigError, match=match):
        MegatronEngine.check_config(config, world_size=10)


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("final_logit_softcapping", 30.0, "final_logit_softcapping=30.0"),
        ("attn_logit_softcapping", 50.0, "attn_logit_softcapping=50.0"),
        ("use_bidirectional_attention", True, "use_bidirectional_attention=true"),
        ("hidden_activation", "gelu", "hidden_activation='gelu'"),
        (
            "rope_parameters",
            {
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                "full_attention": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e6},
            },
            r"rope_parameters\['full_attention'\]\.rope_type='dynamic'",
        ),
    ],
)
def test_gemma3_settings_it_cannot_express_are_refused(field, value, match):
    """Refused by `check_config` (before any rank starts), each naming the field."""
    config = T.base_config({**T.TINY_GEMMA3, field: value})
    with pytest.raises(ConfigError, match=match):
        MegatronEngine.check_config(config)


@pytest.mark.multiproc
def test_qwen3_gemma3_tp2_sp_and_moe_ep2_conformance(tmp_path):
    """q/k norm weights see only this rank's heads under TP: their gradients are summed over
    TP (the kit's grad norm and step against the single-process reference say so). The
    dense-first MoE at EP=2: the dense layer is data-parallel, the experts split. Gemma-3 at
    TP=2 + SP: its sandwich norms see only this rank's tokens, their gradients summed over TP
    like the other norms'. DeepSeek-V3 at TP=2 + SP: MLA's heads split, its down projections
    replicated, the shared RoPE key's gradient reduce-scattered from every rank's heads, the
    experts replicated on both ranks (ETP=1) with their gradients summed over them; and at
    EP=2 (sigmoid, group-limited routing over experts on two ranks). Both DeepSeek-V3 layouts
    also from an HF folder: HF -> Megatron -> HF bit-exact, log-probs and entropy equal
    transformers, every weight's gradient equal transformers' autograd."""
    runs = [
        ("qwen3", {"tensor": 2, "sequence_parallel": True}, "alltoall", None),
        ("gemma3", {"tensor": 2, "sequence_parallel": True}, "alltoall", None),
        ("qwen3_moe", {"expert": 2}, "alltoall", None),
        ("qwen2_moe_dense_first", {"expert": 2}, "alltoall", None),
        ("deepseek_v3", {"tensor": 2, "sequence_parallel": True}, "alltoall", None),
        ("deepseek_v3", {"expert": 2}, "alltoall", None),
    ]
    # the kit compares log-probs with transformers but gradients only among the engine's own
    # runs: DeepSeek-V3's gradients against transformers' autograd, at both layouts
    # and from an HF folder: export_hf bit-exact, log-probs and entropy equal transformers
    grad_layouts = [{"tensor": 2, "sequence_parallel": True}, {"expert": 2}]
    ds = T.TINY_DEEPSEEK_V3
    model = _perturbed_folder(ds, tmp_path / "hf")
    calls = [(T.rank_conformance_runs, (runs, str(tmp_path)))]
    calls += [(T.rank_gradients, (ds, layout, _GRAD_BATCH)) for layout in grad_layouts]
    calls += [
        (T.rank_first_step, (str(tmp_path / "hf"), layout, _GRAD_BATCH, str(tmp_path / f"out{i}")))
        for i, layout in enumerate(grad_layouts)
    ]
    results = run_distributed(T.rank_sequence, 2, (calls,))
    want = T.reference_gradients(ds, _GRAD_BATCH)
    want_lp, want_ent = _reference_outputs(model, _GRAD_BATCH)
    original = load_file(tmp_path / "hf" / "model.safetensors")
    for i in range(len(grad_layouts)):
        exported = load_file(tmp_path / f"out{i}" / "model.safetensors")
        assert original.keys() == exported.keys(), grad_layouts[i]
        assert all(torch.equal(original[k], exported[k]) for k in original), grad_layouts[i]
    for kit_result, *gradients_and_steps in results:
        for run, passed in zip(runs, kit_result):
            assert passed == T.kit_checks(T.FAMILIES[run[0]]), run
        gradients, steps = gradients_and_steps[:2], gradients_and_steps[2:]
        for layout, got in zip(grad_layouts, gradients):
            _assert_gradients_equal(got, want, layout)
        for layout, (_, _, out) in zip(grad_layouts, steps):
            assert (out["log_probs"] - want_lp).abs().max() <= 1e-5, layout
            assert (out["entropy"] - want_ent).abs().max() <= 1e-5, layout
