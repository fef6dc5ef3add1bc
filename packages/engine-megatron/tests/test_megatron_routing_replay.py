"""Routing replay: with the rollout's routes in the batch (`routed_experts`), every recorded
token goes to the recorded experts even when the router's weights moved since (the gates
recomputed from the current router), and the log-probs equal transformers forced onto those
routes; without them the engine routes by its own top-k, as transformers does."""

from __future__ import annotations

import copy

import pytest
import torch

from tephra.engine_api import BatchError, ConfigError, EngineConfig
from tephra.engine_api import batch as B
from tephra.engine_api.testing import nll_loss_fn, random_batch, run_distributed
from tephra.engine_api.testing.moe_routes import (
    forced_routes,
    log_probs,
    record_routes,
    routers,
)
from tephra.engine_megatron import testing as T
from tephra.engine_megatron.engine import MegatronEngine


@pytest.mark.parametrize("family", ["moe", "qwen3_moe_step2"])
def test_replayed_routes_survive_a_moved_router(tmp_path, family):
    cfg = T.TINY_MOE if family == "moe" else T.FAMILIES[family]
    rollout = T.HFReference(cfg, init_seed=3).model  # the weights that generated
    batch = random_batch(cfg["vocab_size"], num_sequences=6, seed=5)
    routes = record_routes(rollout, batch)
    trained = copy.deepcopy(rollout)  # the router moved since the rollout
    torch.manual_seed(1)
    with torch.no_grad():
        for gate in routers(trained):
            gate.weight.add_(0.05 * torch.randn_like(gate.weight))
    trained.save_pretrained(tmp_path / "hf")
    own_routes = record_routes(trained, batch)
    real = batch[B.ATTENTION_MASK].bool()
    moved = (own_routes.sort(-1).values != routes.sort(-1).values).any(-1)[real]
    assert moved.any(), "the perturbation routed no token differently: the test sees nothing"
    want_own = log_probs(trained, batch)
    with forced_routes(trained, routes):
        want_replay = log_probs(trained, batch)

    engine = MegatronEngine.build(
        EngineConfig(
            model={"path": str(tmp_path / "hf")},
            micro_batch={"use_packing": False},
            moe={"routing_replay": "rollout"},
        )
    )
    own = engine.forward(batch)["log_probs"]
    assert (own - want_own).abs().max() <= 1e-5
    replayed = batch.clone()
    replayed[B.ROUTED_EXPERTS] = routes
    got = engine.forward(replayed)["log_probs"]
    assert (got - want_replay).abs().max() <= 1e-5
    gap = float((want_own - want_replay).abs().max())
    assert gap > 1e-3, gap  # replay changed what the moved router would have done
    # the experts each router chose in that forward: the recorded ones on every real token
    b, t = batch[B.INPUT_IDS].shape
    replays = [r for entries in engine._replays.values() for _, r in entries]
    chosen = torch.stack([r.chosen.view(t, b, -1).transpose(0, 1) for r in replays], dim=2)
    assert torch.equal(chosen.sort(-1).values[real], routes.sort(-1).values[real])
    # training replays too: the loss is the NLL of the replayed log-probs, and the step's
    # gradient norm is that loss's in transformers forced onto the recorded routes (the
    # gates' softmax still differentiated through the moved router)
    with engine.train_mode():
        loss = engine.forward_backward(replayed, nll_loss_fn)["loss"]
        norm = engine.optimizer_step()
    mask = batch[B.RESPONSE_MASK]
    assert abs(loss - float(-(want_replay * mask).sum() / mask.sum())) <= 1e-5
    assert norm == pytest.approx(_replayed_grad_norm(trained, batch, routes), rel=1e-4)


def _replayed_grad_norm(model, batch, routes) -> float:
    """The norm of the gradient of the token-mean NLL of the response tokens over every
    parameter of the transformers `model`, its routers forced onto `routes`."""
    model.zero_grad()
    with forced_routes(model, routes):
        logits = model(
            input_ids=batch[B.INPUT_IDS],
            attention_mask=batch[B.ATTENTION_MASK],
            position_ids=batch[B.POSITION_IDS],
        ).logits.float()
    ids, mask = batch[B.INPUT_IDS], batch[B.RESPONSE_MASK][:, 1:].float()
    picked = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
    (-(picked * mask).sum() / mask.sum()).backward()
    grads = [p.grad.double() for p in model.parameters() if p.grad is not None]
    return float(torch.sqrt(sum((g**2).sum() for g in grads)))


def test_bad_routes_name_the_field():
    engine = MegatronEngine.build(T.base_config(T.TINY_MOE, moe={"routing_replay": "rollout"}))
    batch = random_batch(T.TINY_MOE["vocab_size"], num_sequences=2, seed=1)
    b, t = batch[B.INPUT_IDS].shape
    wrong = batch.clone()
    wrong[B.ROUTED_EXPERTS] = torch.zeros(b, t, 3, 2, dtype=torch.int64)
    with pytest.raises(BatchError, match=r"routed_experts.*\[batch, seq, moe_layers, top_k\]"):
        engine.forward(wrong)
    wrong[B.ROUTED_EXPERTS] = torch.full((b, t, 2, 2), 4, dtype=torch.int64)
    with pytest.raises(BatchError, match=r"routed_experts.*outside \[-1, 4\)"):
        engine.forward(wrong)
    # without moe.routing_replay=rollout the field is ignored: the engine's own routes
    off = MegatronEngine.build(T.base_config(T.TINY_MOE))
    assert torch.equal(off.forward(wrong)["log_probs"], off.forward(batch)["log_probs"])
    dense = {**T.TINY_DENSE, "num_hidden_layers": 2}
    with pytest.raises(ConfigError, match=r"moe.routing_replay='rollout' on a 'qwen2' model"):
        MegatronEngine.check_config(T.base_config(dense, moe={"routing_replay": "rollout"}))


@pytest.mark.multiproc
def test_replay_in_every_parallel_layout(tmp_path):
    """The routes follow the tokens wherever a layout puts them: sequence-parallel slices
    (TP=2 + SP), load-balanced context-parallel chunks (CP=2, packed), experts on other ranks
    (EP=2). Each equals transformers forced onto the recorded routes, the router moved."""
    cfg = T.TINY_MOE
    rollout = T.HFReference(cfg, init_seed=3).model
    batch = random_batch(cfg["vocab_size"], num_sequences=6, seed=5)
    routes = record_routes(rollout, batch)
    trained = copy.deepcopy(rollout)
    torch.manual_seed(1)
    with torch.no_grad():
        for gate in routers(trained):
            gate.weight.add_(0.05 * torch.randn_like(gate.weight))
    trained.save_pretrained(tmp_path / "hf")
    with forced_routes(trained, routes):
        want = log_probs(trained, batch)
    mask = batch[B.RESPONSE_MASK]
    want_loss = float(-(want * mask).sum() / mask.sum())
    replayed = batch.clone()
    replayed[B.ROUTED_EXPERTS] = routes
    layouts = [{"tensor": 2, "sequence_parallel": True}, {"context": 2}, {"expert": 2}]
    calls = [(T.rank_replayed_log_probs, (str(tmp_path / "hf"), p, replayed)) for p in layouts]
    results = run_distributed(T.rank_sequence, 2, (calls,))
    for rank_results in results:
        for layout, (lp, loss) in zip(layouts, rank_results):
            assert (torch.from_numpy(lp) - want).abs().max() <= 1e-5, layout
            assert abs(loss - want_loss) <= 1e-5, layout
