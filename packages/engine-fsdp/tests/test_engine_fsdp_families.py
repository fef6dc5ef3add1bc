"""The family matrix: every causal-LM family of the installed transformers, built tiny, gives
through `FSDPEngine.forward` the log-probs and entropy of a plain transformers forward of each
sequence alone (1e-5, float32) in every layout the engine does not refuse, and through
`FSDPEngine.forward_backward` the gradients of one GRPO-style update (every parameter, 1e-5)
that the plain model gives back-propagating each sequence alone; every refused
layout is refused with the family's message, and is shown to be wrong when forced; the
families not run fail as the table says. A representative family of each kind runs in the
default suite, the rest under the `slow` marker."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from transformers import AutoConfig

from tephra.engine_api import batch as B
from tephra.engine_api.errors import ConfigError
from tephra.engine_fsdp import family_matrix, microbatches, tree_attention
from tephra.engine_fsdp.engine import FSDPEngine, packs, shares
from tephra.engine_fsdp.families import (
    CAUSAL_SETTING,
    LAYOUTS,
    REFUSED,
    SWITCHED_WINDOW,
    layout_refusal,
    window_turned_off,
)
from tephra.engine_fsdp.family_matrix import (
    BUILD_REFUSALS,
    NOT_RUN,
    SAMPLED_ROUTING,
    build_reference,
    causal_lm_families,
    check_family,
    engine_config,
    gradient_gap,
    reference_gradients,
    text_family,
    tiny_config,
    update_batch,
)
from tephra.engine_fsdp.microbatches import leading_padding, roll_rows
from tephra.engine_fsdp.model_builder import repeated_blocks
from tephra.engine_fsdp.sharding import sharing_units

FAMILIES = causal_lm_families()
REPRESENTATIVE = {
    "llama": "dense attention",
    "qwen3_moe": "mixture of experts",
    "deepseek_v3": "multi-head latent attention with MoE",
    "gemma3_text": "sliding windows (refused shared prefix)",
    "qwen3_next": "Gated DeltaNet hybrid (refused packed and shared prefix)",
    "gpt_oss": "sinks, sliding windows, MoE, eager attention",
    "cohere": "logits scaled after the head (logit_scale)",
    "gemma2": "logits soft-capped after the head (final_logit_softcapping)",
    "phi": "an output head with a bias",
    "deepseek_v4": "compressor windows by column: padded rows run from column 0",
    "stablelm": "layers that drop attention kwargs: the tree blocks ride on the mask",
    "mamba": "a no-split class inside another (MambaMixer in MambaBlock)",
    "gpt_neox_japanese": "a tied head under another name (embed_out)",
}
NOT_RUN_REPRESENTATIVE = {"bert", "git"}
RUN = [f for f in FAMILIES if f not in NOT_RUN and text_family(f) is None]


def _marks(model_type: str, fast: set[str] | dict[str, str]):
    return () if model_type in fast else (pytest.mark.slow,)


def test_the_table_names_every_family_once():
    families = set(FAMILIES)
    assert set(REFUSED) <= families, set(REFUSED) - families
    assert set(NOT_RUN) <= families, set(NOT_RUN) - families
    assert not set(REFUSED) & set(NOT_RUN)
    for model_type in families:
        text = text_family(model_type)
        if text is not None:  # a vision-language family stands on its text family's row
            assert text in families and model_type not in REFUSED and model_type not in NOT_RUN
    assert set(REPRESENTATIVE) <= set(RUN) and NOT_RUN_REPRESENTATIVE <= set(NOT_RUN)
    assert set(SAMPLED_ROUTING) <= set(RUN)


UNSEEN_BY_THE_BATCH = {
    ("nemotron_h", "packed"): "its tiny Mamba2 layer leaks into only the 3 tokens after a "
    "sequence boundary (its convolution's width; its state decays within them), and the test "
    "batch scores none of them: test_a_mamba_layer_leaks_across_a_packed_boundary shows it"
}
"""Refused (family, layout) pairs whose forced run the matrix's batch cannot show wrong."""


@pytest.mark.parametrize(
    "model_type", [pytest.param(f, marks=_marks(f, REPRESENTATIVE)) for f in RUN]
)
def test_family_in_every_layout(model_type):
    results = check_family(model_type)
    for layout in LAYOUTS:
        got = results[layout]
        expected = layout_refusal(model_type, "padded") or layout_refusal(model_type, layout)
        if expected is None:
            assert got.refusal is None, f"{layout}: refused: {got.refusal}"
            assert got.matches(), (
                f"{layout}: log-prob gap {got.log_probs}, entropy {got.entropy}, gradient "
                f"{got.gradients} (at {got.worst_parameter})"
            )
            # the update moves the model: a 1e-5 gap is at most 1% of the largest gradient
            assert got.gradients is not None and got.gradient_scale > 1e-3, got
        else:
            assert got.refusal == expected, f"{layout}: {got.refusal!r}"
            assert model_type in got.refusal and "layout" in got.refusal
            # forced past the refusal, the layout is wrong: the refusal is needed (or the
            # batch cannot show it, and a test of its own does)
            assert (model_type, layout) in UNSEEN_BY_THE_BATCH or not got.matches(), (
                f"{layout} is right now; drop its refusal"
            )


_update_loss = family_matrix.update_loss  # the right one, which the faults below wrap


def _scaled(outputs, batch):  # the engine's loss 1% too large
    loss, metrics = _update_loss(outputs, batch)
    return loss * 1.01, metrics


def _first_micro_batch_dropped(outputs, batch):  # the one holding row 0 (advantage 1.0)
    loss, metrics = _update_loss(outputs, batch)
    first = bool((batch["advantages"] == family_matrix.ADVANTAGES[0]).any())
    return (loss * 0 if first else loss), metrics


def _local_normaliser(outputs, batch):  # the micro-batch's own tokens, not the step's
    local = batch.copy()
    local[B.GLOBAL_TOKEN_COUNT] = batch[B.RESPONSE_MASK].sum().float().expand(batch.batch_size)
    return _update_loss(outputs, local)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_update_runs_in_two_micro_batches(layout):
    # so that each micro-batch's loss needs the step's normaliser (17 + 11 response tokens
    # padded and shared-prefix, 19 + 9 packed)
    engine = FSDPEngine(engine_config("llama", layout))
    batch = update_batch(family_matrix.test_batch())
    budget = engine.config.micro_batch.max_tokens_per_microbatch
    plan = microbatches.plan(batch, budget, engine.packed, "max_tokens_per_microbatch")
    tokens = [int(mb.data[B.RESPONSE_MASK].sum()) for mb in plan]
    assert tokens == ([19, 9] if layout == "packed" else [17, 11])
    forward = engine.config.micro_batch.forward_budget
    assert len(microbatches.plan(batch, forward, engine.packed, "forward")) == 1


@pytest.mark.parametrize("fault", [_scaled, _first_micro_batch_dropped, _local_normaliser])
def test_a_wrong_update_is_caught(monkeypatch, fault):
    # the engine's update made wrong three ways (its log-probs untouched): the gradient gap
    # to the plain model's update is far over 1e-5 in every layout, and fails the check
    monkeypatch.setattr(family_matrix, "update_loss", fault)
    for layout, got in check_family("llama").items():
        assert got.log_probs <= 1e-5 and got.entropy <= 1e-5, layout
        assert got.gradients is not None and got.gradients > 1e-4, (layout, got.gradients)
        assert not got.matches()


def test_a_sampled_router_is_random_in_train_mode_only():
    # PhiMoE's SparseMixer draws its routing in train mode: the plain model's update twice
    # in train mode differs (measured 7e-4 to 3e-3), twice in eval mode agrees exactly
    torch.manual_seed(0)
    model = build_reference(tiny_config("phimoe"))
    batch = update_batch(family_matrix.test_batch())
    evals = [reference_gradients(model, batch, train=False) for _ in range(2)]
    trains = [reference_gradients(model, batch, train=True) for _ in range(2)]
    assert gradient_gap(*evals) == (0.0, "")
    assert gradient_gap(*trains)[0] > 1e-4
    assert "phimoe" in SAMPLED_ROUTING


def test_a_sampled_router_trains_deterministically():
    # the engine trains PhiMoE with its router and MoE block in eval mode (the rest in train
    # mode): two updates agree bitwise, and equal the plain model's in eval mode (a plain
    # forward + autograd of the top-2 routing); without the hold they are random draws
    # 1e-2 away (planted: `noisy_routers` returning nothing)
    engine = FSDPEngine(engine_config("phimoe", "padded"))
    names = {type(m).__name__ for m in engine.noisy_routers}
    assert names == {"PhimoeTopKRouter", "PhimoeSparseMoeBlock"}, names
    batch = update_batch(family_matrix.test_batch())
    updates = []
    for _ in range(2):
        with engine.train_mode():
            assert engine.hf_model.model.layers[0].self_attn.training
            assert not any(m.training for m in engine.noisy_routers)
            engine.forward_backward(batch, family_matrix.update_loss)
        updates.append(family_matrix.engine_gradients(engine))
        engine.optimizer.zero_grad(set_to_none=True)
    assert gradient_gap(*updates) == (0.0, "")
    want = reference_gradients(family_matrix._reference_with(engine), batch, train=False)
    gap, where = gradient_gap(updates[0], want)
    assert gap <= 1e-5, (gap, where)


def _update_objective(model, batch):
    """`update_loss` of the whole batch on the plain model, each sequence alone."""
    attn, resp = batch[B.ATTENTION_MASK].bool(), batch[B.RESPONSE_MASK].bool()
    total = torch.zeros((), dtype=torch.float64)
    for i in range(attn.shape[0]):
        cols = attn[i].nonzero()[:, 0]
        ids = batch[B.INPUT_IDS][i, cols][None]
        logp = torch.log_softmax(model(input_ids=ids).logits[0].double(), -1)[:-1]
        token_lp = logp.gather(-1, ids[0, 1:, None])[:, 0]
        entropy = -(logp.exp() * logp).sum(-1)
        keep = resp[i, cols[1:]]
        per_token = -family_matrix.ADVANTAGES[i] * token_lp - family_matrix.ENTROPY_COEFF * entropy
        total = total + per_token[keep].sum()
    return total / resp.sum()


@pytest.mark.parametrize("layer", [0, 1])
def test_the_deterministic_routing_gradient_is_the_derivative(layer):
    # the gradient the engine trains PhiMoE with (autograd of the eval-mode router) is the
    # derivative of the update's objective: a central difference along a random direction
    # of the router's weight (float64, step 1e-4) agrees within 2e-3 relative (measured 6e-4
    # and 1e-10); SparseMixer's train-mode estimate is not that derivative (14% and 76% off).
    # The router gets a gradient only from tokens whose runner-up expert scores within the
    # jitter of the top one (else the gate is 1, in either mode): a jitter of 0.2 makes many
    # tokens such near-ties
    torch.manual_seed(0)
    model = build_reference({**tiny_config("phimoe"), "router_jitter_noise": 0.2})
    model.set_experts_implementation("eager")  # grouped_mm has no float64
    model = model.double()
    batch = update_batch(family_matrix.test_batch())
    weight = model.model.layers[layer].mlp.router.weight
    direction = torch.randn(weight.shape, generator=torch.Generator().manual_seed(1))
    direction = direction.double()
    slopes = {}
    for train in (False, True):
        model.train(train)
        model.zero_grad()
        _update_objective(model, batch).backward()
        slopes[train] = float((weight.grad * direction).sum())
    model.eval()
    step = 1e-4
    with torch.no_grad():
        weight += step * direction
        up = _update_objective(model, batch)
        weight -= 2 * step * direction
        down = _update_objective(model, batch)
        weight += step * direction
    numeric = float(up - down) / (2 * step)
    assert abs(numeric) > 1e-3, numeric  # the router's weight moves the objective
    assert abs(slopes[False] - numeric) <= 2e-3 * abs(numeric), (slopes, numeric)
    assert abs(slopes[True] - numeric) > 5e-2 * abs(numeric), (slopes, numeric)


@pytest.mark.parametrize(
    "model_type", [pytest.param(f, marks=_marks(f, NOT_RUN_REPRESENTATIVE)) for f in NOT_RUN]
)
def test_family_not_run_fails_as_the_table_says(model_type):
    kind, why = NOT_RUN[model_type]
    if kind == "refused":
        with pytest.raises(ConfigError, match=BUILD_REFUSALS[why]):
            FSDPEngine.build(engine_config(model_type, "padded"))
    else:
        with pytest.raises(Exception):  # noqa: B017 (any failure of transformers or the engine)
            check_family(model_type, ("padded",))


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = torch.nn.Linear(4, 4)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(4))


def test_repeated_blocks_are_the_outermost_lists_of_one_class():
    # a model without _no_split_modules: its layers are the outermost module lists of one
    # class (the 4 experts inside each of the 2 blocks are a longer list, not layers)
    model = torch.nn.Module()
    model.stack = torch.nn.Module()
    model.stack.layers = torch.nn.ModuleList(_Block() for _ in range(2))
    model.head = torch.nn.Linear(4, 4)
    assert repeated_blocks(model, "here") == list(model.stack.layers)
    # a second stack of another class in a module of its own (GIT's vision tower): its
    # blocks are layers too
    model.tower = torch.nn.Module()
    model.tower.blocks = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(3))
    assert repeated_blocks(model, "here") == [*model.stack.layers, *model.tower.blocks]
    # XLM's layout: one list per kind of part, side by side; no module is a layer
    xlm = torch.nn.Module()
    xlm.attentions = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(2))
    xlm.norms = torch.nn.ModuleList(torch.nn.LayerNorm(4) for _ in range(2))
    with pytest.raises(ConfigError, match=r"here: .*attentions \(Linear\), norms \(LayerNorm\)"):
        repeated_blocks(xlm, "here")


def test_layers_sharing_a_parameter_are_one_unit():
    # Zamba's hybrid layers hold one tied transformer block: FSDP manages a parameter in one
    # group only, so layers that share one are sharded together; the others alone. A layer
    # sharing with two earlier units joins them
    shared, other = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    a, b, c, d = (torch.nn.ModuleDict({"own": torch.nn.Linear(4, 4)}) for _ in range(4))
    a["tied"], c["tied"] = shared, shared
    assert sharing_units([a, b, c]) == [[a, c], [b]]
    b["tied"], d["x"], d["y"] = other, shared, other
    assert sharing_units([a, b, c, d]) == [[a, c, d, b]]


@pytest.mark.parametrize("model_type", ["openai-gpt", "marian"])
def test_a_family_without_no_split_modules_is_sharded_per_block(model_type):
    # OpenAI GPT's `transformer.h` and Marian's `model.decoder.layers` declare no no-split
    # class: each block is its own FSDP unit (its parameters gathered for its forward
    # alone), the rest (embeddings, norms, head) the root's
    assert not type(build_reference(tiny_config(model_type)))._no_split_modules
    engine = FSDPEngine(engine_config(model_type, "padded"))
    units = [n for n, m in engine.hf_model.named_modules() if isinstance(m, FSDPModule)]
    want = {"openai-gpt": "transformer.h", "marian": "model.decoder.layers"}[model_type]
    assert units == [f"{want}.0", f"{want}.1"]
    assert isinstance(engine.model, FSDPModule)  # the root unit
    sharded = {n for n, p in engine.hf_model.named_parameters() if isinstance(p, DTensor)}
    assert sharded == {n for n, _ in engine.hf_model.named_parameters()}


@pytest.mark.parametrize(
    "model_type, field, off",
    [("bert-generation", "is_decoder", False), ("xlnet", "attn_type", "bi")],
)
def test_a_bidirectional_default_is_refused(model_type, field, off):
    # BERT-Generation's causal LM without is_decoder, and XLNet's with attn_type bi (its
    # default), attend both ways: the first token's logits change with the last token; with
    # the setting (the tiny config's) they do not. The engine refuses a config without it,
    # naming the field
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    other = ids.clone()
    other[0, -1] = 50
    on = tiny_config(model_type)[field]
    assert CAUSAL_SETTING[model_type] == (field, on)
    for value, sees_ahead in ((off, True), (on, False)):
        model = build_reference({**tiny_config(model_type), field: value})
        with torch.no_grad():
            gap = model(input_ids=ids).logits[0, 0] - model(input_ids=other).logits[0, 0]
        assert (float(gap.abs().max()) > 1e-3) is sees_ahead, value
    FSDPEngine.check_config(engine_config(model_type, "padded"))
    for value in (off, None):
        config = engine_config(model_type, "padded", {field: value})
        with pytest.raises(ConfigError, match=rf"{model_type!r} with {field}=.*set {field}: "):
            FSDPEngine.check_config(config)


@pytest.mark.parametrize(
    "setting, layout",
    [
        ({"micro_batch.use_packing": None}, "packed"),
        ({"micro_batch.share_prefix": None}, "shared_prefix"),
    ],
)
def test_a_layout_left_to_the_engine_avoids_a_refused_one(setting, layout):
    # qwen3_next is refused packed and shared-prefix; left to the engine, it pads
    config = engine_config("qwen3_next", layout)
    config.model.attn_implementation = "flash_attention_2"  # would pack by default
    for key, value in setting.items():
        section, field = key.split(".")
        setattr(getattr(config, section), field, value)
    FSDPEngine.check_config(config)
    assert not packs(config) and not shares(config)


def test_a_sliding_window_family_with_its_window_off_shares_prefixes():
    # Mistral's window is refused the shared-prefix layout; a config whose window is null is
    # plain causal attention: not refused, and equal to the plain forward there
    off = check_family("mistral", ("shared_prefix",), {"sliding_window": None})["shared_prefix"]
    assert off.refusal is None and off.matches(), off
    # its window on (4 tokens in the tiny config, shorter than the sequences): refused, and
    # wrong when forced
    on = check_family("mistral", ("shared_prefix",))["shared_prefix"]
    assert on.refusal == layout_refusal("mistral", "shared_prefix") and not on.matches()


def _default_config(model_type: str) -> dict:
    try:
        return AutoConfig.for_model(model_type).to_dict()
    except Exception:  # noqa: BLE001 (a family without a valid default config)
        return {}


def test_a_window_switched_off_by_default_is_off_until_switched_on():
    # Qwen2 / Qwen3 / SmolLM3 slide only with use_sliding_window: true (their default is
    # false): a config that leaves it out is plain causal attention and shares prefixes
    switched = {f for f in FAMILIES if "use_sliding_window" in _default_config(f)}
    assert switched == set(SWITCHED_WINDOW)
    assert all(not AutoConfig.for_model(f).use_sliding_window for f in switched)
    assert layout_refusal("qwen2", "shared_prefix", {"model_type": "qwen2"}) is None
    on = {"model_type": "qwen2", "use_sliding_window": True}
    assert layout_refusal("qwen2", "shared_prefix", on) is not None
    off = {"use_sliding_window": False, "layer_types": ["full_attention"] * 2}
    result = check_family("qwen2", ("shared_prefix",), off)["shared_prefix"]
    assert result.refusal is None and result.matches(), result


@pytest.mark.parametrize(
    "hf_config, off",
    [
        ({"sliding_window": None}, True),
        ({"sliding_window": 0}, True),
        ({"use_sliding_window": False, "sliding_window": 4096}, True),
        ({"sliding_window": 4096}, False),
        ({}, False),  # left out: the family's default, which may be a window
        ({"sliding_window": None, "attention_chunk_size": 8}, False),
    ],
)
def test_window_turned_off_reads_the_config(hf_config, off):
    assert window_turned_off(hf_config) is off
    refusal = layout_refusal("mistral", "shared_prefix", {"model_type": "mistral", **hf_config})
    assert (refusal is None) is off
    # a refusal for another reason stays, whatever the window
    assert layout_refusal("mpt", "packed", hf_config) is not None


def test_padded_rows_are_rolled_to_column_zero_and_back():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 0, 0], [0, 0, 0, 0, 0]])
    shift = leading_padding(mask)
    assert shift.tolist() == [2, 0, 0]
    values = torch.tensor([[0, 0, 7, 8, 9], [4, 5, 6, 0, 0], [0, 0, 0, 0, 0]])
    left = roll_rows(values, -shift)
    assert left.tolist() == [[7, 8, 9, 0, 0], [4, 5, 6, 0, 0], [0, 0, 0, 0, 0]]
    assert torch.equal(roll_rows(left, shift), values)


def test_a_tree_row_without_its_blocks_raises():
    # a layer that rebuilt the placeholder mask would attend over the whole row: it raises
    q = torch.zeros(1, 2, 3, 4)
    bare = torch.ones((), dtype=torch.bool).expand(1, 1, 3, 3)
    with pytest.raises(RuntimeError, match="without its blocks"):
        tree_attention.tree_attention(torch.nn.Linear(1, 1), q, q, q, bare)


def test_per_layer_overrides_follow_their_layers():
    # Gemma 4's full-attention layers (every sixth) have head_dim 512 against 256: the tiny
    # config keeps a sliding and a full layer, the full one at 2 x the tiny head_dim
    config = tiny_config("gemma4_text")
    assert config["layer_types"] == ["sliding_attention", "full_attention"]
    assert config["per_layer_config"] == {"1": {"head_dim": 32}}
    assert "head_dim" not in tiny_config("falcon")  # a read-only property there


def test_a_head_bias_is_added_and_trained():
    # Phi's output head has a bias, zero at init, so its matrix row cannot tell it from none:
    # set to randn here, the engine's log-probs, entropy and update (the bias's gradient
    # included) are still the plain model's
    engine = FSDPEngine(engine_config("phi", "padded"))
    bias = engine.hf_model.get_output_embeddings().bias
    with torch.no_grad():
        local = bias.to_local() if isinstance(bias, DTensor) else bias
        local.copy_(torch.randn(local.shape, generator=torch.Generator().manual_seed(0)))
    plain = family_matrix._reference_with(engine)
    assert float(plain.get_output_embeddings().bias.detach().abs().max()) > 1.0
    batch = family_matrix.test_batch()
    want = family_matrix.reference_outputs(plain, batch)
    with engine.eval_mode():
        got = engine.forward(batch)
    resp = batch[B.RESPONSE_MASK].bool()
    for key in ("log_probs", "entropy"):
        assert float((got[key] - want[key])[resp].abs().max()) <= 1e-5, key
    update = update_batch(batch)
    want_grads = reference_gradients(plain, update)
    with engine.train_mode():
        engine.forward_backward(update, family_matrix.update_loss)
    gap, where = gradient_gap(family_matrix.engine_gradients(engine), want_grads)
    assert gap <= 1e-5, (gap, where)
    assert float(want_grads["lm_head.bias"].abs().max()) > 1e-3


def test_a_mamba_layer_leaks_across_a_packed_boundary():
    # Nemotron-H's Mamba2 mixer over a packed row [a, b] gives b's first 3 tokens (its
    # convolution's width) outputs about 0.1 away from b's alone (outputs about 0.13): the
    # packed layout (and Ulysses, whose ranks would see shards) is refused for it
    torch.manual_seed(0)
    mixer = build_reference(family_matrix.tiny_config("nemotron_h")).model.layers[0].mixer
    assert type(mixer).__name__ == "NemotronHMamba2Mixer"
    hidden = torch.randn(1, 20, 64)
    with torch.no_grad():
        packed, alone = mixer(hidden)[:, 10:], mixer(hidden[:, 10:])
    gap = (packed - alone).abs().amax(-1)[0]
    assert float(gap[:3].min()) > 0.01, gap
    assert layout_refusal("nemotron_h", "packed") is not None
