"""Ulysses sequence parallelism (`parallel.context=2`) against a single-process run."""

import pytest
import torch

from tephra.engine_api import ConfigError
from tephra.engine_api.testing import CHECKS, random_batch, run_distributed
from tephra.engine_fsdp import FSDPEngine, ulysses
from tephra.engine_fsdp.family_matrix import tiny_config
from tephra.engine_fsdp.scorer import head_transform_of
from tephra.engine_fsdp.testing import (
    TINY_VOCAB,
    ULYSSES,
    distributed_ulysses,
    tiny_engine_config,
    tiny_qwen2_config,
    ulysses_outputs,
)


def test_unsupported_options_are_refused_at_build():
    with pytest.raises(ConfigError, match="divide the world size"):
        FSDPEngine.build(tiny_engine_config(**ULYSSES))  # 1 rank cannot hold 2 shards
    with pytest.raises(ConfigError, match="parallel.tensor=2"):
        FSDPEngine.build(tiny_engine_config(**{"parallel.tensor": 2}))
    with pytest.raises(ConfigError, match="moe_token_dispatcher"):
        FSDPEngine.check_config(
            tiny_engine_config(**{"parallel.moe_token_dispatcher": "allgather"})
        )
    gemma2 = tiny_engine_config(**{"model.attn_implementation": "eager"})
    gemma2.model.hf_config = dict(
        model_type="gemma2",
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        final_logit_softcapping=30.0,
    )
    # a soft-capped head is no longer refused: the scorer applies the cap in the kernel
    engine = FSDPEngine.build(gemma2)
    assert head_transform_of(engine.hf_model).softcap == 30.0
    bert = tiny_engine_config()
    bert.model.hf_config = tiny_config("bert")
    with pytest.raises(ConfigError, match="the output head runs a prediction transform"):
        FSDPEngine.build(bert)


def test_padded_length_and_segments():
    assert [ulysses.padded_length(n, 2) for n in (1, 2, 5)] == [2, 2, 6]
    pos = torch.tensor([0, 1, 2, 0, 1, 0])
    assert ulysses.segment_bounds(pos) == ((0, 3), (3, 5), (5, 6))


@pytest.mark.multiproc
def test_ulysses_sp2_conformance_and_parity_with_1_rank(tmp_path):
    ranks = run_distributed(distributed_ulysses, world_size=2, args=(str(tmp_path),))
    assert all(r["passed"] == list(CHECKS) for r in ranks)
    batch = random_batch(TINY_VOCAB, num_sequences=6, response_lengths=(1, 12), seed=11)
    lengths = batch["attention_mask"].sum(-1)
    assert len(set(lengths.tolist())) > 1  # unequal lengths packed together
    for kv in (2, 1):
        cfg = tiny_engine_config(**{"micro_batch.use_packing": True})
        cfg.model.hf_config = tiny_qwen2_config(num_key_value_heads=kv)
        want = ulysses_outputs(FSDPEngine.build(cfg), batch)
        for rank in ranks:
            for got in [rank[kv]] + ([rank["checkpointed"]] if kv == 2 else []):
                compare(got, want, kv)
    want = ulysses_outputs(FSDPEngine.build(tiny_engine_config(**{"lora.rank": 4})), batch)
    for rank in ranks:
        compare(rank["lora"], want, "lora")


def compare(got, want, label):
    torch.testing.assert_close(got["log_probs"], want["log_probs"], atol=1e-5, rtol=0)
    for (loss, norm), (want_loss, want_norm) in zip(got["steps"], want["steps"]):
        assert loss == pytest.approx(want_loss, abs=1e-5), label
        assert norm == pytest.approx(want_norm, abs=1e-4), label
