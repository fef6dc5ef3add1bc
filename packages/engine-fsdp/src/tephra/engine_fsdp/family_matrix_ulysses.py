"""The family matrix on 2 ranks: each family's tiny model (`family_matrix.tiny_config`) under
Ulysses sequence parallelism (`parallel.context=2`) and under data-parallel FSDP (world size
2, padded rows), checked against the plain transformers model run on each sequence alone, in
one 2-rank run that goes over every family (`two_rank_checks`, a rank body for
`tephra.engine_api.testing.run_distributed`).

Under Ulysses both ranks hold the same rows and split every packed micro-batch's tokens: the
log-probs and entropy of `FSDPEngine.forward` and the gradients of one update
(`family_matrix.update_loss`, in 2 micro-batches) are compared with the plain model's. Data
parallel: each rank takes 3 of the 6 rows (one prompt's group), and the gradients after
FSDP's reduce-scatter are compared with the plain model's update over all 6.

The plain model's outputs and gradients do not need the other rank: before the first
collective, each rank computes them for its half of the families (the family's engine weights
are `build_model`'s, drawn from `model.init_seed`), and compares for that half; so the
reference work runs on both processes at once.
"""

from __future__ import annotations

import math
import sys
import time
import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist
from tensordict import TensorDict

from tephra.engine_api import batch as B
from tephra.engine_api.config import EngineConfig, apply_overrides
from tephra.engine_api.errors import ConfigError
from tephra.engine_api.testing import run_distributed
from tephra.engine_fsdp.engine import FSDPEngine
from tephra.engine_fsdp.families import layout_refusal
from tephra.engine_fsdp.family_matrix import (
    NOT_RUN,
    SAMPLED_ROUTING,
    build_reference,
    causal_lm_families,
    engine_config,
    engine_gradients,
    gradient_gap,
    reference_gradients,
    reference_outputs,
    test_batch,
    text_family,
    update_batch,
    update_loss,
)
from tephra.engine_fsdp.model_builder import build_model

SP = 2
"""The sequence-parallel size (and the world size) of the 2-rank checks."""


def two_rank_families() -> dict[str, tuple[str, ...]]:
    """Every family the single-process matrix runs in the padded layout (not `NOT_RUN`, not
    a vision-language family, which stands on its text family's row), with its 2-rank
    checks: `"ulysses"` (Ulysses SP=2) where the packed layout is not refused too (Ulysses
    packs), and `"data_parallel"`."""
    out: dict[str, tuple[str, ...]] = {}
    for model_type in causal_lm_families():
        if model_type in NOT_RUN or text_family(model_type) is not None:
            continue
        if layout_refusal(model_type, "padded"):
            continue
        packed = layout_refusal(model_type, "packed") is None
        out[model_type] = (("ulysses",) if packed else ()) + ("data_parallel",)
    return out


def two_rank_config(model_type: str, check: str) -> EngineConfig:
    """The engine config of `check` for the family's tiny model at world size 2."""
    if check == "ulysses":
        return apply_overrides(engine_config(model_type, "packed"), {"parallel.context": SP})
    return engine_config(model_type, "padded")


@dataclass
class Reference:
    """The plain model's log-probs and entropy of `test_batch` and gradients of its update."""

    outputs: dict[str, torch.Tensor]
    gradients: dict[str, torch.Tensor]


def plain_reference(model_type: str) -> Reference:
    """`Reference` of the plain transformers model holding the family's engine weights
    (`build_model` of its tiny config: what every rank's engine starts from)."""
    config = engine_config(model_type, "padded")
    assert config.model.hf_config is not None  # the matrix builds every engine from a dict
    plain = build_reference(config.model.hf_config)
    plain.load_state_dict(build_model(config.model).state_dict())
    batch = test_batch()
    train = model_type not in SAMPLED_ROUTING
    grads = reference_gradients(plain, update_batch(batch), train=train)
    return Reference(reference_outputs(plain, batch), grads)


@dataclass
class TwoRankCheck:
    """One family in one 2-rank check: the engine's refusal at build (None when it runs it);
    the largest log-prob and entropy gaps over response tokens (Ulysses only: data parallel
    compares gradients alone, NaN there), of an engine built past the refusal; the update's
    largest gradient gap over every parameter and that parameter (None where refused), the
    largest reference gradient; or `error`, what the rank raised (a traceback's last lines)."""

    refusal: str | None = None
    log_probs: float = math.nan
    entropy: float = math.nan
    gradients: float | None = None
    worst_parameter: str = ""
    gradient_scale: float = 0.0
    error: str | None = None
    seconds: float = 0.0
    """Wall time of the check on this rank (its reference not included)."""

    def matches(self, tol: float = 1e-5) -> bool:
        """No error, and every gap that was measured within `tol`."""
        if self.error is not None:
            return False
        outputs = [g for g in (self.log_probs, self.entropy) if not math.isnan(g)]
        update = self.gradients is None or self.gradients <= tol
        return all(g <= tol for g in outputs) and update


@dataclass
class _Run:
    """What a 2-rank check computed on this rank (every rank computes it all: collectives)."""

    refusal: str | None = None
    outputs: TensorDict | None = None
    gradients: dict[str, torch.Tensor] | None = None
    forced_failure: bool = False
    """Refused, and the engine built past the refusal fails too."""


def _ulysses(model_type: str) -> _Run:
    """The forward (and, where not refused, the update) of the family at Ulysses SP=2 on
    `test_batch`, every row on both ranks; a refused family's engine is built past the
    refusal, to show what Ulysses would compute."""
    config = two_rank_config(model_type, "ulysses")
    run = _Run()
    try:
        FSDPEngine.check_config(config, dist.get_world_size())
    except ConfigError as exc:
        run.refusal = str(exc)
    batch = test_batch()
    try:
        engine = FSDPEngine(config)  # past the refusal: what Ulysses would compute
        with engine.eval_mode():
            run.outputs = engine.forward(batch)
    except Exception:
        if run.refusal is None:
            raise
        run.forced_failure = True
        return run
    if run.refusal is None:
        run.gradients = _update(engine, model_type, update_batch(batch))
    return run


def _data_parallel(model_type: str) -> _Run:
    """The update of the family on 2 data-parallel ranks, each on its 3 rows."""
    config = two_rank_config(model_type, "data_parallel")
    FSDPEngine.check_config(config, dist.get_world_size())
    engine = FSDPEngine(config)
    update = update_batch(test_batch())
    n = update.batch_size[0] // engine.dp_size
    share = B.trim_padding(update[engine.dp_rank * n : (engine.dp_rank + 1) * n])
    return _Run(gradients=_update(engine, model_type, share))


def _update(engine: FSDPEngine, model_type: str, batch: TensorDict) -> dict[str, torch.Tensor]:
    """One `forward_backward` of `update_loss` on `batch` (this rank's rows); every
    parameter's gradient, gathered whole (a collective)."""
    train = model_type not in SAMPLED_ROUTING
    with engine.train_mode() if train else engine.eval_mode():
        engine.forward_backward(batch, update_loss)
    return engine_gradients(engine)


def compare(run: _Run, ref: Reference) -> TwoRankCheck:
    """`run` against the plain model's `ref`."""
    if run.forced_failure:
        return TwoRankCheck(run.refusal, math.inf, math.inf)
    out = TwoRankCheck(run.refusal)
    if run.outputs is not None:
        resp = test_batch()[B.RESPONSE_MASK].bool()
        gaps = [float((run.outputs[k] - ref.outputs[k])[resp].abs().max()) for k in ref.outputs]
        out.log_probs, out.entropy = (g if math.isfinite(g) else math.inf for g in gaps)
    if run.gradients is not None:
        out.gradients, out.worst_parameter = gradient_gap(run.gradients, ref.gradients)
        out.gradient_scale = max(float(g.abs().max()) for g in ref.gradients.values() if g.numel())
    return out


def _last_lines(text: str, n: int = 6) -> str:
    return "\n".join(text.strip().splitlines()[-n:])


def two_rank_checks(
    families: dict[str, tuple[str, ...]],
) -> dict[str, dict[str, TwoRankCheck]]:
    """Rank body (2 gloo ranks, `run_distributed`): for each family the checks it names
    (`"ulysses"`, `"data_parallel"`), in order; returns the results of the families this rank compares (every
    other one, from its rank)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    names = list(families)
    mine = {f for i, f in enumerate(names) if i % world == rank}
    refs: dict[str, Reference | str] = {}
    for f in names:  # no collective: both ranks at once, each for its half
        if f in mine:
            try:
                refs[f] = plain_reference(f)
            except Exception:
                refs[f] = _last_lines(traceback.format_exc())
    out: dict[str, dict[str, TwoRankCheck]] = {}
    for f in names:
        for check in families[f]:
            start = time.perf_counter()
            result = _one_check(f, check, refs.get(f))
            result.seconds = time.perf_counter() - start
            if f in mine:
                out.setdefault(f, {})[check] = result
    return out


def _one_check(model_type: str, check: str, ref: Reference | str | None) -> TwoRankCheck:
    """One check of one family on this rank, compared where this rank holds `ref`; what
    it raises is recorded. The collective part runs on every rank whatever the comparison
    does after it."""
    try:
        run = _ulysses(model_type) if check == "ulysses" else _data_parallel(model_type)
    except Exception:
        return TwoRankCheck(error=_last_lines(traceback.format_exc()))
    if isinstance(ref, str):
        return TwoRankCheck(error=f"the plain reference failed:\n{ref}")
    if ref is None:  # the other rank compares
        return TwoRankCheck()
    try:
        return compare(run, ref)
    except Exception:
        return TwoRankCheck(error=_last_lines(traceback.format_exc()))


def run_two_rank_checks(
    families: dict[str, tuple[str, ...]], timeout: float = 900.0
) -> dict[str, dict[str, TwoRankCheck]]:
    """`two_rank_checks` on 2 spawned gloo ranks (one start for every family), merged."""
    merged: dict[str, dict[str, TwoRankCheck]] = {}
    for part in run_distributed(two_rank_checks, world_size=SP, args=(families,), timeout=timeout):
        merged.update(part)
    return merged


def _main() -> None:
    """`python -m tephra.engine_fsdp.family_matrix_ulysses [model_type ...]`: run the 2-rank
    checks (of every family by default) and print each result and the time taken."""
    families = two_rank_families()
    if sys.argv[1:]:
        families = {f: families[f] for f in sys.argv[1:]}
    start = time.perf_counter()
    results = run_two_rank_checks(families)
    for f, checks in sorted(results.items()):
        for check, r in checks.items():
            print(f"{f} {check}: {'right' if r.matches() else 'WRONG'} {r}")
    print(f"{len(families)} families on 2 ranks in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    _main()
