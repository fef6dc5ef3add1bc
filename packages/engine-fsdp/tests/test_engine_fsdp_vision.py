"""engine=fsdp with images in the batch (tiny random Qwen2-VL, Qwen2.5-VL and LLaVA): packed and
padded log-probs and a critic's values equal an unpacked, one-row-at-a-time transformers forward
with the same images; a training step reaches the vision tower, and LoRA adapts the language
model with the tower frozen or adapted by option."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from PIL import Image
from tensordict import TensorDict

from tephra.engine_api import batch as B
from tephra.engine_api.config import EngineConfig, ModelConfig, apply_overrides
from tephra.engine_api.errors import ConfigError
from tephra.engine_api.multimodal import hf_model_kwargs, vision_family
from tephra.engine_fsdp.engine import FSDPEngine
from tephra.engine_fsdp.testing import train_step
from tephra.engine_fsdp.vision import MULTIMODAL, multimodal_column
from tephra.rollout.multimodal import VisionProcessor, build_tiny_vlm


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl", "llava"])
def vlm(tmp_path_factory, request):
    return build_tiny_vlm(tmp_path_factory.mktemp("vlm"), family=request.param)


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def qwen_vlm(tmp_path_factory, request):
    """The Qwen2-VL family only: videos, and checks that do not depend on the family."""
    return build_tiny_vlm(tmp_path_factory.mktemp("qwen_vlm"), family=request.param)


def _in_tower(name: str, config) -> bool:
    """Whether parameter `name` is in the vision tower (or LLaVA's projector)."""
    return any(f"{m}." in name for m in vision_family(config).tower_modules)


def _batch(vlm) -> tuple[TensorDict, list[list[int]], list]:
    """3 rows: one image (16 tokens in every family), no image, two images of other sizes
    (LLaVA's processor crops each to 56 x 56)."""
    proc = VisionProcessor.from_pretrained(vlm.path)
    span = proc.span_text(proc.image_token)
    prompts = [
        proc(
            f"<|im_start|>user\n{span}what colour?<|im_end|>\n<|im_start|>assistant\n",
            [Image.new("RGB", (112, 112), "red")],
        ),
        proc("<|im_start|>user\ntext only<|im_end|>\n<|im_start|>assistant\n", []),
        proc(
            f"<|im_start|>user\n{span}{span}and?<|im_end|>\n<|im_start|>assistant\n",
            [Image.new("RGB", (140, 112), "green"), Image.new("RGB", (112, 168), "blue")],
        ),
    ]
    gen = torch.Generator().manual_seed(0)
    rows, mm = [], []
    for k, (ids, images) in enumerate(prompts):
        response = torch.randint(3, 300, (5 + 3 * k,), generator=gen).tolist()
        rows.append((ids, response))
        mm.append(images)
    width = max(len(p) + len(r) for p, r in rows)
    n = len(rows)
    input_ids = torch.zeros(n, width, dtype=torch.long)
    attn = torch.zeros(n, width, dtype=torch.long)
    resp = torch.zeros(n, width, dtype=torch.long)
    for i, (p, r) in enumerate(rows):
        input_ids[i, : len(p) + len(r)] = torch.tensor(p + r)
        attn[i, : len(p) + len(r)] = 1
        resp[i, len(p) : len(p) + len(r)] = 1
    batch = TensorDict(
        {B.INPUT_IDS: input_ids, B.ATTENTION_MASK: attn, B.RESPONSE_MASK: resp}, batch_size=[n]
    )
    batch[MULTIMODAL] = multimodal_column(mm)
    return batch, [p + r for p, r in rows], mm


def _engine(vlm, **overrides) -> FSDPEngine:
    cfg = apply_overrides(
        EngineConfig(
            model=ModelConfig(path=vlm.path),
            device="cpu",
            optimizer={"lr": 1e-2, "weight_decay": 0.0},
        ),
        overrides,
    )
    return FSDPEngine.build(cfg)


def _reference(model, seqs, mm, resp) -> torch.Tensor:
    family = vision_family(model.config)
    out = torch.zeros(resp.shape)
    for i, (seq, images) in enumerate(zip(seqs, mm, strict=True)):
        ids = torch.tensor([seq])
        with torch.no_grad():
            logits = model(
                input_ids=ids, **family.model_kwargs(ids, [images], model.config)
            ).logits[0]
        lp = torch.log_softmax(logits.float(), -1)[:-1].gather(-1, ids[0, 1:, None])[:, 0]
        out[i, 1 : len(seq)] = lp
    return out * resp


def _reference_step(model, seqs, mm, resp, model_kwargs=None) -> tuple[float, float]:
    """The loss and grad norm of one `train_step` (`nll_loss_fn`: token-mean NLL of the
    response tokens over the batch) recomputed in plain transformers, one row at a time with
    its own images: the gradient reaches the vision tower only through the images, so a
    step that lost them has another norm. `model_kwargs(ids, images, config)` defaults to the
    family's."""
    kwargs = model_kwargs or vision_family(model.config).model_kwargs
    model.zero_grad()
    tokens = float(resp.sum())
    total = 0.0
    for i, (seq, images) in enumerate(zip(seqs, mm, strict=True)):
        ids = torch.tensor([seq])
        logits = model(input_ids=ids, **kwargs(ids, [images], model.config)).logits[0]
        lp = torch.log_softmax(logits.float(), -1)[:-1].gather(-1, ids[0, 1:, None])[:, 0]
        loss = -(lp * resp[i, 1 : len(seq)]).sum() / tokens
        loss.backward()
        total += float(loss.detach())
    grads = [p.grad for p in model.parameters() if p.requires_grad and p.grad is not None]
    return total, float(torch.sqrt(sum((g.double() ** 2).sum() for g in grads)))


@pytest.mark.parametrize("packing", [True, False])
def test_vision_log_probs_match_unpacked_hf_forward(vlm, packing):
    from transformers import AutoModelForImageTextToText

    batch, seqs, mm = _batch(vlm)
    engine = _engine(
        vlm, **{"micro_batch.use_packing": packing, "micro_batch.max_tokens_per_microbatch": 4096}
    )
    with engine.eval_mode():
        got = engine.forward(batch)["log_probs"] * batch[B.RESPONSE_MASK]
    model = AutoModelForImageTextToText.from_pretrained(vlm.path, dtype=torch.float32).eval()
    want = _reference(model, seqs, mm, batch[B.RESPONSE_MASK])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    # without its longest row the batch is trimmed of padding columns: the images stay
    first = batch[:2]
    with engine.eval_mode():
        alone = engine.forward(first)["log_probs"] * first[B.RESPONSE_MASK]
    torch.testing.assert_close(alone[:, : want.shape[1]], want[:2], atol=1e-5, rtol=0)
    # the images matter: other pixels, other log-probs
    other = batch.clone()
    other[MULTIMODAL] = multimodal_column(
        [None if m is None else type(m)(m.pixel_values.flip(0), m.image_grid_thw) for m in mm]
    )
    with engine.eval_mode():
        moved = engine.forward(other)["log_probs"] * batch[B.RESPONSE_MASK]
    assert (moved - got).abs().max() > 1e-4


def test_vision_training_step_updates_the_vision_tower(vlm):
    from transformers import AutoModelForImageTextToText

    batch, seqs, mm = _batch(vlm)
    engine = _engine(vlm)
    config = engine.hf_model.config
    before = {n: _full(p) for n, p in engine.hf_model.named_parameters() if _in_tower(n, config)}
    loss, grad_norm = train_step(engine, batch)
    # the same step in plain transformers: loss and grad norm, the tower's share included
    model = AutoModelForImageTextToText.from_pretrained(vlm.path, dtype=torch.float32)
    want_loss, want_norm = _reference_step(model, seqs, mm, batch[B.RESPONSE_MASK])
    assert loss == pytest.approx(want_loss, abs=1e-5)
    assert grad_norm == pytest.approx(want_norm, rel=1e-4)
    # (LLaVA's tower layers after the one it reads get none)
    tower = [
        p.grad for n, p in model.named_parameters() if _in_tower(n, config) and p.grad is not None
    ]
    # measured 44-54% of the norm: a step whose images lost their gradient is far off
    assert float(torch.sqrt(sum((g**2).sum() for g in tower))) > 0.3 * want_norm
    after = dict(engine.hf_model.named_parameters())
    changed = [n for n, p in before.items() if not torch.equal(p, _full(after[n]))]
    assert changed, "no vision-tower weight moved"


def test_image_token_mismatch_is_refused(vlm):
    batch, _, mm = _batch(vlm)
    batch[MULTIMODAL] = multimodal_column([mm[2], None, mm[0]])
    engine = _engine(vlm)
    with pytest.raises(ConfigError, match="batch row 0: the prompt holds 16 image tokens"):
        engine.forward(batch)


def test_value_model_on_a_vlm_matches_a_single_hf_forward(vlm, tmp_path):
    from transformers import AutoModelForImageTextToText

    batch, seqs, mm = _batch(vlm)
    engine = _engine(
        vlm,
        **{
            "model.role": "value",
            "micro_batch.use_packing": True,
            "micro_batch.max_tokens_per_microbatch": 4096,
        },
    )
    with engine.eval_mode():
        got = engine.forward(batch)["values"] * batch[B.RESPONSE_MASK]
    # reference: the plain transformers VLM, one row at a time, its backbone's last hidden
    # state through the engine's value head (the value of token t is read at position t - 1)
    model = AutoModelForImageTextToText.from_pretrained(vlm.path, dtype=torch.float32).eval()
    head = {k: v.full_tensor() for k, v in engine.hf_model.score.state_dict().items()}
    want = torch.zeros(got.shape)
    for i, (seq, images) in enumerate(zip(seqs, mm, strict=True)):
        ids = torch.tensor([seq])
        with torch.no_grad():
            hidden = model.model(
                input_ids=ids,
                **vision_family(model.config).model_kwargs(ids, [images], model.config),
            ).last_hidden_state[0]
        values = hidden @ head["weight"][0] + head["bias"][0]
        want[i, 1 : len(seq)] = values[:-1]
    want = want * batch[B.RESPONSE_MASK]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert want.abs().max() > 1e-3  # a head drawn at random, not zeros
    # the images matter to the critic too
    other = batch.clone()
    other[MULTIMODAL] = multimodal_column(
        [None if m is None else type(m)(m.pixel_values.flip(0), m.image_grid_thw) for m in mm]
    )
    with engine.eval_mode():
        moved = engine.forward(other)["values"] * batch[B.RESPONSE_MASK]
    assert (moved - got).abs().max() > 1e-4
    # an exported critic is read back with its value head (padded micro-batches this time)
    engine.export_hf(str(tmp_path / "critic"))
    again = _engine(replace(vlm, path=str(tmp_path / "critic")), **{"model.role": "value"})
    with again.eval_mode():
        reread = again.forward(batch)["values"] * batch[B.RESPONSE_MASK]
    torch.testing.assert_close(reread, got, atol=1e-6, rtol=0)


def test_images_for_a_text_model_are_refused(qwen_vlm):
    from tephra.engine_api.errors import BatchError
    from tephra.engine_fsdp.testing import tiny_engine_config

    batch, _, _ = _batch(qwen_vlm)
    batch[B.INPUT_IDS] = batch[B.INPUT_IDS] % 256  # the tiny text model's vocabulary
    engine = FSDPEngine.build(tiny_engine_config())
    with pytest.raises(BatchError, match="has no vision tower"):
        engine.forward(batch)


def test_text_only_micro_batch_of_a_vlm_is_packed_apart(qwen_vlm, vision_batch):
    # no image in the micro-batch: the packed sequences must still not see each other
    batch = vision_batch(qwen_vlm.path)[2:]
    assert all(m is None for m in batch[MULTIMODAL].tolist())
    got = {}
    for packing in (True, False):
        engine = _engine(qwen_vlm, **{"micro_batch.use_packing": packing})
        with engine.eval_mode():
            got[packing] = engine.forward(batch)["log_probs"]
    torch.testing.assert_close(got[True], got[False], atol=1e-5, rtol=0)


def _video_batch(vlm) -> tuple[TensorDict, list[list[int]], list]:
    """A row with a 4-frame video, a row with an image and a video, a text row."""
    proc = VisionProcessor.from_pretrained(vlm.path)
    frames = [Image.new("RGB", (112, 140), c) for c in ("red", "green", "blue", "white")]
    vspan = "<|vision_start|><|video_pad|><|vision_end|>"
    ispan = "<|vision_start|><|image_pad|><|vision_end|>"
    prompts = [
        proc(f"<|im_start|>user\n{vspan}what moves?<|im_end|>\n", [], [frames]),
        proc(f"{ispan}{vspan}both?", [Image.new("RGB", (112, 112), "red")], [frames[:2]]),
        proc("<|im_start|>user\ntext only<|im_end|>\n", []),
    ]
    gen = torch.Generator().manual_seed(1)
    seqs = [
        ids + torch.randint(3, 300, (4 + k,), generator=gen).tolist()
        for k, (ids, _) in enumerate(prompts)
    ]
    width = max(map(len, seqs))
    n = len(seqs)
    input_ids = torch.zeros(n, width, dtype=torch.long)
    attn = torch.zeros(n, width, dtype=torch.long)
    resp = torch.zeros(n, width, dtype=torch.long)
    for i, ((p, _), s) in enumerate(zip(prompts, seqs, strict=True)):
        input_ids[i, : len(s)] = torch.tensor(s)
        attn[i, : len(s)] = 1
        resp[i, len(p) : len(s)] = 1
    batch = TensorDict(
        {B.INPUT_IDS: input_ids, B.ATTENTION_MASK: attn, B.RESPONSE_MASK: resp}, batch_size=[n]
    )
    mm = [m for _, m in prompts]
    batch[MULTIMODAL] = multimodal_column(mm)
    return batch, seqs, mm


@pytest.mark.parametrize("packing", [True, False])
def test_video_log_probs_match_unpacked_hf_forward_and_a_video_row_trains(qwen_vlm, packing):
    from transformers import AutoModelForImageTextToText

    vlm = qwen_vlm
    batch, seqs, mm = _video_batch(vlm)
    engine = _engine(vlm, **{"micro_batch.use_packing": packing})
    with engine.eval_mode():
        got = engine.forward(batch)["log_probs"] * batch[B.RESPONSE_MASK]
    model = AutoModelForImageTextToText.from_pretrained(vlm.path, dtype=torch.float32).eval()
    out = torch.zeros(batch[B.RESPONSE_MASK].shape)
    vid = model.config.video_token_id
    for i, (seq, m) in enumerate(zip(seqs, mm, strict=True)):
        ids = torch.tensor([seq])
        with torch.no_grad():
            logits = model(
                input_ids=ids, **hf_model_kwargs(ids, [m], vlm.image_token_id, vid)
            ).logits[0]
        out[i, 1 : len(seq)] = torch.log_softmax(logits, -1)[:-1].gather(-1, ids[0, 1:, None])[:, 0]
    torch.testing.assert_close(got, out * batch[B.RESPONSE_MASK], atol=1e-5, rtol=0)
    # the video row alone trains the vision tower, with the gradient plain transformers
    # gives the same row and video
    before = {n: _full(p) for n, p in engine.hf_model.named_parameters() if "visual" in n}
    loss, grad_norm = train_step(engine, batch[:1])
    want_loss, want_norm = _reference_step(
        model,
        seqs[:1],
        mm[:1],
        batch[B.RESPONSE_MASK][:1],
        lambda ids, m, _: hf_model_kwargs(ids, m, vlm.image_token_id, vid),
    )
    assert loss == pytest.approx(want_loss, abs=1e-5)
    assert grad_norm == pytest.approx(want_norm, rel=1e-4)
    after = dict(engine.hf_model.named_parameters())
    assert [n for n, p in before.items() if not torch.equal(p, _full(after[n]))]


def _full(p) -> torch.Tensor:
    p = p.detach()
    return (p.full_tensor() if hasattr(p, "full_tensor") else p).clone()


def test_video_token_mismatch_is_refused(qwen_vlm):
    batch, _, mm = _video_batch(qwen_vlm)
    batch[MULTIMODAL] = multimodal_column([mm[1], mm[0], None])
    engine = _engine(qwen_vlm)
    with pytest.raises(ConfigError, match="batch row 0: the prompt holds 0 image tokens but"):
        engine.forward(batch)


@pytest.mark.parametrize("vision", ["frozen", "adapt"])
def test_lora_on_a_vlm_adapts_the_language_model_and_the_tower_by_option(vlm, vision, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    batch, seqs, mm = _batch(vlm)
    engine = _engine(vlm, **{"lora.rank": 4, "lora.vision": vision})
    # B = 0 at start: the adapted model is the base model, images included
    with engine.eval_mode():
        got = engine.forward(batch)["log_probs"] * batch[B.RESPONSE_MASK]
    model = AutoModelForImageTextToText.from_pretrained(vlm.path, dtype=torch.float32).eval()
    want = _reference(model, seqs, mm, batch[B.RESPONSE_MASK])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    params = dict(engine.hf_model.named_parameters())
    trainable = {n for n, p in params.items() if p.requires_grad}
    assert trainable and all(".lora_" in n for n in trainable)
    in_tower = {n for n in trainable if _in_tower(n, model.config)}
    assert bool(in_tower) == (vision == "adapt")
    before = {n: _full(p) for n, p in params.items()}
    # the reference: plain transformers wrapped by peft in the engine's initial adapter
    # (B = 0, A drawn at random), the base weights and the frozen ones left without gradient
    engine.export_adapter(tmp_path / "adapter")
    peft_model = PeftModel.from_pretrained(model, str(tmp_path / "adapter"), is_trainable=True)
    # the exported adapter adapts exactly the engine's modules (no CLIP `q_proj` beside the
    # language model's, no ambiguous `0`)
    loaded = {n for n, p in peft_model.named_parameters() if p.requires_grad}
    assert {n.removeprefix("base_model.model.") for n in loaded} == trainable
    want_loss, want_norm = _reference_step(peft_model, seqs, mm, batch[B.RESPONSE_MASK])
    loss, grad_norm = train_step(engine, batch)
    assert loss == pytest.approx(want_loss, abs=1e-5)
    assert grad_norm == pytest.approx(want_norm, rel=1e-4)
    after = {n: _full(p) for n, p in engine.hf_model.named_parameters()}
    moved = {n for n in before if not torch.equal(before[n], after[n])}
    # lora_A of a layer whose B is still 0 gets no gradient on the first step: B moves
    assert any("language_model" in n and "lora_B" in n for n in moved)
    assert any(_in_tower(n, model.config) for n in moved) == (vision == "adapt")
    assert all(".lora_" in n for n in moved)


def test_lora_vision_option_is_checked():
    from tephra.engine_api.config import LoraConfig

    with pytest.raises(ConfigError, match=r"lora.vision='train': use one of \['frozen', 'adapt'\]"):
        LoraConfig(rank=4, vision="train")
