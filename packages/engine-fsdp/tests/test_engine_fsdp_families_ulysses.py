"""The family matrix on 2 gloo ranks (`tephra.engine_fsdp.family_matrix_ulysses`): every family
the single-process matrix runs, built tiny, under Ulysses sequence parallelism
(`parallel.context=2`, wherever the packed layout is not refused) gives the log-probs and
entropy of a plain transformers forward of each sequence alone (1e-5, float32) and the
gradients of one GRPO-style update (`family_matrix.update_loss`, every parameter, 1e-5); on 2
data-parallel ranks (padded rows, each rank one prompt's 3 rows) the update's gradients after
FSDP's reduce-scatter equal the plain model's over all 6 rows. Families refused under Ulysses
(`ulysses_families.ULYSSES_REFUSED`) are refused with the family's message, and are shown
wrong when forced. One 2-rank start runs every family (about 2 minutes on 2 cores)."""

from __future__ import annotations

import pytest

from tephra.engine_api.errors import ConfigError
from tephra.engine_fsdp.engine import FSDPEngine
from tephra.engine_fsdp.families import layout_refusal
from tephra.engine_fsdp.family_matrix import causal_lm_families, engine_config
from tephra.engine_fsdp.family_matrix_ulysses import (
    SP,
    run_two_rank_checks,
    two_rank_config,
    two_rank_families,
)
from tephra.engine_fsdp.ulysses_families import ULYSSES_REFUSED, ulysses_refusal

FAMILIES = two_rank_families()
ULYSSES = sorted(f for f, checks in FAMILIES.items() if "ulysses" in checks)
DATA_PARALLEL = sorted(f for f, checks in FAMILIES.items() if "data_parallel" in checks)


@pytest.fixture(scope="module")
def results():
    return run_two_rank_checks(FAMILIES)


def test_the_tables_name_families_the_packed_layout_runs():
    assert set(ULYSSES_REFUSED) <= set(ULYSSES), set(ULYSSES_REFUSED) - set(ULYSSES)
    assert set(ULYSSES) <= set(DATA_PARALLEL) <= set(causal_lm_families())


@pytest.mark.multiproc
@pytest.mark.parametrize("model_type", ULYSSES)
def test_family_under_ulysses(results, model_type):
    got = results[model_type]["ulysses"]
    assert got.error is None, got.error
    expected = ulysses_refusal(model_type, SP)
    if expected is None:
        assert got.refusal is None, got.refusal
        assert got.matches(), got
        # the update moves the model: a 1e-5 gap is at most 1% of the largest gradient
        assert got.gradients is not None and got.gradient_scale > 1e-3, got
    else:
        assert got.refusal == expected and model_type in got.refusal
        # forced past the refusal, Ulysses is wrong (or fails): the refusal is needed
        assert not got.matches(), f"right under Ulysses now; drop its refusal: {got}"


@pytest.mark.multiproc
@pytest.mark.parametrize("model_type", DATA_PARALLEL)
def test_family_update_on_two_data_parallel_ranks(results, model_type):
    got = results[model_type]["data_parallel"]
    assert got.error is None, got.error
    assert got.refusal is None and got.matches(), got
    assert got.gradients is not None and got.gradient_scale > 1e-3, got


@pytest.mark.parametrize("model_type", sorted(ULYSSES_REFUSED))
def test_a_refused_family_is_refused_before_anything_is_built(model_type):
    # what the apps' preflight calls, before Ray starts: the family, the layout, the fix
    with pytest.raises(ConfigError) as info:
        FSDPEngine.check_config(two_rank_config(model_type, "ulysses"), world_size=SP)
    message = str(info.value)
    assert message == ulysses_refusal(model_type, SP)
    assert f"model_type={model_type!r}" in message
    assert "Ulysses layout (parallel.context=2)" in message
    assert "set parallel.context=1" in message
    # one rank without Ulysses runs it
    FSDPEngine.check_config(engine_config(model_type, "packed"), world_size=1)


def test_a_family_refused_packed_is_refused_under_ulysses_for_that_reason():
    # Ulysses packs: Qwen3-Next's recurrent layers are refused with the packed reason
    with pytest.raises(ConfigError) as info:
        FSDPEngine.check_config(two_rank_config("qwen3_next", "ulysses"), world_size=SP)
    assert str(info.value) == layout_refusal("qwen3_next", "packed")
    assert "qwen3_next" not in FAMILIES or "ulysses" not in FAMILIES["qwen3_next"]


def test_a_window_turned_off_is_not_refused_under_ulysses():
    # PhiMoE's window (in its mask only) is refused under Ulysses; a config whose window is
    # null is plain causal attention
    config = two_rank_config("phimoe", "ulysses")
    assert config.model.hf_config is not None
    config.model.hf_config["sliding_window"] = None
    FSDPEngine.check_config(config, world_size=SP)
    assert ulysses_refusal("phimoe", SP, {"model_type": "phimoe", "sliding_window": None}) is None
    assert ulysses_refusal("phimoe", SP, {"model_type": "phimoe"}) is not None
