"""The server driven by the real `tinker` SDK on loopback, checked against tephra's own
engine called directly (the same config, the same batch, the losses written out here)."""

from __future__ import annotations

import numpy as np
import pytest
import tinker
import torch
from tinker import types

from tephra.apps.serve.cli import BackgroundServer, make_service
from tephra.engine_api import batch as B
from tephra.engine_api.registry import get_engine

KEY = "tml-tephra-test"
RANK = 4
LR = 2e-2


@pytest.fixture(scope="module")
def server():
    service = make_service(["tiny=tiny"])
    with BackgroundServer(service, KEY) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return tinker.ServiceClient(base_url=server.url, api_key=KEY)


def datum(tokens: list[int], weights: list[float] | None = None) -> types.Datum:
    w = weights if weights is not None else [1.0] * (len(tokens) - 1)
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": w},
    )


def reference_step(
    server, rows: list[list[int]], steps: int, q=None, adv=None
) -> dict[str, torch.Tensor]:
    """tephra's engine alone: `steps` AdamW steps of the summed NLL of `rows`, the Tinker
    defaults (betas 0.9 / 0.95, eps 1e-12, no decay, no clipping) set in the config."""
    base = server.service.bases["tiny"]
    config = server.service.engine_config(base, RANK)
    config.optimizer.lr = LR
    config.optimizer.betas = (0.9, 0.95)
    config.optimizer.eps = 1e-12
    engine = get_engine("fsdp", config)
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.int64)
    attn = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        attn[i, : len(r)] = 1
    resp = attn.clone()
    resp[:, 0] = 0
    if q is None:
        batch = B.make_batch(ids, attn, resp)

        def nll(outputs, mb):
            return -(outputs["log_probs"] * mb[B.RESPONSE_MASK]).sum(), {}

    else:
        # importance sampling: -sum exp(log p - log q) * A over the targets
        pad = [[0.0] * (width - 1 - len(v)) for v in q]
        qt = torch.tensor([[0.0, *v, *p] for v, p in zip(q, pad)])
        at = torch.tensor([[0.0, *v, *p] for v, p in zip(adv, pad)])
        batch = B.make_batch(ids, attn, resp, q=qt, a=at)

        def nll(outputs, mb):
            ratio = torch.exp(outputs["log_probs"] - mb["q"]) * mb[B.RESPONSE_MASK]
            return -(ratio * mb["a"]).sum(), {}

    for _ in range(steps):
        with engine.train_mode():
            engine.forward_backward(batch, nll)
            engine.optimizer_step()
    with engine.eval_mode():
        return {n: t.clone() for bucket in engine.export_weights() for n, t in bucket}


def served_weights(server, model_id: str) -> dict[str, torch.Tensor]:
    service = server.service
    return service._worker.submit(
        lambda: service.engines[service.clients[model_id]].weights(model_id)
    ).result()


def assert_same_weights(got, want, atol=1e-5):
    assert got.keys() == want.keys()
    worst = max(float((got[k] - want[k]).abs().max()) for k in got)
    assert worst < atol, f"largest weight difference {worst}"


ROWS_A = [list(range(10, 30)), [3, 7, 11, 13, 17, 19, 23]]
ROWS_B = [list(range(100, 116)), [200, 201, 202, 203, 204, 205]]


def test_sft_loop_matches_engine_and_two_clients_keep_their_adapters(server, client):
    a = client.create_lora_training_client(base_model="tiny", rank=RANK).result()
    b = client.create_lora_training_client(base_model="tiny", rank=RANK).result()
    adam = types.AdamParams(learning_rate=LR)
    losses = []
    for _ in range(3):
        # interleaved: a's gradients are pending while b's call runs on the same engine
        fa = a.forward_backward([datum(r) for r in ROWS_A], "cross_entropy")
        fb = b.forward_backward([datum(r) for r in ROWS_B], "cross_entropy")
        oa, ob = a.optim_step(adam), b.optim_step(adam)
        losses.append(fa.result().metrics["loss:sum"])
        fb.result(), oa.result(), ob.result()
        if len(losses) == 1:
            # after one step: the served weights equal tephra's own engine's step
            assert_same_weights(
                served_weights(server, a.model_id), reference_step(server, ROWS_A, 1)
            )
    assert losses[-1] < losses[0], losses
    wa, wb = served_weights(server, a.model_id), served_weights(server, b.model_id)
    assert_same_weights(wa, reference_step(server, ROWS_A, 3))
    assert_same_weights(wb, reference_step(server, ROWS_B, 3))
    assert max(float((wa[k] - wb[k]).abs().max()) for k in wa) > 1e-3


def test_sample_log_probs_equal_the_models_forward(client):
    tc = client.create_lora_training_client(base_model="tiny", rank=RANK).result()
    tc.forward_backward([datum(r) for r in ROWS_A], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=LR)).result()
    sampler = tc.save_weights_and_get_sampling_client()
    prompt = [5, 9, 14]
    params = types.SamplingParams(max_tokens=6, seed=3, temperature=1.0)
    result = sampler.sample(
        types.ModelInput.from_ints(prompt), num_samples=2, sampling_params=params
    ).result()
    assert len(result.sequences) == 2
    for seq in result.sequences:
        assert len(seq.tokens) == 6 and len(seq.logprobs) == 6
        row = prompt + seq.tokens
        out = tc.forward([datum(row)], "cross_entropy").result()
        engine_lp = out.loss_fn_outputs[0]["logprobs"].to_numpy()[len(prompt) - 1 :]
        np.testing.assert_allclose(seq.logprobs, engine_lp, atol=1e-4)
    again = sampler.sample(
        types.ModelInput.from_ints(prompt), num_samples=2, sampling_params=params
    ).result()
    assert [s.tokens for s in again.sequences] == [s.tokens for s in result.sequences]
    # the samples of one call decode together; each is the one its seed gives alone
    second = types.SamplingParams(max_tokens=6, seed=4, temperature=1.0)
    alone = sampler.sample(types.ModelInput.from_ints(prompt), 1, second).result().sequences[0]
    assert alone.tokens == result.sequences[1].tokens
    np.testing.assert_allclose(alone.logprobs, result.sequences[1].logprobs, atol=1e-5)
    # a stop token ends its own sample only; the others run to max_tokens
    first = result.sequences[0].tokens
    stop = first[2]
    cut = first.index(stop) + 1
    params = types.SamplingParams(max_tokens=6, seed=3, temperature=1.0, stop=[stop])
    stopped = sampler.sample(
        types.ModelInput.from_ints(prompt), num_samples=2, sampling_params=params
    ).result()
    assert stopped.sequences[0].tokens == first[:cut]
    assert stopped.sequences[0].stop_reason == "stop"
    other = result.sequences[1].tokens
    if stop in other:
        assert stopped.sequences[1].tokens == other[: other.index(stop) + 1]
    else:
        assert stopped.sequences[1].tokens == other
        assert stopped.sequences[1].stop_reason == "length"


def test_refusals(server, client):
    with pytest.raises(tinker.AuthenticationError):
        tinker.ServiceClient(base_url=server.url, api_key="tml-wrong").create_lora_training_client(
            base_model="tiny", rank=RANK
        ).result()
    with pytest.raises(Exception, match="not served"):
        client.create_lora_training_client(base_model="no-such-model", rank=RANK).result()
    tc = client.create_lora_training_client(base_model="tiny", rank=RANK).result()
    with pytest.raises(Exception, match="loss_fn='ppo' is not served"):
        tc.forward_backward([datum(ROWS_A[0])], "ppo").result()
    with pytest.raises(
        tinker.BadRequestError, match="save_weights_external: this call is not served"
    ):
        tc.save_weights_external("checkpoint-1").result()
    shifted = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 3]),
        loss_fn_inputs={"target_tokens": [5, 6, 7], "weights": [1.0, 1.0, 1.0]},
    )
    with pytest.raises(Exception, match="target_tokens must be the next tokens"):
        tc.forward_backward([shifted], "cross_entropy").result()


def test_importance_sampling_step_matches_engine(server, client):
    tc = client.create_lora_training_client(base_model="tiny", rank=RANK).result()
    rng = np.random.default_rng(0)
    q = [(-rng.uniform(3, 7, len(r) - 1)).astype(np.float32).tolist() for r in ROWS_A]
    adv = [rng.normal(size=len(r) - 1).astype(np.float32).tolist() for r in ROWS_A]
    data = [
        types.Datum(
            model_input=types.ModelInput.from_ints(r[:-1]),
            loss_fn_inputs={"target_tokens": r[1:], "logprobs": lq, "advantages": la},
        )
        for r, lq, la in zip(ROWS_A, q, adv)
    ]
    tc.forward_backward(data, "importance_sampling").result()
    tc.optim_step(types.AdamParams(learning_rate=LR)).result()
    want = reference_step(server, ROWS_A, 1, q=q, adv=adv)
    assert_same_weights(served_weights(server, tc.model_id), want)


def test_command_line_refusals(tmp_path, monkeypatch):
    from tephra.apps.serve.cli import base_model, main
    from tephra.apps.serve.errors import UserError

    with pytest.raises(UserError, match="write NAME=SOURCE"):
        base_model("tiny")
    with pytest.raises(UserError, match="not tiny, demo, or a folder with config.json"):
        base_model(f"mine={tmp_path}")
    monkeypatch.delenv("TEPHRA_SERVE_API_KEY", raising=False)
    with pytest.raises(SystemExit, match="give --api-key"):
        main(["--model", "tiny=tiny"])
