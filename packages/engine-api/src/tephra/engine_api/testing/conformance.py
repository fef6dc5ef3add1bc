"""The engine conformance kit: contract tests every backend runs against itself.

A backend's tests build a `ConformanceSpec` (an engine factory and a single-process
reference-model factory with the same initial weights) and call `run_conformance(spec)`,
once in a single process and once on every rank of a multi-process group (each rank then
checks its data-parallel share of the kit's batches). engine-api itself needs no
transformers: the reference model is the caller's. The optional parts of the contract
(`Capability`) are checked both ways: a backend that declares one is held to its numbers, one
that does not must refuse it with a `ConfigError` naming the option or the method.
"""

from __future__ import annotations

import json
import math
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tensordict import TensorDict

from tephra.engine_api import batch as B
from tephra.engine_api.adapters import LoraAdapter
from tephra.engine_api.capabilities import Capability
from tephra.engine_api.config import apply_overrides
from tephra.engine_api.engine import Engine
from tephra.engine_api.errors import BatchError, ConfigError
from tephra.engine_api.testing.batches import nll_loss_fn, random_batch


class ReferenceModel(Protocol):
    """A plain single-process model with the engine's initial weights."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load full tensors in Hugging Face naming (what `Engine.export_weights` yields)."""

    def logits(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor
    ) -> torch.Tensor:
        """`[B, T]` -> `[B, T, vocab]` float logits (not temperature-scaled)."""


@dataclass
class ConformanceSpec:
    make_engine: Callable[[dict[str, Any]], Engine]
    """Build an engine from the backend's base config with dotted-key overrides applied
    (e.g. {"micro_batch.use_packing": False}); the same initial weights on every call."""
    make_reference: Callable[[], ReferenceModel]
    """A fresh reference model with the same initial weights as `make_engine`'s."""
    vocab_size: int
    """Vocabulary size of the model (token ids of the kit's batches are below it)."""
    workdir: Path
    """A directory for checkpoints: the same path on every rank."""
    atol: float = 1e-5
    """Absolute tolerance of log-prob, entropy and loss comparisons (fp32)."""
    rtol_grad_norm: float = 1e-5
    """Relative tolerance of grad-norm comparisons."""
    load_adapter: Callable[[ReferenceModel, Path], None] | None = None
    """Apply a folder written by `Engine.export_adapter` to a reference model (e.g. through
    peft); required when the engine declares `Capability.LORA`."""


class ConformanceFailure(AssertionError):
    """One or more contract checks failed; the message lists each with its reason."""


# ----- helpers ----------------------------------------------------------------------------
def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _share(engine: Engine, batch: TensorDict) -> TensorDict:
    """This rank's data-parallel share: contiguous equal chunks."""
    n, size, rank = batch.batch_size[0], engine.dp_size, engine.dp_rank
    if n % size:
        raise ValueError(f"kit batch of {n} rows does not split over {size} data-parallel ranks")
    chunk = n // size
    return B.trim_padding(batch[rank * chunk : (rank + 1) * chunk])


def _kit_batch(spec: ConformanceSpec, seed: int = 0) -> TensorDict:
    return random_batch(spec.vocab_size, num_sequences=8, seed=seed)


def _sum_all(x: float) -> float:
    t = torch.tensor([x], dtype=torch.float64)
    if _world()[1] > 1:
        dist.all_reduce(t)
    return float(t[0])


def _global_nll(engine: Engine, batch: TensorDict) -> float:
    """Token-mean NLL over the whole batch (all ranks), from `forward`."""
    share = _share(engine, batch)
    with engine.eval_mode():
        out = engine.forward(share)
    mask = share[B.RESPONSE_MASK].double()
    return _sum_all(float(-(out["log_probs"].double() * mask).sum())) / _sum_all(float(mask.sum()))


def _train_step(engine: Engine, batch: TensorDict) -> tuple[float, float]:
    with engine.train_mode():
        metrics = engine.forward_backward(_share(engine, batch), nll_loss_fn)
        grad_norm = engine.optimizer_step()
        engine.lr_scheduler_step()
    # the loss function's `Share` metric adds up over micro-batches and ranks, as the loss
    # does (an averaged one would be the loss over their number)
    _rel_close("nll_contribution (a Share)", metrics["nll_contribution"], metrics["loss"], 1e-6)
    return float(metrics["loss"]), float(grad_norm)


def reference_log_probs(
    ref: ReferenceModel, batch: TensorDict, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Naive per-token log-prob and entropy `[B, T]` aligned to tokens, zero off-response."""
    with torch.no_grad():
        logits = ref.logits(batch[B.INPUT_IDS], batch[B.ATTENTION_MASK], batch[B.POSITION_IDS])
        logp = F.log_softmax(logits.double() / temperature, dim=-1)
        ids = batch[B.INPUT_IDS]
        lp = torch.zeros(ids.shape, dtype=torch.float64)
        ent = torch.zeros(ids.shape, dtype=torch.float64)
        lp[:, 1:] = logp[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
        ent[:, 1:] = -(logp[:, :-1].exp() * logp[:, :-1]).sum(-1)
        mask = batch[B.RESPONSE_MASK].bool()
    return lp * mask, ent * mask


def _close(name: str, got: torch.Tensor, want: torch.Tensor, atol: float) -> None:
    err = float((got.double() - want.double()).abs().max()) if got.numel() else 0.0
    assert err <= atol, f"{name}: max abs difference {err:.3g} > {atol:g}"


def _rel_close(name: str, got: float, want: float, rtol: float) -> None:
    assert math.isfinite(got) and math.isfinite(want), f"{name}: non-finite {got} vs {want}"
    assert abs(got - want) <= rtol * max(abs(want), 1e-12), (
        f"{name}: {got!r} != {want!r} (rtol {rtol:g})"
    )


# ----- checks -----------------------------------------------------------------------------
def check_forward_matches_reference(spec: ConformanceSpec) -> None:
    """Per-token log-probs (and entropy) of response tokens equal a plain model's."""
    engine = spec.make_engine({})
    share = _share(engine, _kit_batch(spec))
    with engine.eval_mode():
        out = engine.forward(share)
    assert out.batch_size == share.batch_size, f"forward returned batch size {out.batch_size}"
    assert out["log_probs"].shape == share[B.INPUT_IDS].shape, (
        f"log_probs shape {list(out['log_probs'].shape)} != input_ids {list(share['input_ids'].shape)}"
    )
    lp, ent = reference_log_probs(spec.make_reference(), share, engine.config.temperature)
    _close("log_probs", out["log_probs"], lp, spec.atol)
    if engine.config.compute_entropy:
        assert "entropy" in out.keys(), "forward returned no 'entropy' with compute_entropy=True"
        _close("entropy", out["entropy"], ent, spec.atol)


def reference_sum_pi_squared(
    ref: ReferenceModel, batch: TensorDict, temperature: float
) -> torch.Tensor:
    """Naive sum_v p_v^2 `[B, T]` (float64 softmax of the full logits) aligned to tokens, zero
    off-response: the `sum_pi_squared` extra output of `Engine.forward`."""
    with torch.no_grad():
        logits = ref.logits(batch[B.INPUT_IDS], batch[B.ATTENTION_MASK], batch[B.POSITION_IDS])
        p = F.softmax(logits.double() / temperature, dim=-1)
        q = torch.zeros(batch[B.INPUT_IDS].shape, dtype=torch.float64)
        q[:, 1:] = p[:, :-1].pow(2).sum(-1)
    mask: torch.Tensor = batch[B.RESPONSE_MASK]
    return q * mask.bool()


def check_forward_sum_pi_squared(spec: ConformanceSpec) -> None:
    """`forward(batch, extra_outputs=("sum_pi_squared",))` adds sum_v p_v^2 per response
    token (a plain model's, in float64) and leaves the other outputs as they were; an
    unknown extra output is refused with a ConfigError naming it."""
    engine = spec.make_engine({})
    if engine.config.model.role != "policy":
        return
    share = _share(engine, _kit_batch(spec))
    with engine.eval_mode():
        plain = engine.forward(share)
        out = engine.forward(share, extra_outputs=("sum_pi_squared",))
        try:
            engine.forward(share, extra_outputs=("sum_pi_cubed",))
        except ConfigError as exc:
            assert "sum_pi_cubed" in str(exc), f"the error does not name the output: {exc}"
        else:
            raise AssertionError("forward accepted extra_outputs=('sum_pi_cubed',)")
    assert "sum_pi_squared" in out.keys(), "forward returned no 'sum_pi_squared' when asked"
    assert "sum_pi_squared" not in plain.keys(), "forward returned 'sum_pi_squared' unasked"
    assert out["sum_pi_squared"].dtype == torch.float32, "sum_pi_squared is not float32"
    want = reference_sum_pi_squared(spec.make_reference(), share, engine.config.temperature)
    _close("sum_pi_squared", out["sum_pi_squared"], want, spec.atol)
    _close("log_probs with sum_pi_squared", out["log_probs"], plain["log_probs"], 0.0)


def check_forward_builds_no_graph(spec: ConformanceSpec) -> None:
    """`forward` returns tensors without autograd history."""
    engine = spec.make_engine({})
    with engine.eval_mode():
        out = engine.forward(_share(engine, _kit_batch(spec)))
    for key in out.keys():
        t = out[key]
        assert not t.requires_grad and t.grad_fn is None, f"forward output {key!r} carries a graph"


def check_optimizer_step_lowers_loss(spec: ConformanceSpec) -> None:
    """One optimizer step on a fixed batch lowers that batch's loss; the grad norm is
    finite, positive and the same on every rank; forward_backward reports the loss."""
    engine = spec.make_engine({})
    batch = _kit_batch(spec)
    before = _global_nll(engine, batch)
    loss, grad_norm = _train_step(engine, batch)
    after = _global_nll(engine, batch)
    assert abs(loss - before) <= 1e-4 * max(1.0, abs(before)), (
        f"forward_backward reported loss {loss} but the batch's NLL is {before}"
    )
    assert math.isfinite(grad_norm) and grad_norm > 0, f"grad norm {grad_norm}"
    norms: list[float | None] = [grad_norm]
    if _world()[1] > 1:
        norms = [None] * _world()[1]
        dist.all_gather_object(norms, grad_norm)
    assert len(set(norms)) == 1, f"grad norm differs across ranks: {norms}"
    assert after < before, f"loss did not fall after one step: {before} -> {after}"


def check_grad_accumulation_matches(spec: ConformanceSpec) -> None:
    """Many small micro-batches give the same gradient as one large one."""
    batch = _kit_batch(spec)
    longest = int(B.sequence_lengths(batch).max())
    big = spec.make_engine({"micro_batch.max_tokens_per_microbatch": 100_000})
    small = spec.make_engine({"micro_batch.max_tokens_per_microbatch": longest})
    loss_big, gn_big = _train_step(big, batch)
    loss_small, gn_small = _train_step(small, batch)
    _rel_close("loss (1 vs many micro-batches)", loss_small, loss_big, 1e-5)
    _rel_close("grad norm (1 vs many micro-batches)", gn_small, gn_big, spec.rtol_grad_norm)
    _rel_close("loss after the step", _global_nll(small, batch), _global_nll(big, batch), 1e-5)


def check_packed_equals_padded(spec: ConformanceSpec) -> None:
    """Packing changes nothing: same log-probs, same loss, same grad norm."""
    batch = _kit_batch(spec)
    packed = spec.make_engine({"micro_batch.use_packing": True})
    padded = spec.make_engine({"micro_batch.use_packing": False})
    share = _share(packed, batch)
    with packed.eval_mode():
        lp_packed = packed.forward(share)["log_probs"]
    with padded.eval_mode():
        lp_padded = padded.forward(share)["log_probs"]
    _close("log_probs packed vs padded", lp_packed, lp_padded, spec.atol)
    loss_a, gn_a = _train_step(packed, batch)
    loss_b, gn_b = _train_step(padded, batch)
    _rel_close("loss packed vs padded", loss_a, loss_b, 1e-5)
    _rel_close("grad norm packed vs padded", gn_a, gn_b, spec.rtol_grad_norm)


def check_exported_weights_match(spec: ConformanceSpec) -> None:
    """After a step, exported weights loaded into a fresh reference give the engine's
    log-probs; names are unique and every rank receives full tensors."""
    engine = spec.make_engine({})
    batch = _kit_batch(spec)
    _train_step(engine, batch)
    with engine.eval_mode():
        weights: list[tuple[str, torch.Tensor]] = []
        for bucket in engine.export_weights():
            weights.extend((name, t.detach().clone()) for name, t in bucket)
        out = engine.forward(_share(engine, batch))
    names = [n for n, _ in weights]
    assert names and len(names) == len(set(names)), "export_weights yielded no or duplicate names"
    ref = spec.make_reference()
    ref.load_weights(weights)
    lp, _ = reference_log_probs(ref, _share(engine, batch), engine.config.temperature)
    _close("log_probs of exported weights", out["log_probs"], lp, spec.atol)


def check_checkpoint_resume_identical(spec: ConformanceSpec) -> None:
    """save -> load into a fresh engine -> the next steps give the identical losses and grad norms."""
    path = Path(spec.workdir) / "conformance-ckpt"
    batch_a, batch_b = _kit_batch(spec, seed=1), _kit_batch(spec, seed=2)
    first = spec.make_engine({})
    _train_step(first, batch_a)
    first.save_checkpoint(path)
    # two steps after the checkpoint: the second one sees the optimizer/scheduler state
    expected = (*_train_step(first, batch_b), *_train_step(first, batch_a))
    resumed = spec.make_engine({})
    resumed.load_checkpoint(path)
    got = (*_train_step(resumed, batch_b), *_train_step(resumed, batch_a))
    assert got == expected, (
        f"two steps after resume gave (loss, grad norm) x2 {got}, uninterrupted {expected}"
    )


def check_malformed_batches_raise(spec: ConformanceSpec) -> None:
    """Bad batches raise BatchError naming the problem, from forward and forward_backward."""
    engine = spec.make_engine({})
    good = _share(engine, _kit_batch(spec))
    no_mask = good.exclude(B.RESPONSE_MASK)
    float_ids = good.clone()
    float_ids[B.INPUT_IDS] = good[B.INPUT_IDS].float()
    cases = {"response_mask": no_mask, "input_ids": float_ids}
    for needle, bad in cases.items():
        for call in ("forward", "forward_backward"):
            try:
                with engine.train_mode():
                    if call == "forward":
                        engine.forward(bad)
                    else:
                        engine.forward_backward(bad, nll_loss_fn)
            except BatchError as exc:
                assert needle in str(exc), f"{call}: BatchError {exc!s} does not name {needle!r}"
            else:
                raise AssertionError(f"{call} accepted a batch with a bad {needle!r}")
    tight = spec.make_engine({"micro_batch.max_tokens_per_microbatch": 2})
    try:
        with tight.train_mode():
            tight.forward_backward(good, nll_loss_fn)
    except BatchError as exc:
        assert "max_tokens_per_microbatch" in str(exc), (
            f"budget error does not name the field: {exc}"
        )
    else:
        raise AssertionError("a sequence longer than the token budget was accepted")


def check_data_parallel_coordinates(spec: ConformanceSpec) -> None:
    """`dp_rank` / `dp_size` / `is_dp_output_rank` partition the ranks: one `dp_size` on every
    rank, dividing the world size; every data-parallel rank in `range(dp_size)` is held by
    world / dp_size ranks, exactly one of which hands results back."""
    engine = spec.make_engine({})
    mine = (int(engine.dp_rank), int(engine.dp_size), bool(engine.is_dp_output_rank))
    world = _world()[1]
    everyone: list[Any] = [mine]
    if world > 1:
        everyone = [None] * world
        dist.all_gather_object(everyone, mine)
    sizes = {size for _, size, _ in everyone}
    assert len(sizes) == 1, f"dp_size differs across ranks: {[s for _, s, _ in everyone]}"
    size = sizes.pop()
    assert size >= 1 and world % size == 0, f"dp_size {size} does not divide world size {world}"
    holders = sorted(r for r, _, _ in everyone)
    assert holders == sorted(list(range(size)) * (world // size)), (
        f"dp_rank over the ranks is {[r for r, _, _ in everyone]}; expected each of "
        f"0..{size - 1} held by {world // size} rank(s)"
    )
    outputs = sorted(r for r, _, out in everyone if out)
    assert outputs == list(range(size)), (
        f"output ranks hold dp_rank {outputs}; expected exactly one per data-parallel rank "
        f"0..{size - 1}"
    )


def _refuses(call: Callable[[], Any], needle: str, what: str) -> None:
    try:
        call()
    except ConfigError as exc:
        assert needle in str(exc), f"{what}: ConfigError {exc!s} does not name {needle!r}"
    else:
        raise AssertionError(f"{what} was accepted")


def _refuses_lora(engine: Engine, method: str, call: Callable[[], Any]) -> None:
    """An engine without `Capability.LORA`: `check_config` refuses `lora.rank > 0` and
    `method` raises a ConfigError naming itself."""
    lora = apply_overrides(engine.config, {"lora.rank": 4})
    what = "without Capability.LORA, {}"
    _refuses(
        lambda: type(engine).check_config(lora, _world()[1]),
        "lora.rank",
        what.format("lora.rank=4"),
    )
    _refuses(call, method, what.format(method))


_LORA = {"lora.rank": 4, "lora.alpha": 8.0}


def _lora_engine_after_a_step(spec: ConformanceSpec) -> tuple[Engine, TensorDict]:
    """An engine with adapters after one step (the adapters are no longer a no-op) and this
    rank's share of the kit batch."""
    engine = spec.make_engine(_LORA)
    batch = _kit_batch(spec)
    _train_step(engine, batch)
    return engine, _share(engine, batch)


def check_reference_mode_is_base_model(spec: ConformanceSpec) -> None:
    """With `Capability.LORA`: after a step, `forward` inside `reference_mode()` equals the
    plain reference model with the initial weights (the base; only adapters train), while
    the adapted `forward` differs from it, before and after the context; an engine built
    without adapters refuses naming `lora.rank`. Without the capability: `reference_mode()`
    and `lora.rank > 0` are refused."""
    engine = spec.make_engine({})

    def enter() -> None:
        with engine.eval_mode(), engine.reference_mode():
            pass

    if Capability.LORA not in engine.capabilities:
        _refuses_lora(engine, "reference_mode()", enter)
        return
    _refuses(enter, "lora.rank", "reference_mode() without adapters")
    engine, share = _lora_engine_after_a_step(spec)
    with engine.eval_mode():
        adapted = engine.forward(share)["log_probs"]
        with engine.reference_mode():
            base = engine.forward(share)["log_probs"]
        again = engine.forward(share)["log_probs"]
    lp, _ = reference_log_probs(spec.make_reference(), share, engine.config.temperature)
    _close("log_probs in reference_mode vs the base model", base, lp, spec.atol)
    _close("log_probs after reference_mode vs before", again, adapted, 0.0)
    moved = float((adapted.double() - lp).abs().max())
    assert moved > 10 * spec.atol, (
        f"the adapters changed the log-probs by only {moved:.3g} after a step; the check "
        "cannot tell reference_mode from the adapted model"
    )


def check_adapter_export_matches(spec: ConformanceSpec) -> None:
    """With `Capability.LORA`: after a step, the folder `export_adapter` writes, applied to
    the plain reference model by `spec.load_adapter`, gives the engine's log-probs, and
    `export_adapter_weights()` holds that folder's matrices, rank and alpha; an engine
    built without adapters refuses both naming `lora.rank`. Without the capability:
    `export_adapter()` and `lora.rank > 0` are refused."""
    path = Path(spec.workdir) / "conformance-adapter"
    engine = spec.make_engine({})
    if Capability.LORA not in engine.capabilities:
        _refuses_lora(engine, "export_adapter()", lambda: engine.export_adapter(path))
        return
    _refuses(lambda: engine.export_adapter(path), "lora.rank", "export_adapter() without adapters")
    assert spec.load_adapter is not None, (
        f"{type(engine).__name__} declares Capability.LORA but the spec has no load_adapter "
        "to apply its exported adapter to the reference model"
    )
    _refuses(
        engine.export_adapter_weights, "lora.rank", "export_adapter_weights() without adapters"
    )
    engine, share = _lora_engine_after_a_step(spec)
    with engine.eval_mode():
        engine.export_adapter(path)
        adapter = engine.export_adapter_weights()
        want = engine.forward(share)["log_probs"]
    ref = spec.make_reference()
    spec.load_adapter(ref, path)
    lp, _ = reference_log_probs(ref, share, engine.config.temperature)
    _close("log_probs of the exported adapter over the base model", want, lp, spec.atol)
    # the in-memory adapter is the folder's: the same matrices bit for bit, rank and alpha
    # imported here: a LoRA backend has peft, which brings safetensors; the kit does not
    from safetensors.torch import load_file

    saved = load_file(str(path / "adapter_model.safetensors"))
    config = json.loads((path / "adapter_config.json").read_text())
    assert (adapter.rank, adapter.alpha) == (config["r"], config["lora_alpha"]) == (4, 8.0), (
        f"export_adapter_weights(): rank {adapter.rank}, alpha {adapter.alpha}; the folder "
        f"says r={config['r']}, lora_alpha={config['lora_alpha']}; the kit built rank 4, alpha 8"
    )
    assert adapter.tensors.keys() == saved.keys(), sorted(adapter.tensors.keys() ^ saved.keys())
    for name, tensor in saved.items():
        assert torch.equal(adapter.tensors[name].float(), tensor.float()), name


def check_adapter_weights_load(spec: ConformanceSpec) -> None:
    """With `Capability.LORA`: an adapter exported after a step, loaded by
    `load_adapter_weights` into an engine that has taken two steps of its own, is that
    engine's adapter bit for bit and gives the exporter's log-probs; its next two steps
    (losses, grad norms, adapter after) are those of an engine built fresh and given the same
    adapter (a fresh optimizer: no moments, step count 0). Another rank, and an engine without
    adapters, are refused naming `lora.rank`. Without the capability it is refused."""
    engine = spec.make_engine({})
    if Capability.LORA not in engine.capabilities:
        empty = LoraAdapter(rank=4, alpha=8.0, tensors={})
        _refuses_lora(engine, "load_adapter_weights()", lambda: engine.load_adapter_weights(empty))
        return
    source, share = _lora_engine_after_a_step(spec)
    with source.eval_mode():
        adapter = source.export_adapter_weights()
        want = source.forward(share)["log_probs"]
    _refuses(
        lambda: engine.load_adapter_weights(adapter),
        "lora.rank",
        "load_adapter_weights() without adapters",
    )
    other = LoraAdapter(adapter.rank * 2, adapter.alpha, adapter.tensors)
    batch_a, batch_b = _kit_batch(spec, seed=1), _kit_batch(spec, seed=2)
    trained = spec.make_engine(_LORA)
    _train_step(trained, batch_a)
    _train_step(trained, batch_b)
    _refuses(lambda: trained.load_adapter_weights(other), "lora.rank", "another rank's adapter")
    trained.load_adapter_weights(adapter)
    with trained.eval_mode():
        loaded = trained.export_adapter_weights()
        got = trained.forward(share)["log_probs"]
    for name, tensor in adapter.tensors.items():
        assert torch.equal(loaded.tensors[name], tensor), f"{name} differs after loading"
    _close("log_probs after load_adapter_weights vs the exporter's", got, want, spec.atol)
    fresh = spec.make_engine(_LORA)
    fresh.load_adapter_weights(adapter)
    steps = [(*_train_step(e, batch_b), *_train_step(e, batch_a)) for e in (trained, fresh)]
    assert steps[0] == steps[1], (
        f"two steps after load_adapter_weights gave (loss, grad norm) x2 {steps[0]} on an "
        f"engine that had trained, {steps[1]} on a fresh one: the optimizer was not reset"
    )
    with trained.eval_mode(), fresh.eval_mode():
        after = trained.export_adapter_weights(), fresh.export_adapter_weights()
    for name in adapter.tensors:
        assert torch.equal(after[0].tensors[name], after[1].tensors[name]), (
            f"{name} after two steps from the loaded adapter differs from a fresh engine's"
        )


CHECKS: dict[str, Callable[[ConformanceSpec], None]] = {
    "forward_matches_reference": check_forward_matches_reference,
    "forward_builds_no_graph": check_forward_builds_no_graph,
    "forward_sum_pi_squared": check_forward_sum_pi_squared,
    "optimizer_step_lowers_loss": check_optimizer_step_lowers_loss,
    "grad_accumulation_matches": check_grad_accumulation_matches,
    "packed_equals_padded": check_packed_equals_padded,
    "exported_weights_match": check_exported_weights_match,
    "checkpoint_resume_identical": check_checkpoint_resume_identical,
    "malformed_batches_raise": check_malformed_batches_raise,
    "data_parallel_coordinates": check_data_parallel_coordinates,
    "reference_mode_is_base_model": check_reference_mode_is_base_model,
    "adapter_export_matches": check_adapter_export_matches,
    "adapter_weights_load": check_adapter_weights_load,
}


def run_conformance(spec: ConformanceSpec, checks: list[str] | None = None) -> list[str]:
    """Run the named checks (all by default) on this rank; return the names that passed.

    Raises `ConformanceFailure` listing every failing check and its reason. At world size
    > 1 every rank must call this with the same arguments.
    """
    names = list(CHECKS) if checks is None else checks
    unknown = [n for n in names if n not in CHECKS]
    if unknown:
        raise KeyError(f"unknown conformance checks {unknown}; known: {list(CHECKS)}")
    failures: list[str] = []
    for name in names:
        try:
            CHECKS[name](spec)
        except AssertionError as exc:
            failures.append(f"{name}: {exc}")
        except Exception:  # noqa: BLE001 - a crash is a failure of that check, reported whole
            failures.append(f"{name}: raised\n{traceback.format_exc()}")
    if failures:
        rank = _world()[0]
        raise ConformanceFailure(
            f"rank {rank}: {len(failures)} check(s) failed:\n" + "\n".join(failures)
        )
    return names
