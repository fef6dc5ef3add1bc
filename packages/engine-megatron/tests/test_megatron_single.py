"""Single-process tests: the critic head, refused settings, checkpoint errors, schedules."""

from __future__ import annotations

import json
import math

import pytest
import torch

from tephra.engine_api import CheckpointError, ConfigError, SchedulerConfig, apply_overrides
from tephra.engine_api.adapters import LoraAdapter
from tephra.engine_api.testing import nll_loss_fn, random_batch, run_conformance
from tephra.engine_megatron import testing as T
from tephra.engine_megatron.engine import MegatronEngine
from tephra.engine_megatron.lr_schedule import LrSchedule

SMALL = {**T.TINY_DENSE, "num_hidden_layers": 2}


def test_value_role_matches_hidden_state_head(tmp_path):
    """values[t] = score . h_{t-1} (final-norm hidden state of the HF model), 0 off the
    response; a value loss trains; export_hf writes a token-classification folder."""
    import transformers

    engine = MegatronEngine.build(apply_overrides(T.base_config(SMALL), {"model.role": "value"}))
    batch = random_batch(SMALL["vocab_size"], num_sequences=4, seed=1)
    out = engine.forward(batch)
    assert set(out.keys()) == {"values"}
    ref = T.HFReference(SMALL).model
    head = dict(w for b in engine.export_weights() for w in b)["score.weight"].cpu()
    with torch.no_grad():
        hidden = ref.model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            position_ids=batch["position_ids"],
        ).last_hidden_state
    want = torch.zeros(batch["input_ids"].shape)
    want[:, 1:] = (hidden @ head.T)[:, :-1, 0]
    want = want * batch["response_mask"]
    assert (out["values"] - want).abs().max() < 1e-5

    def value_loss(outputs, mb):
        mask = mb["response_mask"].float()
        loss = ((outputs["values"] - 1.0) ** 2 * mask).sum() / mb["global_token_count"][0]
        return loss, {}

    # the same loss and its gradient norm in plain transformers: the backbone and the head
    score = torch.nn.Parameter(head.clone())
    hidden = ref.model(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        position_ids=batch["position_ids"],
    ).last_hidden_state
    values = torch.zeros(batch["input_ids"].shape)
    values[:, 1:] = (hidden @ score.T)[:, :-1, 0]
    mask = batch["response_mask"].float()
    want_loss = ((values - 1.0) ** 2 * mask).sum() / mask.sum()
    want_loss.backward()
    grads = [p.grad for p in [*ref.model.parameters(), score] if p.grad is not None]
    want_norm = float(torch.sqrt(sum((g.double() ** 2).sum() for g in grads)))
    with engine.train_mode():
        first = engine.forward_backward(batch, value_loss)["loss"]
        assert first == pytest.approx(float(want_loss), rel=1e-5)
        assert engine.optimizer_step() == pytest.approx(want_norm, rel=1e-4)
        second = engine.forward_backward(batch, value_loss)["loss"]
    assert second < first
    engine.export_hf(tmp_path / "critic")
    critic = transformers.AutoModelForTokenClassification.from_pretrained(tmp_path / "critic")
    assert torch.equal(critic.score.weight, engine.hf_weights()["score.weight"].cpu())


def test_sum_pi_squared_on_request_matches_hf(tmp_path):
    """forward(extra_outputs=("sum_pi_squared",)) gives sum_v p_v^2 of the HF model's float64
    softmax (the kit's check), with and without entropy; a critic refuses it by name."""
    for overrides in ({}, {"compute_entropy": False}):
        spec = T.conformance_spec(SMALL, {}, tmp_path)
        base = spec.make_engine
        spec.make_engine = lambda o, base=base, extra=overrides: base({**o, **extra})
        checks = ["forward_sum_pi_squared", "forward_matches_reference"]
        assert run_conformance(spec, checks) == checks
    critic = MegatronEngine.build(apply_overrides(T.base_config(SMALL), {"model.role": "value"}))
    batch = random_batch(SMALL["vocab_size"], num_sequences=2, seed=1)
    with pytest.raises(ConfigError, match="only an engine with model.role='policy'"):
        critic.forward(batch, extra_outputs=("sum_pi_squared",))


@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"lora.rank": 8, "lora.dropout": 0.1}, "lora.dropout"),
        ({"lora.rank": 8, "lora.target_modules": ["q_proj", "lm_head"]}, "lora.target_modules"),
        ({"lora.rank": 8, "lora.target_modules": "q_proj|v_proj"}, "lora.target_modules"),
        ({"precision.param_dtype": "float16"}, "precision.param_dtype"),
        ({"parallel.tensor": 3}, "parallel.tensor"),
        ({"parallel.expert": 2}, "parallel.expert"),
    ],
)
def test_refused_settings_name_the_field(overrides, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        MegatronEngine.build(apply_overrides(T.base_config(SMALL), overrides))


def test_the_device_asked_for_is_the_device_it_gets(monkeypatch):
    """megatron-core takes the GPU whenever one is visible: device='cpu' there is refused
    rather than ignored, as is device='cuda' without one (checked here with CUDA answered
    as present, then as absent)."""
    from tephra.engine_megatron import cpu_compat

    monkeypatch.setattr(cpu_compat, "cuda_absent", lambda: False)
    with pytest.raises(ConfigError, match=r"device='cpu'.*CUDA_VISIBLE_DEVICES"):
        MegatronEngine.check_config(apply_overrides(T.base_config(SMALL), {"device": "cpu"}))
    MegatronEngine.check_config(apply_overrides(T.base_config(SMALL), {"device": "auto"}))
    monkeypatch.setattr(cpu_compat, "cuda_absent", lambda: True)
    with pytest.raises(ConfigError, match=r"device='cuda'"):
        MegatronEngine.check_config(apply_overrides(T.base_config(SMALL), {"device": "cuda"}))
    MegatronEngine.check_config(apply_overrides(T.base_config(SMALL), {"device": "cpu"}))


def test_contract_kit_coordinates_and_lora(tmp_path):
    """The kit's checks of the contract's coordinates and optional parts at one rank:
    `dp_rank` 0 of 1, its own output rank; `Capability.LORA`: after a step, `reference_mode()`
    gives the base model's log-probs and the exported adapter, loaded by peft over the base
    model, gives the engine's (both against transformers); without adapters both are
    refused naming `lora.rank`; `load_adapter_weights()` is refused naming itself."""
    checks = [
        "data_parallel_coordinates",
        "reference_mode_is_base_model",
        "adapter_export_matches",
    ]
    spec = T.conformance_spec(SMALL, {}, tmp_path)
    assert run_conformance(spec, checks) == checks
    engine = spec.make_engine({})
    assert (engine.dp_rank, engine.dp_size, engine.is_dp_output_rank) == (0, 1, True)
    with pytest.raises(ConfigError, match=r"reference_mode\(\) needs LoRA \(lora\.rank"):
        with engine.reference_mode():
            pass
    # a weights-only adapter load is the part of Capability.LORA this engine refuses
    adapter = LoraAdapter(rank=4, alpha=8.0, tensors={})
    with pytest.raises(ConfigError, match=r"load_adapter_weights\(\) is not implemented"):
        engine.load_adapter_weights(adapter)


def test_lora_on_moe_adapts_attention_only():
    """An MoE model's experts take no adapters: 'all-linear' and MLP names are refused before
    any rank starts, naming the field and the attention names that work."""
    moe = T.base_config(T.TINY_MOE)
    for targets in ("all-linear", ["q_proj", "gate_proj"]):
        cfg = apply_overrides(moe, {"lora.rank": 8, "lora.target_modules": targets})
        with pytest.raises(ConfigError, match=r"lora\.target_modules=.*'q_proj', 'k_proj'"):
            MegatronEngine.check_config(cfg)
    attention = {"lora.rank": 8, "lora.target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}
    MegatronEngine.check_config(apply_overrides(moe, attention))


def test_bad_model_folder_and_checkpoint_errors(tmp_path):
    from tephra.engine_api import EngineConfig

    with pytest.raises(ConfigError, match="model.path"):
        MegatronEngine.build(EngineConfig(model={"path": str(tmp_path)}))
    engine = MegatronEngine.build(T.base_config(SMALL))
    with pytest.raises(CheckpointError, match="meta.json"):
        engine.load_checkpoint(tmp_path / "nothing")
    other = MegatronEngine.build(T.base_config({**SMALL, "hidden_size": 32}))
    other.save_checkpoint(tmp_path / "other")
    with pytest.raises(CheckpointError, match="shape"):
        engine.load_checkpoint(tmp_path / "other")
    # a checkpoint written before the Gemma-3 shape fields existed (they hold their defaults)
    engine.save_checkpoint(tmp_path / "older")
    meta_file = tmp_path / "older" / "meta.json"
    meta = json.loads(meta_file.read_text())
    for added in ("gemma", "layer_ropes", "activation"):
        del meta["shape"][added]
    meta_file.write_text(json.dumps(meta))
    engine.load_checkpoint(tmp_path / "older")


def test_lr_schedule_drives_megatrons_groups_by_hand():
    """The shared schedules on Megatron's parameter groups: the first step of a warmup runs
    at peak / W (it ran at 0 before the engines shared one schedule), and a loaded state
    resumes the lr."""
    groups = [{"lr": None}, {"lr": None}]
    cos = SchedulerConfig(name="cosine", warmup_steps=2, total_steps=12, min_lr_ratio=0.1)
    sched = LrSchedule(lambda: groups, 1e-3, cos)
    seen = [groups[0]["lr"]] + [sched.step() for _ in range(7)]
    assert seen[:3] == pytest.approx([0.5e-3, 1e-3, 1e-3])
    assert seen[7] == pytest.approx(1e-3 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5))))
    assert groups[1]["lr"] == seen[7]
    again = LrSchedule(lambda: groups, 1e-3, cos)
    again.load_state_dict(sched.state_dict())
    assert groups[0]["lr"] == seen[7]


def test_bf16_compute_with_float32_master_weights(tmp_path):
    """bf16 parameters, float32 AdamW master weights: log-probs near the fp32 engine's, a step
    lowers the loss, and a checkpoint resumes the identical next step."""
    from tephra.engine_api.testing import nll_loss_fn

    batch = random_batch(SMALL["vocab_size"], num_sequences=4, seed=2)
    fp32 = MegatronEngine.build(T.base_config(SMALL))
    bf16_cfg = apply_overrides(T.base_config(SMALL), {"precision.param_dtype": "bfloat16"})
    bf16 = MegatronEngine.build(bf16_cfg)
    assert (bf16.forward(batch)["log_probs"] - fp32.forward(batch)["log_probs"]).abs().max() < 0.1
    assert all(m.dtype == torch.float32 for m in bf16.master)
    with bf16.train_mode():
        first = bf16.forward_backward(batch, nll_loss_fn)["loss"]
        bf16.optimizer_step()
    bf16.save_checkpoint(tmp_path / "ck")
    with bf16.train_mode():
        second = bf16.forward_backward(batch, nll_loss_fn)["loss"]
        norm = bf16.optimizer_step()
    assert second < first
    resumed = MegatronEngine.build(bf16_cfg)
    resumed.load_checkpoint(tmp_path / "ck")
    with resumed.train_mode():
        assert resumed.forward_backward(batch, nll_loss_fn)["loss"] == second
        assert resumed.optimizer_step() == norm


def test_gradient_checkpointing_gives_the_same_step():
    """Recomputing activations in backward changes nothing: same loss, same grad norm."""
    from tephra.engine_api.testing import nll_loss_fn

    batch = random_batch(SMALL["vocab_size"], num_sequences=4, seed=3)
    results = []
    for ckpt in (False, True):
        engine = MegatronEngine.build(
            apply_overrides(T.base_config(SMALL), {"model.gradient_checkpointing": ckpt})
        )
        with engine.train_mode():
            results.append(
                (engine.forward_backward(batch, nll_loss_fn)["loss"], engine.optimizer_step())
            )
    assert results[0][0] == pytest.approx(results[1][0], abs=1e-6)
    assert results[0][1] == pytest.approx(results[1][1], rel=1e-5)


def test_non_finite_grad_norm_skips_the_update():
    """A NaN loss gives a NaN grad norm: the weights stay, the Adam state and schedule stay,
    and the gradient buffers are cleared, so the next step equals a fresh engine's first."""
    from tephra.engine_api.testing import nll_loss_fn

    def nan_loss(outputs, mb):
        loss, metrics = nll_loss_fn(outputs, mb)
        return loss * float("nan"), metrics

    batch = random_batch(SMALL["vocab_size"], num_sequences=4, seed=4)
    engine = MegatronEngine.build(T.base_config(SMALL))
    before = engine.hf_weights()
    with engine.train_mode():
        engine.forward_backward(batch, nan_loss)
        assert math.isnan(engine.optimizer_step())
    after = engine.hf_weights()
    assert all(torch.equal(before[k], after[k]) for k in before)
    fresh = MegatronEngine.build(T.base_config(SMALL))
    results = []
    for e in (engine, fresh):
        with e.train_mode():
            results.append((e.forward_backward(batch, nll_loss_fn)["loss"], e.optimizer_step()))
    assert results[0] == results[1]
    assert all(
        torch.equal(a, b) for a, b in zip(engine.hf_weights().values(), fresh.hf_weights().values())
    )


@pytest.mark.parametrize("tied", [False, True])
def test_padding_row_of_the_embedding_is_not_trained(tied):
    """transformers' embedding has `padding_idx=pad_token_id`: its lookups pass no gradient to
    that row, even where the pad id is a real (sampled) token; a tied output layer still
    trains it. The engine must agree, or its grad norm and update differ from HF's (and
    FSDP's) on such a batch."""
    cfg = {**SMALL, "pad_token_id": 3, "tie_word_embeddings": tied}
    engine = MegatronEngine.build(T.base_config(cfg))
    ref = T.HFReference(cfg).model
    batch = random_batch(cfg["vocab_size"], num_sequences=4, seed=2)
    ids = batch["input_ids"]
    ids[batch["response_mask"].bool() & (torch.arange(ids.shape[1]) % 3 == 0)] = 3
    before = engine.hf_weights()["model.embed_tokens.weight"].clone()

    logp = torch.log_softmax(
        ref(
            input_ids=ids,
            attention_mask=batch["attention_mask"],
            position_ids=batch["position_ids"],
        ).logits.float(),
        -1,
    )
    lp = torch.zeros(ids.shape)
    lp[:, 1:] = logp[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
    mask = batch["response_mask"].float()
    (-(lp * mask).sum() / mask.sum()).backward()
    want = torch.sqrt(sum(p.grad.double().pow(2).sum() for p in ref.parameters()))
    pad_row_grad = ref.model.embed_tokens.weight.grad[3].abs().sum()
    assert (pad_row_grad > 0) == tied  # what HF does: only the tied head trains the row

    with engine.train_mode():
        engine.forward_backward(batch, nll_loss_fn)
        norm = engine.optimizer_step()
    assert abs(norm - float(want)) <= 1e-4
    after = engine.hf_weights()["model.embed_tokens.weight"]
    assert torch.equal(after[3], before[3]) != tied and not torch.equal(after, before)
