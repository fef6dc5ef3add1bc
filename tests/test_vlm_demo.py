"""The vision-language demo: apps/sft's `vlm_warmup` (SFT of a tiny Qwen2-VL on the
colour_squares task's own transcripts) then apps/ppo's `vlm_demo` (GRPO from that export).
The transcripts answer with the right colour and train only the answer; the warm-up never
sees the RL held-out items; a missing warm-up folder names the command that writes it; the
two commands chain end to end (a few steps here, the measured run is the slow test)."""

from __future__ import annotations

import pytest

from tephra.apps.ppo.config import MADE_BY
from tephra.apps.ppo.main import parse_config, run
from tephra.apps.sft.main import parse_config as sft_config
from tephra.apps.sft.main import run as sft_run
from tephra.controller.data.colour_squares import colour_square_rows
from tephra.controller.run.models import resolve_model_path
from tephra.controller.run.trackers import read_jsonl
from tephra.core.errors import ConfigError


@pytest.fixture(scope="module")
def processor():
    from tephra.rollout.multimodal import VisionProcessor

    return VisionProcessor.from_pretrained(resolve_model_path("tiny_vlm", 0))


def test_transcripts_answer_the_colour_and_train_only_the_answer(processor):
    from tephra.apps.sft.chat_data import colour_square_conversations

    examples = colour_square_conversations(12, 2, processor)
    rows = colour_square_rows(12, 2)
    tok = processor.tokenizer
    for (ids, mask, mm), row in zip(examples, rows, strict=True):
        assert len(ids) == len(mask) and mm.image_grid_thw.shape[0] == 1
        trained = tok.decode([t for t, m in zip(ids, mask, strict=True) if m])
        assert trained.strip() == row["reward_model"]["ground_truth"] + "<|im_end|>"
        # the mask is the assistant turn's tail: nothing of the question or image is trained
        first = mask.index(1)
        assert all(mask[first:]) and processor.image_token_id not in ids[first:]
        assert "What colour" in tok.decode(ids[:first])


def test_warmup_transcripts_are_disjoint_from_the_rl_held_out_items():
    warm, demo = sft_config(["-p", "vlm_warmup"]), parse_config(["-p", "vlm_demo"])
    assert warm.data.seed not in (demo.data.val_seed, demo.data.train_seed)
    held_out = {
        r["images"][0].tobytes() for r in colour_square_rows(demo.data.val_size, demo.data.val_seed)
    }
    transcripts = colour_square_rows(warm.data.size, warm.data.seed)
    assert not any(r["images"][0].tobytes() in held_out for r in transcripts)
    with pytest.raises(ConfigError, match="data.seed=9999 draws the RL trainer's held-out"):
        sft_config(["-p", "vlm_warmup", "data.seed=9999"])


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("data.source=pictures", "data.source='pictures': choose one of"),
        ("data.train_files=[x.parquet]", "data.source=colour_squares generates its transcripts"),
        ("data.images=true", "data.source=colour_squares generates its transcripts"),
    ],
)
def test_sft_colour_squares_source_is_validated(override, message):
    with pytest.raises(ConfigError, match=message):
        sft_config(["-p", "vlm_warmup", override])


def test_sft_colour_squares_needs_a_vision_model(tmp_path):
    with pytest.raises(ConfigError, match="data.source=colour_squares but model.path='tiny'"):
        sft_run(sft_config(["-p", "vlm_warmup", "model.path=tiny", f"train.run_dir={tmp_path}"]))


def test_vlm_demo_starts_from_the_warmup_export():
    warm, demo = sft_config(["-p", "vlm_warmup"]), parse_config(["-p", "vlm_demo"])
    assert demo.model.path == f"{warm.train.run_dir}/hf" and warm.train.export_hf
    assert MADE_BY[demo.model.path] == "uv run apps/sft -p vlm_warmup"
    assert (
        warm.model.path == "tiny_vlm" and warm.data.source == demo.data.source == "colour_squares"
    )
    assert demo.algorithm.adv_estimator == "grpo" and demo.batch.samples_per_prompt >= 2
    assert demo.trainer.val_before and demo.trainer.val_after and demo.trainer.val.n == 1


def test_the_multi_turn_variant_differs_from_vlm_demo_only_in_its_episodes():
    demo = parse_config(["-p", "vlm_demo"])
    multi = parse_config(["-p", "vlm_demo_multiturn"])
    assert multi.model.path == demo.model.path and MADE_BY[multi.model.path]
    r = multi.rollout
    assert (r.agent_loop, r.agent.environment, r.agent.max_turns) == (
        "environment",
        "colour_squares",
        2,
    )
    assert r.agent.environment_kwargs == {"turns": 2}
    assert (multi.data, multi.batch, multi.actor.optimizer) == (
        demo.data,
        demo.batch,
        demo.actor.optimizer,
    )


def test_missing_warmup_folder_names_the_sft_command(tmp_path, monkeypatch):
    import tephra.controller.launch.ppo as ppo

    def no_ray(*args, **kwargs):
        raise AssertionError("Ray started before the model folder was checked")

    monkeypatch.setattr(ppo, "ray_init", no_ray)
    monkeypatch.chdir(tmp_path)  # no runs/vlm_warmup/hf here
    with pytest.raises(ConfigError, match=r"`uv run apps/sft -p vlm_warmup` writes; run that"):
        run(parse_config(["-p", "vlm_demo"]))


@pytest.mark.multiproc
def test_warmup_then_grpo_end_to_end(ray_session, tmp_path):
    warm = sft_run(
        sft_config(
            [
                "-p",
                "vlm_warmup",
                "data.size=20",
                "data.val_size=4",
                "train.steps=2",
                "train.sequences_per_step=4",
                "train.trackers=[jsonl]",
                "resources.cpus_per_rank=1",
                f"train.run_dir={tmp_path / 'warm'}",
            ]
        )
    )
    assert warm["steps"] == 2 and warm["loss_after"] < warm["loss_before"]
    summary = run(
        parse_config(
            [
                "-p",
                "vlm_demo",
                f"model.path={tmp_path / 'warm' / 'hf'}",
                "data.train_size=8",
                "data.val_size=4",
                "batch.prompts_per_step=2",
                "batch.samples_per_prompt=4",
                "trainer.steps=1",
                "trainer.progress_bar=false",
                "trainer.trackers=[jsonl]",
                "trainer.export_hf=false",
                "resources.cpus_per_rank=1",
                f"trainer.run_dir={tmp_path / 'rl'}",
            ]
        )
    )
    assert summary["steps"] == 1
    assert summary["accuracy_before"] is not None and summary["accuracy_after"] is not None
    # the SFT export's images: the trainer's log-probs equal the hf rollout's (fp32 both)
    (record,) = [r for r in read_jsonl(tmp_path / "rl" / "metrics.jsonl") if "reward/mean" in r]
    assert record["rollout_corr/log_prob_abs_gap_mean"] < 1e-4


@pytest.mark.slow
@pytest.mark.multiproc
def test_grpo_raises_held_out_accuracy_after_the_warmup(ray_session, tmp_path):
    # the two commands of the apps' READMEs, as measured there
    sft_run(
        sft_config(
            ["-p", "vlm_warmup", "resources.cpus_per_rank=1", f"train.run_dir={tmp_path / 'warm'}"]
        )
    )
    summary = run(
        parse_config(
            [
                "-p",
                "vlm_demo",
                f"model.path={tmp_path / 'warm' / 'hf'}",
                "resources.cpus_per_rank=1",
                "trainer.progress_bar=false",
                f"trainer.run_dir={tmp_path / 'rl'}",
            ]
        )
    )
    before, after = summary["accuracy_before"], summary["accuracy_after"]
    assert before < 0.7, "the warm-up should leave room for RL"
    assert after >= before + 0.1, summary  # measured: 0.61 -> 0.76


@pytest.mark.slow
@pytest.mark.multiproc
def test_grpo_teaches_the_second_turn_of_the_multi_turn_variant(ray_session, tmp_path):
    # the README's multi-turn commands, as measured there
    sft_run(
        sft_config(
            ["-p", "vlm_warmup", "resources.cpus_per_rank=1", f"train.run_dir={tmp_path / 'warm'}"]
        )
    )
    summary = run(
        parse_config(
            [
                "-p",
                "vlm_demo_multiturn",
                f"model.path={tmp_path / 'warm' / 'hf'}",
                "resources.cpus_per_rank=1",
                "trainer.progress_bar=false",
                f"trainer.run_dir={tmp_path / 'rl'}",
            ]
        )
    )
    # measured: 0.00 -> 0.78 (both answers of a two-turn episode right)
    assert summary["accuracy_before"] < 0.1 and summary["accuracy_after"] >= 0.5, summary
    records = read_jsonl(tmp_path / "rl" / "metrics.jsonl")
    assert (
        max(r["rollout_corr/log_prob_abs_gap_mean"] for r in records if "reward/mean" in r) < 1e-4
    )
