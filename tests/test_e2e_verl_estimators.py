"""verl's optimal-token-baseline estimators and GDPO with reward components, 2 steps each
through the PPO app, with step 1's advantages recomputed by hand from the dumped samples.

The references are naive float64 loops written from verl's definitions:
- OTB / TIR-OTB: verl/trainer/ppo/core_algos.py, `compute_optimal_token_baseline_advantage`
  and `compute_multi_turn_optimal_token_baseline_advantage` (w = 1 - 2 pi + sum pi^2 of the
  sampling policy, W its running sum, B_t = sum G W / (sum W + 1e-8) over the group); pi and
  sum pi^2 come from the initial tiny model's full float64 softmax.
- GDPO: verl's GDPO branch of `compute_advantage` (commit 40964ddf, "add gdpo
  implementation", verl/experimental/transfer_queue/ray_trainer.py): GRPO per reward
  component, summed (tephra weights them), whitened over the batch's response tokens.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from tephra.apps.ppo.main import parse_config, run
from tephra.controller.run.models import resolve_model_path
from tephra.controller.run.trackers import read_jsonl
from tephra.controller.testing import SMOKE_REWARD

COMPONENT_REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    fmt = float(len(solution_str.split()) % 2 == 0)
    acc = (sum(map(ord, solution_str)) % 5) / 4.0
    return {"score": fmt + acc, "format": fmt, "accuracy": acc}
"""


def _run(tmp_path, name, reward, *overrides):
    path = tmp_path / f"{name}_reward.py"
    path.write_text(reward)
    cfg = parse_config(
        [
            "-p",
            "smoke",
            f"reward.custom_function_path={path}",
            f"trainer.run_dir={tmp_path / name}",
            "trainer.dump_generations=1",
            *overrides,
        ]
    )
    summary = run(cfg)
    rows = [
        json.loads(x)
        for x in (tmp_path / name / "generations" / "train_step1.jsonl").read_text().splitlines()
    ]
    return cfg, summary, read_jsonl(tmp_path / name / "metrics.jsonl"), rows


def _policy_stats(cfg, rows):
    """Per sample: (pi of each response token, sum_v pi_v^2 before it), float64, from the
    initial model at the rollout temperature."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        resolve_model_path("tiny", cfg.trainer.seed), torch_dtype=torch.float64
    ).eval()
    out = []
    for r in rows:
        ids = torch.tensor([r["prompt_ids"] + r["response_ids"]])
        with torch.no_grad():
            logits = model(ids).logits[0] / cfg.rollout.temperature
        p = torch.softmax(logits, -1)
        start = len(r["prompt_ids"]) - 1  # position predicting the first response token
        pis, qs = [], []
        for k, tok in enumerate(r["response_ids"]):
            pis.append(float(p[start + k, tok]))
            qs.append(float((p[start + k] ** 2).sum()))
        out.append((pis, qs))
    return out


def _naive_otb(rows, stats, n, zero_tail):
    """Each sample's per-token advantages, verl's OTB loop; samples of one prompt share its
    prompt, so response token k of each sits in one column."""
    out = []
    for i, r in enumerate(rows):
        group = [j for j in range(len(rows)) if j // n == i // n]
        w_cum = {}
        for j in group:
            acc, cum = 0.0, []
            for pi, q in zip(*stats[j]):
                acc += 1 - 2 * pi + q
                cum.append(acc)
            w_cum[j] = cum
        lens = sorted(len(rows[j]["response_ids"]) for j in group)
        adv = []
        for k in range(len(r["response_ids"])):
            alive = [j for j in group if k < len(rows[j]["response_ids"])]
            num = sum(rows[j]["score"] * w_cum[j][k] for j in alive)
            base = num / (sum(w_cum[j][k] for j in alive) + 1e-8)
            longest = len(r["response_ids"]) == lens[-1] and lens[-1] > lens[-2]
            if zero_tail and longest and k >= lens[-2]:
                base = 0.0
            adv.append(r["score"] - base)  # the outcome reward: G_k = score at every k
        out.append(adv)
    return out


def _naive_otb_means(rows, stats, n, zero_tail):
    """Mean advantage over each sample's response tokens (what the dump logs)."""
    return [sum(adv) / len(adv) for adv in _naive_otb(rows, stats, n, zero_tail)]


@pytest.mark.multiproc
@pytest.mark.parametrize(
    "estimator, zero_tail",
    [("optimal_token_baseline", False), ("tir_optimal_token_baseline", True)],
)
def test_optimal_token_baselines_train_and_match_verl_by_hand(
    ray_session, tmp_path, estimator, zero_tail, reference_grad_norm
):
    cfg, summary, records, rows = _run(
        tmp_path,
        estimator,
        SMOKE_REWARD,
        f"algorithm.adv_estimator={estimator}",
        "rollout.temperature=0.9",
    )
    assert summary["steps"] == 2 and len(records) == 2
    n = cfg.batch.samples_per_prompt
    assert len(rows) == cfg.batch.prompts_per_step * n
    assert len({r["score"] for r in rows}) > 1  # the check below is not all zeros
    stats = _policy_stats(cfg, rows)
    want = _naive_otb_means(rows, stats, n, zero_tail)
    got = [r["advantage"] for r in rows]
    assert max(abs(a - b) for a, b in zip(got, want)) < 1e-6, (got, want)  # measured 2e-8
    # pi and sum pi^2 matter: with w = 1 (the group mean, token by token) the numbers differ
    flat = _naive_otb_means(rows, [([0.0] * len(p), [0.0] * len(p)) for p, _ in stats], n, False)
    assert max(abs(a - b) for a, b in zip(got, flat)) > 1e-5
    # the update trains on those token advantages: step 1 is on-policy (one mini-batch), so
    # the token-mean loss -sum_{i,t} A_it r_it / N has the gradient of -sum A_it log pi_it / N,
    # log pi at the rollout temperature; recomputed in plain transformers
    tokens = sum(len(r["response_ids"]) for r in rows)
    coefs = [[-a / tokens for a in adv] for adv in _naive_otb(rows, stats, n, zero_tail)]
    model = resolve_model_path("tiny", cfg.trainer.seed)
    norm = reference_grad_norm(model, rows, coefs, temperature=cfg.rollout.temperature)
    assert records[0]["actor/grad_norm"] == pytest.approx(norm, rel=1e-4)
    assert records[0]["actor/pg_loss"] == pytest.approx(
        sum(c for row in coefs for c in row), abs=1e-6
    )


def _naive_gdpo(rows, comps, weights, n, eps=1e-6):
    total = [0.0] * len(rows)
    for k, w in enumerate(weights):
        for i in range(len(rows)):
            group = [comps[j][k] for j in range(len(rows)) if j // n == i // n]
            mean = sum(group) / len(group)
            std = math.sqrt(sum((c - mean) ** 2 for c in group) / (len(group) - 1))
            total[i] += w * (comps[i][k] - mean) / (std + eps)
    lengths = [len(r["response_ids"]) for r in rows]
    tokens = sum(lengths)
    mean = sum(a * m for a, m in zip(total, lengths)) / tokens
    var = sum(m * (a - mean) ** 2 for a, m in zip(total, lengths)) / (tokens - 1)
    return [(a - mean) / math.sqrt(var + 1e-8) for a in total]


@pytest.mark.multiproc
def test_gdpo_takes_named_reward_components_and_matches_verl_by_hand(ray_session, tmp_path):
    cfg, summary, records, rows = _run(
        tmp_path,
        "gdpo",
        COMPONENT_REWARD,
        "algorithm.adv_estimator=gdpo",
        "algorithm.advantage.gdpo_reward_keys=[format, accuracy]",
        "algorithm.advantage.gdpo_reward_weights=[1.0, 0.5]",
    )
    assert summary["steps"] == 2 and len(records) == 2
    namespace: dict = {}
    exec(COMPONENT_REWARD, namespace)  # the same function, on the dumped responses
    comps = []
    for r in rows:
        d = namespace["compute_score"]("", r["response"], None)
        assert r["score"] == pytest.approx(d["score"])
        comps.append([d["format"], d["accuracy"]])
    assert len({c[0] for c in comps}) > 1 and len({c[1] for c in comps}) > 1
    want = _naive_gdpo(rows, comps, [1.0, 0.5], cfg.batch.samples_per_prompt)
    got = [r["advantage"] for r in rows]
    assert max(abs(a - b) for a, b in zip(got, want)) < 1e-6, (got, want)  # measured 8e-8
    # the components are not the score: GDPO on the score alone gives other advantages
    alone = _naive_gdpo(rows, [[r["score"]] for r in rows], [1.0], cfg.batch.samples_per_prompt)
    assert max(abs(a - b) for a, b in zip(got, alone)) > 1e-2
