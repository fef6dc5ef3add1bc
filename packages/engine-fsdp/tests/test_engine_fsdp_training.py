"""Mixed precision, value model, memory options, schedules, HF export and bad inputs."""

import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

from tephra.engine_api import BatchError, CheckpointError, ConfigError, SchedulerConfig
from tephra.engine_api import batch as B
from tephra.engine_api.lr_schedules import SCHEDULES
from tephra.engine_api.testing import nll_loss_fn, random_batch
from tephra.engine_fsdp import FSDPEngine
from tephra.engine_fsdp.testing import TINY_VOCAB, tiny_engine_config, tiny_qwen2_config, train_step


@pytest.fixture(scope="module")
def batch():
    return random_batch(TINY_VOCAB, num_sequences=8, seed=7)


def test_bf16_mixed_precision_trains(batch):
    engine = FSDPEngine.build(tiny_engine_config(**{"precision.param_dtype": "bfloat16"}))
    fp32 = FSDPEngine.build(tiny_engine_config())
    losses = [train_step(engine, batch)[0] for _ in range(4)]
    first_fp32 = train_step(fp32, batch)[0]
    assert abs(losses[0] - first_fp32) < 0.05  # bf16 rounding, same model
    assert losses[-1] < losses[0] - 0.5, losses
    # master weights stay float32
    assert all(p.dtype == torch.float32 for p in engine.hf_model.parameters())


def test_checkpointing_and_offload_change_nothing(batch):
    plain = FSDPEngine.build(tiny_engine_config())
    other = FSDPEngine.build(
        tiny_engine_config(
            **{
                "model.gradient_checkpointing": True,
                "offload.params": True,
                "offload.optimizer": True,
            }
        )
    )
    # the name every supported transformers has (5.2x adds is_activation_checkpointing as the new one)
    assert other.hf_model.is_gradient_checkpointing
    for _ in range(2):
        (la, ga), (lb, gb) = train_step(plain, batch), train_step(other, batch)
        assert la == pytest.approx(lb, abs=1e-6) and ga == pytest.approx(gb, rel=1e-5)


def test_non_finite_grad_norm_skips_the_update(batch):
    engine = FSDPEngine.build(tiny_engine_config(**{"compute_entropy": False}))
    with engine.eval_mode():
        before = engine.forward(batch)
    assert "entropy" not in before.keys()

    def exploding(outputs, mb):
        return (outputs["log_probs"] * float("inf")).sum(), {}

    _, norm = train_step(engine, batch, exploding)
    assert not math.isfinite(norm)
    with engine.eval_mode():
        assert torch.equal(engine.forward(batch)["log_probs"], before["log_probs"])
    assert engine.step == 0


def value_loss(outputs, mb):
    mask = mb[B.RESPONSE_MASK].float()
    err = (outputs["values"] - mb[B.RETURNS]) ** 2 * mask
    return err.sum() / mb[B.GLOBAL_TOKEN_COUNT][0], {}


def test_value_model_trains_and_exports_as_token_classifier(batch, tmp_path):
    engine = FSDPEngine.build(tiny_engine_config(**{"model.role": "value", "optimizer.lr": 3e-3}))
    data = batch.clone()
    data[B.RETURNS] = data[B.RESPONSE_MASK].float() * 0.5
    losses = [train_step(engine, data, value_loss)[0] for _ in range(6)]
    assert losses[-1] < 0.5 * losses[0], losses
    with engine.eval_mode():
        values = engine.forward(data)["values"]
    assert values.shape == data[B.INPUT_IDS].shape
    assert torch.all(values[data[B.RESPONSE_MASK] == 0] == 0)
    engine.export_hf(tmp_path / "critic")
    critic = AutoModelForTokenClassification.from_pretrained(tmp_path / "critic").eval()
    assert critic.score.weight.shape == (1, 64)
    with torch.no_grad():
        scores = critic(
            input_ids=data[B.INPUT_IDS],
            attention_mask=data[B.ATTENTION_MASK],
            position_ids=data[B.POSITION_IDS],
        ).logits[..., 0]
    want = B.align_to_tokens(scores) * data[B.RESPONSE_MASK]
    torch.testing.assert_close(values, want, atol=1e-5, rtol=0)


def test_value_model_packed_equals_padded(batch):
    values = {}
    for packing in (True, False):
        engine = FSDPEngine.build(
            tiny_engine_config(
                **{
                    "model.role": "value",
                    "micro_batch.use_packing": packing,
                    "micro_batch.max_tokens_per_microbatch": 40,
                }
            )
        )
        with engine.eval_mode():
            values[packing] = engine.forward(batch)["values"]
    assert values[True].abs().max() > 0
    torch.testing.assert_close(values[True], values[False], atol=1e-5, rtol=0)


def test_export_hf_loads_in_transformers_and_back_into_the_engine(batch, tmp_path):
    import tokenizers

    src = tmp_path / "src"
    engine = FSDPEngine.build(tiny_engine_config())
    train_step(engine, batch)
    engine.export_hf(src)
    model = AutoModelForCausalLM.from_pretrained(src).eval()
    with torch.no_grad():
        logits = model(
            input_ids=batch[B.INPUT_IDS],
            attention_mask=batch[B.ATTENTION_MASK],
            position_ids=batch[B.POSITION_IDS],
        ).logits
    logp = torch.log_softmax(logits, -1)[:, :-1].gather(-1, batch[B.INPUT_IDS][:, 1:, None])[..., 0]
    with engine.eval_mode():
        got = engine.forward(batch)["log_probs"]
    want = torch.zeros_like(got)
    want[:, 1:] = logp
    torch.testing.assert_close(got, want * batch[B.RESPONSE_MASK], atol=1e-5, rtol=0)
    # a folder with a tokenizer: the engine builds from it and exports the tokenizer too
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.save(str(src / "tokenizer.json"))
    reloaded = FSDPEngine.build(
        tiny_engine_config(**{"model.path": str(src), "model.hf_config": None})
    )
    with reloaded.eval_mode():
        torch.testing.assert_close(reloaded.forward(batch)["log_probs"], got, atol=1e-6, rtol=0)
    reloaded.export_hf(tmp_path / "again")
    assert (tmp_path / "again" / "tokenizer.json").is_file()
    # tied embeddings: lm_head only on request, and then equal to the embeddings
    with engine.eval_mode():
        plain = dict(w for b in engine.export_weights() for w in b)
        untied = dict(
            w for b in engine.export_weights(bucket_bytes=1, untie_word_embeddings=True) for w in b
        )
    assert "lm_head.weight" not in plain
    assert torch.equal(untied["lm_head.weight"], plain["model.embed_tokens.weight"])


def test_schedules_match_hand_computed_values():
    cos = SchedulerConfig(name="cosine", warmup_steps=2, total_steps=6, min_lr_ratio=0.1)
    assert [SCHEDULES.get("cosine")(s, cos) for s in (0, 1, 2, 4, 6, 9)] == pytest.approx(
        [0.5, 1.0, 1.0, 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)), 0.1, 0.1]
    )
    wsd = SchedulerConfig(name="wsd", warmup_steps=1, total_steps=10, decay_ratio=0.2)
    assert [SCHEDULES.get("wsd")(s, wsd) for s in (0, 1, 7, 8, 9, 10)] == pytest.approx(
        [1.0, 1.0, 1.0, 1.0, 0.5, 0.0]
    )
    const = SchedulerConfig(name="constant", warmup_steps=4)
    assert [SCHEDULES.get("constant")(s, const) for s in (0, 3, 50)] == [0.25, 1.0, 1.0]
    engine = FSDPEngine.build(
        tiny_engine_config(
            **{
                "scheduler.name": "wsd",
                "scheduler.warmup_steps": 1,
                "scheduler.total_steps": 10,
                "scheduler.decay_ratio": 0.2,
            }
        )
    )
    lrs = [engine.lr_scheduler_step() for _ in range(10)]
    assert lrs[-2:] == pytest.approx([0.5e-2, 0.0])


def test_bad_inputs_give_clear_errors(batch, tmp_path):
    with pytest.raises(ConfigError, match="model.path='/no/such/folder'"):
        FSDPEngine.build(
            tiny_engine_config(**{"model.path": "/no/such/folder", "model.hf_config": None})
        )
    odd = tmp_path / "odd"
    odd.mkdir()
    (odd / "config.json").write_text(json.dumps({"model_type": "not-a-model"}))
    with pytest.raises(ConfigError, match="model.path="):
        FSDPEngine.build(tiny_engine_config(**{"model.path": str(odd), "model.hf_config": None}))
    with pytest.raises(ConfigError, match="parallel.tensor"):
        FSDPEngine.build(tiny_engine_config(**{"parallel.tensor": 2}))
    engine = FSDPEngine.build(tiny_engine_config(**{"micro_batch.max_tokens_per_microbatch": 8}))
    with pytest.raises(BatchError, match="attention_mask"), engine.train_mode():
        engine.forward_backward(batch.exclude(B.ATTENTION_MASK), nll_loss_fn)
    with pytest.raises(BatchError, match="max_tokens_per_microbatch=8"), engine.train_mode():
        engine.forward_backward(batch, nll_loss_fn)
    big_vocab = batch.clone()
    big_vocab[B.INPUT_IDS] = big_vocab[B.INPUT_IDS] + TINY_VOCAB
    with pytest.raises(BatchError, match="vocab size"):
        engine.forward(big_vocab)
    with pytest.raises(CheckpointError, match="nothing-here"):
        engine.load_checkpoint(tmp_path / "nothing-here")
    other = FSDPEngine.build(
        tiny_engine_config(**{"model.hf_config": tiny_qwen2_config(intermediate_size=96)})
    )
    other.save_checkpoint(tmp_path / "other-model")
    with pytest.raises(CheckpointError, match="other-model.*another model"):
        engine.load_checkpoint(tmp_path / "other-model")


def test_registered_as_fsdp_engine():
    from tephra.engine_api import get_engine_class, installed_engines

    assert installed_engines()["fsdp"] == "tephra.engine_fsdp.engine:FSDPEngine"
    assert get_engine_class("fsdp") is FSDPEngine
