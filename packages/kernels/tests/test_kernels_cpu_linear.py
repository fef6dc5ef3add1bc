"""`tephra.kernels.cpu_linear`: the oneDNN / torch choice gives torch's numbers, and is made
once per machine, so every process takes the same path."""

import json

import pytest
import torch

from tephra.core.machine import CHOICES_FILE
from tephra.kernels import cpu_linear


def test_linear_matches_torch_and_keeps_autograd():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 64, generator=gen)
    w = torch.randn(96, 64, generator=gen)
    b = torch.randn(96, generator=gen)
    with torch.no_grad():
        got = cpu_linear.linear(x, w, b)
    torch.testing.assert_close(got, torch.nn.functional.linear(x, w, b), atol=1e-5, rtol=1e-5)
    assert got.shape == (3, 5, 96)
    # a call that needs a graph takes torch's linear, so gradients still flow
    w.requires_grad_()
    cpu_linear.linear(x, w, b).sum().backward()
    torch.testing.assert_close(w.grad, x.reshape(-1, 64).sum(0).expand(96, 64))


def test_use_fast_linears_routes_plain_linears_only():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    x = torch.randn(4, 16)
    ref = model(x)
    assert cpu_linear.use_fast_linears(model) == 2
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref, atol=1e-5, rtol=1e-5)
        model[0].weight.mul_(2)  # in-place updates reach the routed forward
        ref2 = model[2](torch.relu(torch.nn.functional.linear(x, model[0].weight, model[0].bias)))
        torch.testing.assert_close(model(x), ref2, atol=1e-5, rtol=1e-5)
    model(x).sum().backward()  # with autograd on, torch's path: gradients exist
    assert model[0].weight.grad is not None


def test_choice_is_made_once_and_is_a_bool():
    first = cpu_linear.onednn_is_faster(torch.float32)
    assert isinstance(first, bool)
    assert cpu_linear.onednn_is_faster(torch.float32) is first
    assert cpu_linear.onednn_is_faster(torch.float64) is False


def test_prepacked_linears_match_torch_and_follow_weight_updates():
    """`prepack=True`: where packing is chosen, each layer reuses one packed copy of its
    weight until an in-place update, which is repacked on the next call; outputs equal
    torch's throughout, and a call that needs a graph still takes torch's path."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.ReLU(), torch.nn.Linear(96, 8))
    x = torch.randn(5, 64)
    ref = model(x)
    assert cpu_linear.use_fast_linears(model, prepack=True) == 2
    packs = cpu_linear.packing_is_faster(torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref, atol=1e-5, rtol=1e-5)
        first = model[0]._tephra_packed[1]
        assert (first is not None) == packs
        model(x)
        assert model[0]._tephra_packed[1] is first  # reused, not reordered again
        model[0].weight.mul_(2)  # an in-place update (as `update_weights` does)
        ref2 = model[2](torch.relu(torch.nn.functional.linear(x, model[0].weight, model[0].bias)))
        torch.testing.assert_close(model(x), ref2, atol=1e-5, rtol=1e-5)
        assert (model[0]._tephra_packed[1] is not first) == packs
    model(x).sum().backward()
    assert model[0].weight.grad is not None


def test_a_recorded_choice_is_what_every_later_process_takes(tmp_path, monkeypatch):
    """The choice is read from the per-machine record (here hand-set to each answer in turn),
    so a resumed run or another rank takes the path the first process timed."""
    if cpu_linear._onednn_op() is None:
        pytest.skip("this torch build has no oneDNN linear: nothing is timed or recorded")
    monkeypatch.setenv("TEPHRA_CACHE", str(tmp_path))
    try:
        cpu_linear.onednn_is_faster.cache_clear()
        measured = cpu_linear.onednn_is_faster(torch.float32)
        (key,) = json.loads((tmp_path / CHOICES_FILE).read_text())
        assert key.startswith("cpu_linear.onednn_is_faster | torch.float32 | ")
        for recorded in (not measured, measured):
            (tmp_path / CHOICES_FILE).write_text(json.dumps({key: recorded}))
            cpu_linear.onednn_is_faster.cache_clear()
            assert cpu_linear.onednn_is_faster(torch.float32) is recorded
    finally:
        cpu_linear.onednn_is_faster.cache_clear()  # later tests read the machine's own record
