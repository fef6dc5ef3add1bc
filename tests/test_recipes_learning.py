"""Learning checks of the recipes on tiny models (marked `slow`, left out of CI): on-policy
distillation from a stronger teacher raises the student's held-out greedy accuracy, a
judge-rewarded run raises the judge's reward, and SPIN raises the policy's accuracy on the
prompts whose reference answers it plays against. The distillation task is a toy one that a tiny
model learns in seconds: a response scores min(number of "e" in it, 4) / 4 and is correct
with 4 or more. Numbers measured on 2 shared CPU cores are in apps/ppo/README.md.
`uv run pytest -m slow -n 0 tests/test_recipes_learning.py`."""

from __future__ import annotations

import pytest

from tephra.apps.ppo.main import parse_config, run
from tephra.controller.run.trackers import read_jsonl
from tephra.rollout.testing import build_tiny_model

TOY_REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return min(solution_str.count("e"), 4) / 4
"""


def _toy(tmp_path, *overrides):
    reward = tmp_path / "reward.py"
    reward.write_text(TOY_REWARD)
    return parse_config(
        ["-p", "smoke", f"reward.custom_function_path={reward}", "trainer.resume=off", *overrides]
    )


# the teacher: 100 GRPO steps of the tiny model (seed 0) on the toy reward
TEACHER = ("trainer.steps=100", "trainer.export_hf=true", "data.val_size=32")
# the student: the tiny model of seed 1 (same tokenizer, random weights), distilled from the
# teacher's per-token log-probs alone (rl_advantage false: the reward is only logged)
STUDENT = (
    "-p",
    "distill",
    "trainer.seed=1",
    "trainer.steps=100",
    "data.val_size=32",
    "trainer.val_before=true",
    "trainer.val_after=true",
)


@pytest.mark.slow
@pytest.mark.multiproc
def test_distillation_from_a_stronger_teacher_raises_held_out_accuracy(ray_session, tmp_path):
    teacher = run(
        _toy(
            tmp_path,
            *TEACHER,
            "trainer.val_before=true",
            "trainer.val_after=true",
            f"trainer.run_dir={tmp_path / 'teacher'}",
        )
    )
    student = run(
        _toy(
            tmp_path,
            *STUDENT,
            f"algorithm.distillation.teacher_path={tmp_path / 'teacher' / 'hf'}",
            f"trainer.run_dir={tmp_path / 'student'}",
        )
    )
    # the teacher is stronger than the student before distillation, and distillation closes
    # most of the gap on held-out prompts (greedy). Measured: teacher 0% -> 100%, student
    # 0% -> 100%, reverse KL to the teacher 2.77 (steps 1-10) -> 0.03 (steps 91-100)
    assert teacher["accuracy_after"] >= student["accuracy_before"] + 0.5, (teacher, student)
    assert student["accuracy_after"] >= student["accuracy_before"] + 0.5, student
    kl = [
        r["distill/reverse_kl"]
        for r in read_jsonl(tmp_path / "student" / "metrics.jsonl")
        if "distill/reverse_kl" in r
    ]
    assert sum(kl[-10:]) / 10 < 0.5 * sum(kl[:10]) / 10, kl


# the judge alone is the reward: a tiny random model (seed 3) asked to rate the response; a
# quarter of the last number it writes, clipped to [0, 1], is the score (a judgement without a
# number scores the fallback 0)
JUDGE = (
    "reward.judge.parser=last_number",
    "reward.judge.prompt_template=Rate answer {response}",
    "reward.judge.chat_template=false",
    "reward.judge.max_new_tokens=6",
    "reward.judge.max_model_len=512",
    "reward.judge.score_scale=0.25",
    "reward.clip=[0,1]",
    "batch.prompts_per_step=4",
    "trainer.steps=150",
)


@pytest.mark.slow
@pytest.mark.multiproc
def test_a_judge_rewarded_run_raises_its_reward(ray_session, tmp_path):
    judge = build_tiny_model(tmp_path / "judge", seed=3)
    run(
        _toy(
            tmp_path,
            *JUDGE,
            f"reward.judge.model_path={judge.path}",
            f"trainer.run_dir={tmp_path / 'judged'}",
        )
    )
    train = [
        r for r in read_jsonl(tmp_path / "judged" / "metrics.jsonl") if "reward/judge_mean" in r
    ]
    assert len(train) == 150
    # the judge alone is the reward (rule weight 0). Measured: 0.24 (steps 1-15) -> 0.68
    # (steps 136-150); judgements without a number 11.9 -> 4.8 of 16 a step
    reward = [r["reward/mean"] for r in train]
    fallbacks = [r["reward/judge_fallbacks"] for r in train]
    assert sum(reward[-15:]) / 15 > sum(reward[:15]) / 15 + 0.2, reward
    assert sum(fallbacks[-15:]) < sum(fallbacks[:15]), fallbacks


# SPIN on the smoke task itself (reasoning-gym sums, the data's answers as the chosen
# responses; the reward is reasoning-gym's exact-answer check, logged only)
SPIN = (
    "-p",
    "smoke",
    "-p",
    "spin",
    "trainer.steps=150",
    "batch.prompts_per_step=4",
    "algorithm.spin.beta=1.0",
    "data.val_size=32",
    "trainer.val_before=true",
    "trainer.val_after=true",
    "trainer.resume=off",
)


@pytest.mark.slow
@pytest.mark.multiproc
def test_spin_raises_the_policy_accuracy_on_its_prompts(ray_session, tmp_path):
    summary = run(parse_config([*SPIN, f"trainer.run_dir={tmp_path / 'spin'}"]))
    train = [r for r in read_jsonl(tmp_path / "spin" / "metrics.jsonl") if "reward/mean" in r]
    assert len(train) == 150
    # the policy's own samples on the 32 training prompts get more answers right. Measured:
    # 0.0 (steps 1-15) -> 0.22 (steps 136-150); held-out greedy 1 -> 3 of 32
    reward = [r["reward/mean"] for r in train]
    assert sum(reward[-15:]) / 15 > sum(reward[:15]) / 15 + 0.1, reward
    assert summary["accuracy_after"] >= summary["accuracy_before"]
