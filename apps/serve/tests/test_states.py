"""`save_state` and its loads, driven by the real `tinker` SDK: a state saved, trained past and
loaded again resumes exactly (the same steps give bitwise the weights of the run that took them
first), on the same client, on a new client, and on a server restarted on the same workdir."""

from __future__ import annotations

from pathlib import Path

import pytest
import tinker
import torch
from tinker import types
from torch.distributed.tensor import DTensor

from tephra.apps.serve.cli import BackgroundServer, make_service
from tephra.engine_api import batch as B
from tephra.engine_api.registry import get_engine

KEY = "tml-tephra-test"
RANK = 4
ADAM = types.AdamParams(learning_rate=2e-2)

ROWS = [list(range(10, 30)), [3, 7, 11, 13, 17, 19, 23]]
LATER = [  # the steps taken after the save, twice: one batch per step
    [list(range(40, 60))],
    [[5, 6, 7, 8, 9, 10, 11, 12], list(range(70, 80))],
    [list(range(90, 99)), [1, 2, 3, 4]],
]
OTHER = [list(range(100, 116)), [200, 201, 202, 203, 204, 205]]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("serve-workdir")


@pytest.fixture(scope="module")
def server(workdir):
    with BackgroundServer(make_service(["tiny=tiny"], workdir=workdir), KEY) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return tinker.ServiceClient(base_url=server.url, api_key=KEY)


def datum(tokens: list[int]) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )


def step(tc, rows: list[list[int]]) -> None:
    fb = tc.forward_backward([datum(r) for r in rows], "cross_entropy")
    opt = tc.optim_step(ADAM)
    fb.result(), opt.result()


def served_weights(server, model_id: str) -> dict[str, torch.Tensor]:
    service = server.service
    return service._worker.submit(
        lambda: service.engines[service.clients[model_id]].weights(model_id)
    ).result()


def largest_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_load_state_resumes_exactly(server, client, workdir):
    a = client.create_lora_training_client(base_model="tiny", rank=RANK).result()
    other = client.create_lora_training_client(base_model="tiny", rank=RANK).result()
    for _ in range(2):
        step(a, ROWS)
        step(other, OTHER)  # the engine holds another adapter between a's calls
    path = a.save_state("mid", user_metadata={"note": "two steps"}).result().path
    assert path == f"tinker://{a.model_id}/weights/mid"
    assert (workdir / "checkpoints" / a.model_id / "weights" / "mid" / "state.json").is_file()
    at_save = served_weights(server, a.model_id)

    for rows in LATER:
        step(a, rows)
        step(other, OTHER)
    first = served_weights(server, a.model_id)
    assert largest_difference(first, at_save) > 1e-3  # the later steps moved the adapter

    # back to the saved state on the same client (optimizer moments and step count too)
    a.load_state_with_optimizer(path).result()
    assert largest_difference(served_weights(server, a.model_id), at_save) == 0.0
    for rows in LATER:
        step(other, OTHER)
        step(a, rows)
    assert largest_difference(served_weights(server, a.model_id), first) == 0.0

    # a new client from the state, beside the others on the same engine
    c = client.create_training_client_from_state_with_optimizer(path).result()
    assert c.model_id not in (a.model_id, other.model_id)
    assert c.get_info().model_data.model_name == "tiny"
    for rows in LATER:
        step(c, rows)
    assert largest_difference(served_weights(server, c.model_id), first) == 0.0

    rest = tinker.RestClient(base_url=server.url, api_key=KEY)
    listed = rest.list_checkpoints(a.model_id).result().checkpoints
    assert [(x.checkpoint_id, x.tinker_path, x.checkpoint_type) for x in listed] == [
        ("weights/mid", path, "training")
    ]
    assert listed[0].user_metadata == {"note": "two steps"}


def fresh_adam_from_state(server, folder: Path, steps: list[list[list[int]]]) -> dict:
    """tephra's engine alone: the adapter saved in `folder` (read by `load_checkpoint` into
    one engine) copied parameter by parameter into a second engine just built (a fresh AdamW:
    no moments, step count 0), which then takes `steps` with the Tinker defaults the SDK
    sends (betas 0.9 / 0.95, eps 1e-12, no decay, no clipping); its merged weights."""
    service = server.service
    config = service.engine_config(service.bases["tiny"], RANK)
    saved, fresh = get_engine("fsdp", config), get_engine("fsdp", config)
    saved.load_checkpoint(folder)
    source = dict(saved.hf_model.named_parameters())
    with torch.no_grad():
        for name, param in fresh.hf_model.named_parameters():
            if ".lora_" in name:  # one rank: its shard of a DTensor is the whole matrix
                src = source[name]
                full = src.full_tensor() if isinstance(src, DTensor) else src
                (param.to_local() if isinstance(param, DTensor) else param).copy_(full)
    fresh.set_optimizer_params(
        lr=2e-2, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0, grad_clip=0.0
    )
    for rows in steps:
        ids = torch.zeros(len(rows), max(len(r) for r in rows), dtype=torch.int64)
        attn = torch.zeros_like(ids)
        for i, r in enumerate(rows):
            ids[i, : len(r)], attn[i, : len(r)] = torch.tensor(r), 1
        resp = attn.clone()
        resp[:, 0] = 0
        with fresh.train_mode():
            fresh.forward_backward(
                B.make_batch(ids, attn, resp),
                lambda out, mb: (-(out["log_probs"] * mb[B.RESPONSE_MASK]).sum(), {}),
            )
            fresh.optimizer_step()
    with fresh.eval_mode():
        return {n: t.clone() for bucket in fresh.export_weights() for n, t in bucket}


def test_weights_only_loads_start_a_fresh_optimizer(server, client, workdir):
    """`load_state` / `create_training_client_from_state`: the saved adapter exactly, and the
    next steps those of an engine given that adapter with a fresh AdamW (to 1e-6), not those
    of the restored optimizer (`load_state_with_optimizer`), which differ."""
    a = client.create_lora_training_client(base_model="tiny", rank=RANK).result()
    other = client.create_lora_training_client(base_model="tiny", rank=RANK).result()
    for _ in range(2):
        step(a, ROWS)
        step(other, OTHER)
    path = a.save_state("weights-only").result().path
    folder = workdir / "checkpoints" / a.model_id / "weights" / "weights-only" / "engine"
    at_save = served_weights(server, a.model_id)
    for rows in LATER:
        step(a, rows)
    fresh = fresh_adam_from_state(server, folder, LATER[:2])

    a.load_state(path).result()  # weights only: the SDK sends optimizer=False
    assert largest_difference(served_weights(server, a.model_id), at_save) == 0.0
    for rows in LATER[:2]:
        step(other, OTHER)  # the engine holds another adapter between a's calls
        step(a, rows)
    assert largest_difference(served_weights(server, a.model_id), fresh) < 1e-6

    c = client.create_training_client_from_state(path).result()
    assert c.model_id not in (a.model_id, other.model_id)
    assert largest_difference(served_weights(server, c.model_id), at_save) == 0.0
    for rows in LATER[:2]:
        step(c, rows)
    assert largest_difference(served_weights(server, c.model_id), fresh) < 1e-6

    # the restored optimizer (moments of two steps, step count 2) steps elsewhere
    resumed = client.create_training_client_from_state_with_optimizer(path).result()
    for rows in LATER[:2]:
        step(resumed, rows)
    assert largest_difference(served_weights(server, resumed.model_id), fresh) > 1e-4


def test_a_restarted_server_loads_the_state(server, client, workdir):
    a = client.create_lora_training_client(base_model="tiny", rank=RANK).result()
    step(a, ROWS)
    path = a.save_state("restart").result().path
    for rows in LATER:
        step(a, rows)
    first = served_weights(server, a.model_id)

    with BackgroundServer(make_service(["tiny=tiny"], workdir=workdir), KEY) as again:
        sdk = tinker.ServiceClient(base_url=again.url, api_key=KEY)
        b = sdk.create_training_client_from_state_with_optimizer(path).result()
        for rows in LATER:
            step(b, rows)
        assert largest_difference(served_weights(again, b.model_id), first) == 0.0

    # the first server's swapped-out clients outlive the second server on the same workdir
    other = client.create_lora_training_client(base_model="tiny", rank=RANK).result()
    step(other, OTHER)
    step(a, ROWS)  # a is swapped back in from this server's own folder
    a.load_state_with_optimizer(path).result()
    for rows in LATER:
        step(a, rows)
    assert largest_difference(served_weights(server, a.model_id), first) == 0.0
    assert [p.name for p in (workdir / "engines").iterdir()] == [
        Path(server.service._swap.name).name
    ]


def test_state_refusals(client):
    a = client.create_lora_training_client(base_model="tiny", rank=RANK).result()
    path = a.save_state("once").result().path
    with pytest.raises(Exception, match="exists; give another name or overwrite=True"):
        a.save_state("once").result()
    assert a.save_state("once", overwrite=True).result().path == path
    with pytest.raises(Exception, match="is not a valid checkpoint name"):
        a.save_state("../escape").result()
    with pytest.raises(Exception, match="no state saved at tinker://nobody/weights/x"):
        client.create_training_client_from_state_with_optimizer(
            "tinker://nobody/weights/x"
        ).result()
    with pytest.raises(Exception, match="'s3://bucket/x' is not a tinker path"):
        a.load_state_with_optimizer("s3://bucket/x").result()
    with pytest.raises(Exception, match="was saved on 'tiny'; omit base_model or give 'tiny'"):
        client.create_training_client_from_state_with_optimizer(path, base_model="big").result()
    sampler_path = a.save_weights_for_sampler("s1").result().path
    with pytest.raises(Exception, match="holds sampler weights"):
        a.load_state_with_optimizer(sampler_path).result()
    wider = client.create_lora_training_client(base_model="tiny", rank=RANK * 2).result()
    with pytest.raises(Exception, match="holds a rank-4 adapter of 'tiny'; this client has"):
        wider.load_state_with_optimizer(path).result()
