"""Routing replay on transformers' MoE routers: with the rollout's routes in the batch
(`routed_experts`), every recorded token goes to the recorded experts even when the router's
weights moved since (gates from the current router), and the log-probs equal transformers
forced onto those routes; without them the engine routes by its own top-k."""

from __future__ import annotations

import copy
import os
import re
import subprocess
import sys

import pytest
import torch
import transformers

from tephra.engine_api import BatchError, EngineConfig
from tephra.engine_api import batch as B
from tephra.engine_api.testing import nll_loss_fn, random_batch
from tephra.engine_api.testing.moe_routes import (
    forced_routes,
    log_probs,
    record_routes,
    routers,
)
from tephra.engine_fsdp.engine import FSDPEngine, flex_attention_refusal

COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_experts=4,
    num_experts_per_tok=2,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    decoder_sparse_step=1,
    mlp_only_layers=[],
)
MODELS = {
    # gates: softmax over all experts at the chosen ones; a gated shared expert beside
    "qwen2_moe": transformers.Qwen2MoeConfig(
        shared_expert_intermediate_size=64, norm_topk_prob=False, **COMMON
    ),
    # gates renormalised over the chosen k
    "qwen3_moe": transformers.Qwen3MoeConfig(head_dim=16, norm_topk_prob=True, **COMMON),
}


@pytest.fixture
def moved_router(tmp_path):
    """(the rollout's model, a folder of the same model with its routers moved)."""

    def make(name):
        torch.manual_seed(3)
        rollout = transformers.AutoModelForCausalLM.from_config(MODELS[name]).eval()
        trained = copy.deepcopy(rollout)
        torch.manual_seed(1)
        with torch.no_grad():
            for gate in routers(trained):
                gate.weight.add_(0.05 * torch.randn_like(gate.weight))
        trained.save_pretrained(tmp_path / name)
        return rollout, trained, str(tmp_path / name)

    return make


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("packing", [False, True])
def test_replayed_routes_survive_a_moved_router(moved_router, name, packing):
    rollout, trained, folder = moved_router(name)
    batch = random_batch(128, num_sequences=6, seed=5)
    routes = record_routes(rollout, batch)
    real = batch[B.ATTENTION_MASK].bool()
    own_routes = record_routes(trained, batch)
    moved = (own_routes.sort(-1).values != routes.sort(-1).values).any(-1)[real]
    assert moved.any(), "the perturbation routed no token differently: the test sees nothing"
    want_own = log_probs(trained, batch)
    with forced_routes(trained, routes):
        want_replay = log_probs(trained, batch)
    assert float((want_own - want_replay).abs().max()) > 1e-3

    attention = "flex_attention" if packing else "sdpa"
    config = EngineConfig(
        model={"path": folder, "attn_implementation": attention},
        micro_batch={"use_packing": packing, "max_tokens_per_microbatch": 4096},
        moe={"routing_replay": "rollout"},
    )
    refusal = flex_attention_refusal(config, torch.device("cpu"))
    if refusal:
        # the engine refuses it too (test_flex_attention_is_refused_where_it_returns_nan)
        pytest.skip(refusal)
    engine = FSDPEngine.build(config)
    assert engine.packed == packing
    own = engine.forward(batch)["log_probs"]
    assert (own - want_own).abs().max() <= 1e-5
    replayed = batch.clone()
    replayed[B.ROUTED_EXPERTS] = routes
    got = engine.forward(replayed)["log_probs"]
    assert (got - want_replay).abs().max() <= 1e-5
    # the experts each router chose in that forward: the recorded ones on every real token
    chosen = torch.stack(engine.router_replay.chosen, dim=1)  # [tokens, layers, k]
    want = routes[real] if packing else routes.reshape(-1, *routes.shape[2:])[real.reshape(-1)]
    got_routes = chosen if packing else chosen[real.reshape(-1)]
    assert torch.equal(got_routes.sort(-1).values, want.sort(-1).values)
    if packing:
        return  # torch's flex attention has no backward on CPU
    with engine.train_mode():
        loss = engine.forward_backward(replayed, nll_loss_fn)["loss"]
    mask = batch[B.RESPONSE_MASK]
    assert abs(loss - float(-(want_replay * mask).sum() / mask.sum())) <= 1e-5


REFUSE_FLEX = """
import sys
from tephra.engine_api import ConfigError, EngineConfig
from tephra.engine_fsdp.engine import FSDPEngine
config = EngineConfig(
    model={"path": sys.argv[1], "attn_implementation": "flex_attention"},
    micro_batch={"use_packing": True},
)
try:
    FSDPEngine.build(config)
except ConfigError as exc:
    print(exc)
"""


def test_flex_attention_is_refused_where_it_returns_nan(moved_router):
    """As on an AVX2-only CPU: `ATEN_CPU_CAPABILITY=avx2` (read by torch at start, so in a
    process of its own) makes torch and its compiler take their AVX2 paths."""
    _, _, folder = moved_router("qwen3_moe")
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2"}
    done = subprocess.run(
        [sys.executable, "-c", REFUSE_FLEX, folder],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert re.search(r"attn_implementation='flex_attention'.*NaN.*sdpa", done.stdout), done.stdout


def test_bad_routes_name_the_field(moved_router):
    _, _, folder = moved_router("qwen2_moe")
    engine = FSDPEngine.build(
        EngineConfig(model={"path": folder}, moe={"routing_replay": "rollout"})
    )
    batch = random_batch(128, num_sequences=2, seed=1)
    b, t = batch[B.INPUT_IDS].shape
    wrong = batch.clone()
    wrong[B.ROUTED_EXPERTS] = torch.zeros(b, t, 3, 2, dtype=torch.int64)
    with pytest.raises(BatchError, match=r"routed_experts.*\[batch, seq, moe_layers, top_k\]"):
        engine.forward(wrong)
    wrong[B.ROUTED_EXPERTS] = torch.full((b, t, 2, 2), 4, dtype=torch.int64)
    with pytest.raises(BatchError, match=r"routed_experts.*outside \[-1, 4\)"):
        engine.forward(wrong)
    # without moe.routing_replay=rollout the field is ignored: the engine's own routes
    off = FSDPEngine.build(EngineConfig(model={"path": folder}))
    assert torch.equal(off.forward(wrong)["log_probs"], off.forward(batch)["log_probs"])
