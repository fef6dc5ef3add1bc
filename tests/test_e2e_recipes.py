"""End to end through the PPO app: the recipes' presets (SPPO, SPIN, VAPO's critic warmup,
on-policy distillation) on tiny models, with numbers checked against an independent
computation. One Ray session for the module."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
from transformers import AutoModelForCausalLM

from tephra.algos import spin_loss
from tephra.apps.ppo.main import parse_config, run
from tephra.controller.data import PromptRecord
from tephra.controller.export import export_checkpoint
from tephra.controller.models import load_tokenizer, resolve_model_path
from tephra.controller.recipes.spin import Spin
from tephra.controller.testing import SMOKE_REWARD
from tephra.controller.trackers import read_jsonl
from tephra.core.errors import ConfigError
from tephra.episodes.rewards import GenerativeJudge, RewardInput
from tephra.rollout.testing import build_tiny_model


def _smoke(tmp_path, *overrides):
    reward = tmp_path / "reward.py"
    reward.write_text(SMOKE_REWARD)
    return parse_config(
        ["-p", "smoke", f"reward.custom_function_path={reward}", "trainer.resume=off", *overrides]
    )


def _train_records(run_dir):
    return [r for r in read_jsonl(run_dir / "metrics.jsonl") if "reward/mean" in r]


def _weights(folder):
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.multiproc
def test_sppo_preset_trains(ray_session, tmp_path):
    run(_smoke(tmp_path, "-p", "sppo", f"trainer.run_dir={tmp_path / 'sppo'}"))
    train = _train_records(tmp_path / "sppo")
    assert len(train) == 2
    for r in train:
        # on-policy (one mini-batch, one epoch): log-ratio 0, so the loss is the mean
        # squared target, positive wherever the rewards of a group differ
        assert r["actor/ppo_kl"] == 0.0
        assert math.isfinite(r["actor/pg_loss"]) and r["actor/pg_loss"] > 0
        assert math.isfinite(r["actor/grad_norm"]) and r["actor/grad_norm"] > 0


@pytest.mark.multiproc
def test_critic_warmup_leaves_the_actor_untouched(ray_session, tmp_path):
    start = _weights(resolve_model_path("tiny", 0))
    cfg = _smoke(
        tmp_path,
        "-p",
        "vapo",
        "trainer.critic_warmup=2",
        "trainer.export_hf=true",
        f"trainer.run_dir={tmp_path / 'warm'}",
    )
    run(cfg)
    train = _train_records(tmp_path / "warm")
    assert len(train) == 2
    for r in train:
        assert math.isfinite(r["critic/grad_norm"]) and r["critic/grad_norm"] > 0
        assert not any(k.startswith("actor/grad_norm") for k in r)
        assert r["trainer/critic_warmup"] == 1.0
    after = _weights(tmp_path / "warm" / "hf")
    assert after.keys() == start.keys()
    assert all(torch.equal(after[k], start[k]) for k in start)
    # the critic trained: its value loss on step 2's batch comes from updated weights; the
    # control run without warmup moves the actor
    run(
        _smoke(
            tmp_path,
            "-p",
            "vapo",
            "trainer.critic_warmup=1",
            "trainer.export_hf=true",
            f"trainer.run_dir={tmp_path / 'one'}",
        )
    )
    moved = _weights(tmp_path / "one" / "hf")
    assert any(not torch.equal(moved[k], start[k]) for k in start)
    train = _train_records(tmp_path / "one")
    assert "actor/grad_norm" not in train[0] and math.isfinite(train[1]["actor/grad_norm"])


def _response_log_probs(model, prompt_ids, response_ids):
    ids = torch.tensor([prompt_ids + response_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt_ids) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response_ids)[:, None])[:, 0]


@pytest.mark.multiproc
def test_distillation_advantage_is_teacher_minus_student(ray_session, tmp_path):
    teacher = build_tiny_model(tmp_path / "teacher", seed=7)
    cfg = _smoke(
        tmp_path,
        "-p",
        "distill",
        f"algorithm.distillation.teacher_path={teacher.path}",
        "trainer.dump_generations=1",
        f"trainer.run_dir={tmp_path / 'distill'}",
    )
    run(cfg)
    train = _train_records(tmp_path / "distill")
    assert len(train) == 2 and all(r["distill/reverse_kl"] > 0 for r in train)
    # step 1 sampled from the initial student: recompute both log-probs here
    student = AutoModelForCausalLM.from_pretrained(
        resolve_model_path("tiny", 0), dtype=torch.float32
    )
    teacher_model = AutoModelForCausalLM.from_pretrained(teacher.path, dtype=torch.float32)
    rows = [
        json.loads(x)
        for x in (tmp_path / "distill" / "generations" / "train_step1.jsonl")
        .read_text()
        .splitlines()
    ]
    assert len(rows) == 8
    for row in rows:
        s = _response_log_probs(student, row["prompt_ids"], row["response_ids"])
        q = _response_log_probs(teacher_model, row["prompt_ids"], row["response_ids"])
        assert row["advantage"] == pytest.approx(float((q - s).mean()), abs=1e-4)


def test_distillation_refuses_another_tokenizer_before_ray(tmp_path):
    other = build_tiny_model(tmp_path / "other", vocab_size=400)
    cfg = _smoke(tmp_path, "-p", "distill", f"algorithm.distillation.teacher_path={other.path}")
    from tephra.controller.ppo import prepare

    with pytest.raises(ConfigError, match="the teacher's tokenizer is not the student's"):
        prepare(cfg)


@pytest.mark.multiproc
def test_judge_scores_reach_the_trainer(ray_session, tmp_path):
    judge = build_tiny_model(tmp_path / "judge", seed=3)
    cfg = _smoke(
        tmp_path,
        "-p",
        "judge",
        f"reward.judge.model_path={judge.path}",
        "reward.judge.parser=last_number",
        "reward.judge.prompt_template=Rate {prompt} answer {response}",
        "reward.judge.chat_template=false",
        "reward.judge.max_new_tokens=6",
        "reward.judge.max_model_len=512",
        "trainer.dump_generations=1",
        f"trainer.run_dir={tmp_path / 'judge_run'}",
    )
    run(cfg)
    train = _train_records(tmp_path / "judge_run")
    assert len(train) == 2
    # the same judge, run here on the dumped samples: reward = 1.0 x rule + 0.5 x judge
    here = GenerativeJudge(cfg.reward.judge)
    namespace: dict = {}
    exec(SMOKE_REWARD, namespace)  # noqa: S102 (the test's own reward function)
    rule = namespace["compute_score"]
    try:
        for step, record in zip((1, 2), train, strict=True):
            path = tmp_path / "judge_run" / "generations" / f"train_step{step}.jsonl"
            rows = [json.loads(x) for x in path.read_text().splitlines()]
            judged = here.score(
                [
                    RewardInput(
                        "reasoning_gym/basic_arithmetic", r["response"], prompt_str=r["prompt"]
                    )
                    for r in rows
                ]
            )
            for r, j in zip(rows, judged, strict=True):
                assert r["score"] == pytest.approx(
                    rule("", r["response"], None) + 0.5 * j, abs=1e-6
                )
            assert record["reward/judge_mean"] == pytest.approx(sum(judged) / len(judged))
            assert record["reward/judge_fallbacks"] == here.last_stats.fallbacks
            assert record["reward/judge_timeouts"] == 0
    finally:
        here.close()


@pytest.mark.multiproc
def test_prime_trains_its_reward_model_online(ray_session, tmp_path):
    cfg = _smoke(
        tmp_path,
        "algorithm.prime.enabled=true",
        "trainer.save_final=true",
        f"trainer.run_dir={tmp_path / 'prime'}",
    )
    run(cfg)
    first, second = _train_records(tmp_path / "prime")
    # step 1: the reward model is the policy's copy, as is the reference: every implicit
    # reward beta * (log pi_rm - log pi_ref) is exactly 0, and its zero logit predicts
    # "wrong" for every sample
    assert first["prime/implicit_reward_token_mean"] == 0.0
    assert first["prime/rm_acc_before"] == pytest.approx(1.0 - first["prime/label_mean"])
    # the reward model trained on step 1's labels, so step 2's implicit rewards moved
    for r in (first, second):
        assert math.isfinite(r["prime/rm_loss"]) and r["prime/grad_norm"] > 0
    assert second["prime/implicit_reward_token_mean"] != 0.0
    # the reward model is part of the checkpoint
    assert any((tmp_path / "prime" / "checkpoints").glob("*/prime_rm"))


def _sequence_log_prob(model, prompt_ids, response_ids):
    return float(_response_log_probs(model, prompt_ids, response_ids).sum())


@pytest.mark.multiproc
def test_spin_loss_is_the_formula_on_the_run_pairs(ray_session, tmp_path):
    run_dir = tmp_path / "spin"
    cfg = _smoke(
        tmp_path,
        "-p",
        "spin",
        "trainer.steps=3",
        "algorithm.spin.refresh_every=2",
        "trainer.save_every=1",
        "trainer.keep_checkpoints=3",
        "trainer.dump_generations=1",
        f"trainer.run_dir={run_dir}",
    )
    run(cfg)
    first, second, third = _train_records(run_dir)
    # step 1: the reference is the actor itself, so every margin is 0 and the loss log 2
    assert first["actor/spin/margin"] == 0.0
    assert first["actor/spin/loss"] == pytest.approx(math.log(2), abs=1e-6)
    # step 2 trains the weights after step 1 against the initial ones (no refresh yet):
    # recompute every sequence log-prob here and apply the formula (one micro-batch)
    export_checkpoint(run_dir / "checkpoints" / "step_1", tmp_path / "w1")
    actor = AutoModelForCausalLM.from_pretrained(tmp_path / "w1", dtype=torch.float32)
    ref = AutoModelForCausalLM.from_pretrained(resolve_model_path("tiny", 0), dtype=torch.float32)
    path = run_dir / "generations" / "train_step2.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    assert len(rows) == 4 and [r["chosen"] for r in rows] == [True, False, True, False]
    tok = load_tokenizer(resolve_model_path("tiny", 0))
    for chosen, rejected in zip(rows[0::2], rows[1::2], strict=True):
        assert chosen["prompt_ids"] == rejected["prompt_ids"]
        # the chosen response is the task's answer (the value the prompt asks for), then EOS
        expression = re.search(r"Calculate ([-+*/() 0-9]+?)\.?\n", chosen["prompt"]).group(1)
        answer = eval(expression)  # noqa: S307 (digits and operators only, by the pattern)
        assert chosen["response_ids"] == [
            *tok.encode(str(answer), add_special_tokens=False),
            tok.eos_token_id,
        ]

    def seq(model, kind):
        return torch.tensor(
            [
                _sequence_log_prob(model, r["prompt_ids"], r["response_ids"])
                for r in rows
                if r["chosen"] == kind
            ],
            dtype=torch.float64,
        )

    loss, metrics = spin_loss(seq(actor, True), seq(actor, False), seq(ref, True), seq(ref, False))
    assert second["actor/spin/loss"] == pytest.approx(float(loss), abs=1e-5)
    assert second["actor/spin/margin"] == pytest.approx(metrics["spin/margin"], abs=1e-5)
    assert second["actor/spin/loss"] != pytest.approx(math.log(2), abs=1e-4)
    assert second["spin/reference_refreshed"] == 1.0
    # after step 2 the reference became the actor: step 3's margins are 0 again
    assert third["actor/spin/margin"] == 0.0 and third["spin/reference_refreshed"] == 0.0


def test_spin_refuses_prompts_without_reference_answers():
    cfg = parse_config(["-p", "smoke", "-p", "spin"])
    records = [PromptRecord([{"role": "user", "content": "2+2?"}], "x", "4")]
    Spin.check_data(cfg, records, "train.parquet")
    records.append(PromptRecord([{"role": "user", "content": "3+3?"}], "x", " "))
    with pytest.raises(ConfigError, match="row 1 of train.parquet: algorithm.spin needs"):
        Spin.check_data(cfg, records, "train.parquet")
