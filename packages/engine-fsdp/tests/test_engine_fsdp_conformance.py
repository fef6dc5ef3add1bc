"""The engine-api conformance kit against FSDPEngine, at world size 1 and 2."""

import pytest

from tephra.engine_api.testing import CHECKS, random_batch, run_conformance, run_distributed
from tephra.engine_fsdp import FSDPEngine
from tephra.engine_fsdp.testing import (
    TINY_VOCAB,
    conformance_spec,
    distributed_conformance,
    grouped_batch,
    tiny_engine_config,
    train_step,
)


def test_conformance_world_size_1(tmp_path):
    assert run_conformance(conformance_spec(tmp_path)) == list(CHECKS)
    # log-probs and entropy under a sampling temperature (logits / T)
    hot = conformance_spec(tmp_path, temperature=0.7)
    assert run_conformance(hot, ["forward_matches_reference"])


@pytest.mark.multiproc
def test_conformance_world_size_2_and_parity_with_1_rank(tmp_path):
    ranks = run_distributed(distributed_conformance, world_size=2, args=(str(tmp_path),))
    assert all(r["passed"] == list(CHECKS) for r in ranks)
    # single-process reference of the same two steps on the whole batch
    batch = random_batch(TINY_VOCAB, num_sequences=8, seed=5)
    engine = FSDPEngine.build(tiny_engine_config())
    expected = [train_step(engine, batch), train_step(engine, batch)]
    # and of the grouped batch with every row run whole
    engine = FSDPEngine.build(tiny_engine_config(**{"micro_batch.share_prefix": False}))
    grouped = grouped_batch()
    whole = [train_step(engine, grouped), train_step(engine, grouped)]
    for rank in ranks:
        for label in ("sharded", "replicated"):
            for (loss, norm), (want_loss, want_norm) in zip(rank["steps"][label], expected):
                assert loss == pytest.approx(want_loss, abs=1e-5), label
                assert norm == pytest.approx(want_norm, abs=1e-5), label
        for (loss, norm), (want_loss, want_norm) in zip(rank["shared_prefix"], whole):
            assert loss == pytest.approx(want_loss, abs=1e-5)
            assert norm == pytest.approx(want_norm, abs=1e-5)
