"""End to end through Ray: the PPO app's smoke preset (GRPO and PPO with a critic), exact
resume, and the errors a user meets first. One Ray session for the module."""

from __future__ import annotations

import json
import math

import psutil
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from transformers import AutoModelForCausalLM

from tephra.apps.ppo.main import parse_config, run
from tephra.controller.launch.ppo import prepare
from tephra.controller.run.models import resolve_model_path
from tephra.controller.run.trackers import read_jsonl
from tephra.controller.step.mismatch import MismatchAlarm
from tephra.controller.step.scoring import RewardFailure
from tephra.controller.testing import SMOKE_REWARD, untimed_metrics
from tephra.core.errors import ConfigError


def _smoke(tmp_path, *overrides):
    reward = tmp_path / "reward.py"
    reward.write_text(SMOKE_REWARD)
    return parse_config(["-p", "smoke", f"reward.custom_function_path={reward}", *overrides])


def _dumped(run_dir, step: int) -> list[dict]:
    """The trained samples of `step` a run dumped (`trainer.dump_generations`)."""
    path = run_dir / "generations" / f"train_step{step}.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()]


def _compared(records):
    # wall-clock metrics differ run to run; everything computed from data must not
    return [untimed_metrics(r) for r in records]


@pytest.mark.multiproc
def test_grpo_resume_is_exact(ray_session, tmp_path, grpo_step_reference, smoke_score):
    # with the DAPO preset on top: dynamic sampling's extra rounds move the prompt loader,
    # which the checkpoint must restore too
    dapo = ("-p", "dapo", "algorithm.max_gen_batches=2")
    full_cfg = _smoke(
        tmp_path,
        *dapo,
        "trainer.steps=4",
        "trainer.save_every=2",
        "trainer.dump_generations=1",
        f"trainer.run_dir={tmp_path / 'full'}",
    )
    full = run(full_cfg)
    assert full["steps"] == 4
    # the start-up timeline: every phase from the process's start to the first step
    startup = full["startup"]
    assert list(startup) == [
        "imports_s",
        "prepare_s",
        "dtypes_s",
        "ray_s",
        "workers_s",
        "peak_flops_s",
        "total_s",
        "worker_process_s",
        "worker_build_s",
    ]
    phases = [startup[k] for k in list(startup)[:6]]
    assert startup["total_s"] == pytest.approx(sum(phases), abs=0.05)
    # the slowest rank's own phases happen inside `workers`, after Ray started
    assert 0 < startup["worker_build_s"] < startup["workers_s"]
    assert startup["worker_process_s"] > 0
    run(
        _smoke(
            tmp_path,
            *dapo,
            "trainer.steps=2",
            "trainer.save_every=2",
            f"trainer.run_dir={tmp_path / 'split'}",
        )
    )
    # the checkpoint's place in the data belongs to its data: other prompts are refused
    # before Ray does anything (fewer prompts: a different set and order)
    with pytest.raises(ConfigError, match=r"was trained on other data \(32 prompts.*now 24"):
        run(
            _smoke(
                tmp_path,
                *dapo,
                "trainer.steps=4",
                "data.train_size=24",
                f"trainer.run_dir={tmp_path / 'split'}",
            )
        )
    resumed = run(
        _smoke(
            tmp_path,
            *dapo,
            "trainer.steps=4",
            "trainer.save_every=2",
            f"trainer.run_dir={tmp_path / 'split'}",
        )
    )
    assert resumed["steps"] == 4
    a = read_jsonl(tmp_path / "full" / "metrics.jsonl")
    b = read_jsonl(tmp_path / "split" / "metrics.jsonl")
    assert [r["step"] for r in a] == [1, 2, 3, 4]
    assert _compared(a) == _compared(b)  # bitwise: floats compared with ==
    # the test means something only if the steps trained on something: every step's
    # rewards, DAPO's length penalty, advantages and reward mean recomputed from its dumped
    # samples, and step 1's loss and gradient (on-policy, the initial weights) in transformers
    budget, buffer = full_cfg.rollout.max_tokens, full_cfg.algorithm.overlong_buffer
    assert full_cfg.algorithm.overlong_penalty_factor == 1.0
    for record in a:
        rows = [
            json.loads(x)
            for x in (tmp_path / "full" / "generations" / f"train_step{record['step']}.jsonl")
            .read_text()
            .splitlines()
        ]
        assert len(rows) == 8
        assert [r["score"] for r in rows] == [smoke_score(r["response"]) for r in rows]
        # DAPO's soft overlong punishment: 0 up to budget - buffer tokens, then -1/buffer per
        # token, -1 at most
        shaping = [
            -min(max(len(r["response_ids"]) - (budget - buffer), 0) / buffer, 1.0) for r in rows
        ]
        assert record["reward/overlong_penalty_mean"] == pytest.approx(
            sum(shaping) / len(shaping), abs=1e-6
        )
        step1 = record["step"] == 1
        want = grpo_step_reference(
            resolve_model_path("tiny", 0) if step1 else None, rows, shaping=shaping
        )
        assert [r["advantage"] for r in rows] == pytest.approx(want["advantages"], abs=1e-5)
        assert record["reward/mean"] == pytest.approx(want["reward/mean"], abs=1e-6)
        if step1:
            assert record["actor/pg_loss"] == pytest.approx(want["pg_loss"], abs=1e-4)
            assert record["actor/grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-3)
            assert want["grad_norm"] > 1e-3  # the rewards of a group differed
    for key in (
        "reward/mean",
        "accuracy/train",
        "response/length_mean",
        "actor/entropy",
        "actor/pg_clipfrac",
        "actor/grad_norm",
        "time/generate_s",
        "perf/tokens_per_s",
        "dapo/gen_rounds",
        "dapo/groups_flat",
        "reward/overlong_penalty_mean",
    ):
        assert key in a[0], key
    # model FLOPs over a CPU's measured peak: named so, and a utilisation (never above 1)
    steps = [r for r in a + b if "perf/flops" in r]
    assert steps and all(0 < r["perf/mfu_measured_peak"] < 1 and "perf/mfu" not in r for r in steps)
    # the train/rollout mismatch every step, from the probe (this run computes no old
    # log-probs of its own); the same fp32 model on both sides: the gap is rounding only
    for row in a:
        assert row["rollout_corr/probe_rows"] == 8.0
        assert 0 <= row["rollout_corr/kl_k3"] < 1e-4, row["rollout_corr/kl_k3"]
    assert (tmp_path / "full" / "curves.png").exists()
    assert json.loads((tmp_path / "full" / "summary.json").read_text())["steps"] == 4


@pytest.mark.multiproc
def test_object_store_metrics_follow_what_is_put(ray_session):
    """memory/object_store_used_gib over the cluster grows by exactly what is put in it (a
    64 MiB array), and falls back when it is freed."""
    import gc
    import time

    import numpy as np
    import ray

    from tephra.controller.run.object_store import object_store_metrics

    def used_bytes() -> float:
        return object_store_metrics()["memory/object_store_used_gib"] * 2**30

    before = used_bytes()
    ref = ray.put(np.ones(64 << 20, dtype=np.uint8))
    held = used_bytes()
    assert held - before == pytest.approx(64 << 20, abs=64 << 10)  # the array, plus a header
    del ref
    gc.collect()
    end = time.monotonic() + 30  # the store frees a released object a moment later
    while abs(used_bytes() - before) >= 64 << 10 and time.monotonic() < end:
        time.sleep(0.1)
    assert used_bytes() == pytest.approx(before, abs=64 << 10)
    assert object_store_metrics()["memory/object_store_spilled_gib"] == 0.0


def test_ppo_with_critic_and_reference(ray_session, tmp_path, critic_step_reference):
    cfg = _smoke(
        tmp_path,
        "-p",
        "ppo_critic",
        "actor.objective.use_kl_loss=true",
        "actor.objective.kl_loss_coef=0.01",
        "trainer.val_after=true",
        "trainer.export_hf=true",
        "trainer.profile_steps=[2]",
        "trainer.val.n=4",
        "trainer.val.temperature=1.0",
        "trainer.val.ks=[1,2]",
        "trainer.dump_generations=1",
        f"trainer.run_dir={tmp_path / 'ppo'}",
    )
    summary = run(cfg)
    driver_rss = psutil.Process().memory_info().rss / 2**30  # this process was the driver
    tok = prepare(cfg).tokenizer
    records = read_jsonl(tmp_path / "ppo" / "metrics.jsonl")
    train = [r for r in records if "reward/mean" in r]
    assert len(train) == 2
    # the operator's memory metrics: the driver's RSS as psutil reads it after the run; each
    # rank holds torch, transformers and the model (an idle Ray actor is ~0.1 GiB)
    assert train[-1]["memory/driver_rss_gib"] == pytest.approx(driver_rss, abs=0.3)
    assert all(r["memory/rank_rss_gib_max"] > 0.4 for r in train)
    assert not any(k.startswith("memory/gpu") for k in train[-1])  # CPU ranks
    assert all(math.isfinite(r["memory/object_store_used_gib"]) for r in train)
    assert all(r["memory/object_store_spilled_gib"] == 0.0 for r in train)  # nothing spilled
    for r in train:
        assert "actor/kl_loss" in r and "time/values_s" in r and "time/ref_s" in r
    # step 1 recomputed from its dumped samples in plain transformers and torch: the critic's
    # initial values behind the GAE advantages, then its value loss and gradient norm over
    # the two mini-batches (an AdamW step between them)
    gens = tmp_path / "ppo" / "generations"
    rows = [json.loads(x) for x in (gens / "train_step1.jsonl").read_text().splitlines()]
    want = critic_step_reference(cfg, rows)
    assert [r["advantage"] for r in rows] == pytest.approx(want["advantages"], abs=1e-5)
    assert train[0]["critic/vf_loss"] == pytest.approx(want["vf_loss"], rel=1e-5)
    assert train[0]["critic/grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4)
    # validation: 4 samples of each of the 8 held-out prompts, summarised and dumped
    last = records[-1]
    assert last["accuracy/val"] == summary["accuracy_after"] == last["val/acc@4"]
    val_rows = [json.loads(x) for x in (gens / "val_step2.jsonl").read_text().splitlines()]
    assert len(val_rows) == 32 and {r["prompt_index"] for r in val_rows} == set(range(8))
    # each score is the reward function on the response text, recomputed here; acc@4 is the
    # fraction of samples with a full score, pass@k the unbiased estimator over prompts
    assert [r["score"] for r in val_rows] == [
        (sum(map(ord, r["response"])) % 5) / 4.0 for r in val_rows
    ]
    assert summary["accuracy_after"] == pytest.approx(sum(r["score"] >= 1 for r in val_rows) / 32)
    right = [sum(r["score"] >= 1 for r in val_rows if r["prompt_index"] == i) for i in range(8)]
    for k in (1, 2):
        want = sum(1 - math.comb(4 - c, k) / math.comb(4, k) for c in right) / 8
        assert last[f"val/pass@{k}"] == pytest.approx(want), k
    assert last["val/prompts"] == 8
    for step in (1, 2):
        train_rows = [
            json.loads(x) for x in (gens / f"train_step{step}.jsonl").read_text().splitlines()
        ]
        assert len(train_rows) == 8 and all(r["advantage"] is not None for r in train_rows)
        for r in train_rows:  # the tokens behind the text: enough to replay the step
            assert tok.decode(r["prompt_ids"], skip_special_tokens=True) == r["prompt"]
            assert len(r["response_mask"]) == len(r["response_ids"]) and all(r["response_mask"])
            assert r["finish_reason"] in ("stop", "length")
            assert (r["response_ids"][-1] == tok.eos_token_id) == (r["finish_reason"] == "stop")
            assert len(r["response_ids"]) <= cfg.rollout.max_tokens
        # the throughput: the step's tokens (prompts and responses, dumped) over its time; the
        # stages' laps (`time/reward_s`, scoring that overlaps them, aside) fit in the step
        record = train[step - 1]
        tokens = sum(len(r["prompt_ids"]) + len(r["response_ids"]) for r in train_rows)
        assert record["perf/tokens_per_s"] == pytest.approx(tokens / record["time/step_s"])
        laps = [
            v
            for k, v in record.items()
            if k.startswith("time/") and k not in ("time/step_s", "time/reward_s")
        ]
        assert sum(laps) <= record["time/step_s"]
    # the profiled step wrote one valid Chrome trace per stage (one rank here)
    traces = sorted(p.name for p in (tmp_path / "ppo" / "profile").glob("*.json"))
    assert traces == [
        f"step2_{s}_rank0.json"
        for s in sorted(["actor", "critic", "generate", "old_log_probs", "ref", "sync", "values"])
    ]
    for name in traces:
        events = json.loads((tmp_path / "ppo" / "profile" / name).read_text())["traceEvents"]
        # the stage's range (an NVTX range too on CUDA) spans the stage's operators
        stage = name.removeprefix("step2_").removesuffix("_rank0.json")
        (span,) = [e for e in events if e.get("name") == f"tephra/{stage}"]
        # (microseconds) inside the driver's time of that stage of step 2
        assert span["cat"] == "user_annotation"
        assert 0 < span["dur"] <= 1e6 * train[1][f"time/{stage}_s"], stage
        ops = [e for e in events if e.get("cat") == "cpu_op" and e.get("tid") == span["tid"]]
        assert ops and all(span["ts"] <= e["ts"] <= span["ts"] + span["dur"] for e in ops)
    share = summary["time_share"]
    assert {"generate", "actor", "critic", "sync"} <= set(share) and 0.9 < sum(
        share.values()
    ) <= 1.0
    AutoModelForCausalLM.from_pretrained(tmp_path / "ppo" / "hf")


@pytest.mark.multiproc
def test_smoke_preset_on_megatron_matches_fsdp(ray_session, tmp_path, reference_grad_norm):
    """`actor.engine=megatron`, nothing else changed: the first step's rollout is the same
    (same initial weights and seeds) and the update agrees with FSDP's to parity tolerance,
    and FSDP's with the gradient recomputed in plain transformers."""
    first = {}
    for engine in ("fsdp", "megatron"):
        run(
            _smoke(
                tmp_path,
                f"actor.engine={engine}",
                "trainer.steps=1",
                "trainer.dump_generations=1",
                f"trainer.run_dir={tmp_path / engine}",
            )
        )
        (first[engine],) = read_jsonl(tmp_path / engine / "metrics.jsonl")
    fsdp, mega = first["fsdp"], first["megatron"]
    # on-policy GRPO, seq-mean-token-mean: the loss -1/N sum_i mean_t A_i ratio_it has, at
    # ratio 1, the gradient of sum_i (-A_i / (N |y_i|)) sum_t log pi(y_it)
    path = tmp_path / "fsdp" / "generations" / "train_step1.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    coefs = [-r["advantage"] / (len(rows) * len(r["response_ids"])) for r in rows]
    want = reference_grad_norm(resolve_model_path("tiny", 0), rows, coefs)
    assert fsdp["actor/grad_norm"] == pytest.approx(want, rel=1e-4)
    for key in ("reward/mean", "response/length_mean", "perf/trained_tokens"):
        assert fsdp[key] == mega[key], key
    for key, tol in (("actor/pg_loss", 1e-5), ("actor/entropy", 1e-5), ("actor/grad_norm", 1e-4)):
        assert abs(fsdp[key] - mega[key]) <= tol, (key, fsdp[key], mega[key])


@pytest.mark.multiproc
def test_lora_on_megatron_matches_fsdp_lora(ray_session, tmp_path, grpo_step_reference):
    """`actor.engine=megatron actor.lora.rank=8` through the app, with a KL loss whose
    reference is the actor with its adapters off (`reference_mode`): the first step equals
    FSDP's LoRA run (same rollout, same losses and grad norm to parity tolerance), and FSDP's
    the step recomputed in plain transformers + peft."""
    first = {}
    for engine in ("fsdp", "megatron"):
        cfg = _smoke(
            tmp_path,
            f"actor.engine={engine}",
            "actor.lora.rank=8",
            "actor.objective.use_kl_loss=true",
            "actor.objective.kl_loss_coef=0.1",
            "trainer.steps=1",
            "trainer.dump_generations=1",
            f"trainer.run_dir={tmp_path / engine}",
        )
        run(cfg)
        (first[engine],) = read_jsonl(tmp_path / engine / "metrics.jsonl")
    fsdp, mega = first["fsdp"], first["megatron"]
    # B = 0 at step 1: the adapted policy is its reference, so the KL term is 0 and so is its
    # gradient (k3's is (1 - ratio) grad log pi); the gradient is GRPO's alone, on the
    # adapters peft draws from the run's seed
    path = tmp_path / "fsdp" / "generations" / "train_step1.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    want = grpo_step_reference(
        resolve_model_path("tiny", 0), rows, lora=cfg.actor.lora, seed=cfg.trainer.seed
    )
    assert fsdp["actor/kl_loss"] == pytest.approx(0.0, abs=1e-7)
    assert fsdp["actor/pg_loss"] == pytest.approx(want["pg_loss"], abs=1e-5)
    assert fsdp["actor/grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4)
    assert want["grad_norm"] > 1e-3  # the rewards of a group differed
    for key in ("reward/mean", "response/length_mean", "perf/trained_tokens"):
        assert fsdp[key] == mega[key], key
    for key, tol in (
        ("actor/pg_loss", 1e-5),
        ("actor/kl_loss", 1e-6),
        ("actor/entropy", 1e-5),
        ("actor/grad_norm", 1e-4),
    ):
        assert abs(fsdp[key] - mega[key]) <= tol, (key, fsdp[key], mega[key])


@pytest.mark.multiproc
def test_routing_replay_through_the_app(ray_session, tmp_path):
    """A tiny Qwen2-MoE generating in bfloat16 and training in float32: some tokens route
    differently, so the trainer's log-probs drift from the rollout's. With
    `actor.moe.routing_replay=rollout` the hf rollout records the routes and training replays
    them: the train/rollout gap shrinks, and Megatron's first step equals FSDP's."""
    from tephra.rollout.testing import build_tiny_model

    moe = build_tiny_model(tmp_path / "moe", model_type="qwen2_moe", seed=2)
    first = {}
    for engine, replay in (("megatron", "off"), ("megatron", "rollout"), ("fsdp", "rollout")):
        folder = tmp_path / f"{engine}-{replay}"
        run(
            _smoke(
                tmp_path,
                f"model.path={moe.path}",
                "rollout.dtype=bfloat16",
                "rollout.max_tokens=16",
                f"actor.engine={engine}",
                f"actor.moe.routing_replay={replay}",
                "trainer.steps=1",
                f"trainer.run_dir={folder}",
            )
        )
        (first[engine, replay],) = read_jsonl(folder / "metrics.jsonl")
    gap = "rollout_corr/log_prob_abs_gap_mean"
    off, on = first["megatron", "off"], first["megatron", "rollout"]
    print({k: (v[gap], v["actor/grad_norm"]) for k, v in first.items()})
    assert on[gap] < off[gap], (on[gap], off[gap])
    fsdp = first["fsdp", "rollout"]
    for key in ("reward/mean", "response/length_mean"):
        assert fsdp[key] == on[key] == off[key], key
    for key, tol in ((gap, 1e-5), ("actor/pg_loss", 1e-5), ("actor/grad_norm", 1e-4)):
        assert abs(fsdp[key] - on[key]) <= tol, (key, fsdp[key], on[key])


@pytest.mark.multiproc
def test_reward_failing_everywhere_is_one_clear_error(ray_session, tmp_path):
    bad = tmp_path / "bad_reward.py"
    bad.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    raise ValueError('no answer key')\n"
    )
    cfg = parse_config(
        ["-p", "smoke", f"reward.custom_function_path={bad}", f"trainer.run_dir={tmp_path / 'bad'}"]
    )
    with pytest.raises(RewardFailure, match=r"failed on all 8 samples.*ValueError: no answer key"):
        run(cfg)


def test_config_and_input_errors(tmp_path):
    with pytest.raises(
        ConfigError,
        match=r"unknown config key 'algorithm.adv_estimater'; did you mean 'algorithm.adv_estimator'",
    ):
        parse_config(["algorithm.adv_estimater=grpo"])
    with pytest.raises(
        ConfigError, match=r"2 x 4 / 1 = 8 samples, which batch.mini_batches=3 does not divide"
    ):
        parse_config(["-p", "smoke", "batch.mini_batches=3"])
    with pytest.raises(
        ConfigError, match=r"prompts_per_step=3 must be a multiple of the data-parallel size 2"
    ):
        parse_config(["batch.prompts_per_step=3", "resources.world_size=2"])
    with pytest.raises(
        ConfigError,
        match=r"96 \+ 8 = 104 tokens, more than actor.micro_batch.max_tokens_per_microbatch=100",
    ):
        parse_config(["-p", "smoke", "actor.micro_batch.max_tokens_per_microbatch=100"])
    with pytest.raises(
        ConfigError, match=r"model.path='/nonexistent/model': folder does not exist"
    ):
        run(parse_config(["-p", "smoke", "model.path=/nonexistent/model"]))
    rows = {
        "prompt": [[{"role": "user", "content": "2+2?"}]] * 3,
        "data_source": ["gsm8k"] * 3,
        "reward_model": [{"ground_truth": "4"}, {"ground_truth": "4"}, {"style": "rule"}],
    }
    pq.write_table(pa.table(rows), tmp_path / "train.parquet")
    from tephra.controller.data.prompts import DatasetError

    with pytest.raises(
        DatasetError, match=r"row 2 of train.parquet: field 'reward_model.ground_truth' is missing"
    ):
        run(
            parse_config(
                [
                    "-p",
                    "smoke",
                    "data.source=parquet",
                    f"data.train_files=[{tmp_path / 'train.parquet'}]",
                ]
            )
        )


@pytest.mark.multiproc
def test_a_rollout_in_another_dtype_is_rejected_token_by_token_or_stops_the_run(
    ray_session, tmp_path
):
    """A bf16 rollout beside an fp32 trainer: rejection sampling drops the tokens whose k3
    divergence passes the bound (fewer tokens trained), and the alarm stops a run at step 1
    with the message naming the likely cause."""
    bf16 = ("rollout.dtype=bfloat16", "trainer.steps=1")
    run(
        _smoke(
            tmp_path,
            *bf16,
            "algorithm.rollout_rejection=[token_k3]",
            "algorithm.rollout_rejection_threshold=1e-4",
            "trainer.dump_generations=1",
            f"trainer.run_dir={tmp_path / 'rs'}",
        )
    )
    (row,) = read_jsonl(tmp_path / "rs" / "metrics.jsonl")
    assert row["rollout_corr/kl_k3"] > 1e-5  # bf16 against fp32: a real gap
    # the dropped share recomputed: k3 = exp(g) - 1 - g of g = log pi_old - log pi_rollout per
    # response token, pi_old the fp32 model in plain transformers, pi_rollout the bf16 rollout's
    # dumped log-probs; a token is dropped above the bound
    dumped = (tmp_path / "rs" / "generations" / "train_step1.jsonl").read_text().splitlines()
    model = AutoModelForCausalLM.from_pretrained(resolve_model_path("tiny", 0), dtype=torch.float32)
    dropped = tokens = 0
    for sample in map(json.loads, dumped):
        prompt, response = sample["prompt_ids"], sample["response_ids"]
        with torch.no_grad():
            logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1]
        old = torch.log_softmax(logits.double(), -1).gather(-1, torch.tensor(response)[:, None])
        g = old[:, 0] - torch.tensor(sample["rollout_log_probs"], dtype=torch.float64)
        dropped += int((torch.expm1(g) - g > 1e-4).sum())
        tokens += len(response)
    assert 0 < dropped < tokens  # the bound drops some tokens, not all
    assert row["rollout_corr/rs_masked_frac"] == pytest.approx(dropped / tokens, abs=1e-9)
    assert row["rollout_corr/rs_token_k3_masked_frac"] == row["rollout_corr/rs_masked_frac"]
    with pytest.raises(
        MismatchAlarm,
        match=r"step 1: the rollout's log-probs differ .* over "
        r"algorithm.mismatch_alarm_kl=1e-06\. Likely causes: .*dtype",
    ):
        run(
            _smoke(
                tmp_path,
                *bf16,
                "algorithm.mismatch_alarm_kl=1e-6",
                f"trainer.run_dir={tmp_path / 'alarm'}",
            )
        )


@pytest.mark.multiproc
def test_options_a_verl_user_sets_are_reachable(
    ray_session, tmp_path, grpo_step_reference, reference_grad_norm, ppo_update_reference
):
    """ReMax's greedy baselines, verl's pass@k estimator, truncated importance sampling,
    the -norm aggregation, adaptive KL in the reward, LoRA on named modules with the KL loss
    against the adapters-off reference, and a reward model: each through the app, checked
    against the numbers it must produce."""
    remax = run(
        _smoke(
            tmp_path,
            "algorithm.adv_estimator=remax",
            "trainer.steps=1",
            "trainer.dump_generations=1",
            f"trainer.run_dir={tmp_path / 'remax'}",
        )
    )
    (row,) = read_jsonl(tmp_path / "remax" / "metrics.jsonl")
    assert remax["steps"] == 1 and "time/baselines_s" in row
    # A = score - b: one baseline per prompt, a score the reward function can give, whose
    # mean over the prompts is the logged greedy baseline
    samples = [
        json.loads(x)
        for x in (tmp_path / "remax" / "generations" / "train_step1.jsonl").read_text().splitlines()
    ]
    baselines = {}
    for r in samples:
        b = baselines.setdefault(r["prompt_index"], r["score"] - r["advantage"])
        assert r["score"] - r["advantage"] == pytest.approx(b, abs=1e-6)
    assert len(baselines) == 2
    assert all(min(abs(b - v / 4) for v in range(5)) < 1e-6 for b in baselines.values())
    assert row["reward/greedy_baseline_mean"] == pytest.approx(sum(baselines.values()) / 2)

    run(
        _smoke(
            tmp_path,
            "algorithm.adv_estimator=grpo_passk",
            "algorithm.advantage.passk_k=2",
            "actor.objective.tis_level=token",
            "actor.objective.tis_threshold=2.0",
            "actor.objective.loss_agg_mode=seq-mean-token-sum-norm",
            "actor.objective.loss_agg_norm_constant=8",
            "algorithm.kl_in_reward.coef=0.05",
            "algorithm.kl_in_reward.controller=adaptive",
            "algorithm.kl_in_reward.target_kl=0.01",
            "algorithm.kl_in_reward.horizon=100",
            "trainer.dump_generations=1",
            f"trainer.run_dir={tmp_path / 'kl'}",
        )
    )
    first, second = read_jsonl(tmp_path / "kl" / "metrics.jsonl")
    assert first["kl_penalty/coef"] == pytest.approx(0.05)
    # Ziegler et al.'s controller by hand: beta *= 1 + clip(kl / target - 1, +-0.2) * n / horizon
    error = min(max(first["kl_penalty/kl"] / 0.01 - 1.0, -0.2), 0.2)
    assert second["kl_penalty/coef"] == pytest.approx(0.05 * (1 + error * 8 / 100), rel=1e-6)
    assert "time/ref_s" in first
    # step 1 on-policy (ratio 1, TIS weights 1: the rollout is the fp32 trainer) from the
    # initial weights, the reference those weights too (no KL in the rewards yet): Dr.
    # GRPO's seq-mean-token-sum-norm puts -A_i / (C S) on each token's log-prob (C = 8, S = 8)
    rows = _dumped(tmp_path / "kl", 1)
    assert first["kl_penalty/kl"] == pytest.approx(0.0, abs=1e-6)
    coefs = [-r["advantage"] / (8 * len(rows)) for r in rows]
    tokens = [len(r["response_ids"]) for r in rows]
    assert first["actor/pg_loss"] == pytest.approx(
        sum(c * n for c, n in zip(coefs, tokens, strict=True)), abs=1e-6
    )
    want = reference_grad_norm(resolve_model_path("tiny", 0), rows, coefs)
    assert first["actor/grad_norm"] == pytest.approx(want, rel=1e-4)
    assert want > 1e-3  # some sample's advantage was not 0

    # a verl config's names, unchanged: vectorised GRPO, GMPO, kl+ and token-sum
    run(
        _smoke(
            tmp_path,
            "algorithm.adv_estimator=grpo_vectorized",
            "actor.objective.policy_loss=geo_mean",
            "actor.objective.use_kl_loss=true",
            "actor.objective.kl_loss_type=kl+",
            "actor.objective.loss_agg_mode=token-sum",
            "trainer.steps=1",
            "trainer.dump_generations=1",
            f"trainer.run_dir={tmp_path / 'verl'}",
        )
    )
    (verl,) = read_jsonl(tmp_path / "verl" / "metrics.jsonl")
    # step 1 by hand: GRPO's advantages; GMPO (its own seq-mean-token-mean, whatever
    # loss_agg_mode says) at ratio 1 puts -A_i / (S |y_i|) on each token's log-prob, so its
    # loss -sum_i A_i / S is 0 for GRPO's advantages; kl+ is k1's value (0: the reference is
    # the initial policy) with k2's gradient (0 there)
    rows = _dumped(tmp_path / "verl", 1)
    want = grpo_step_reference(None, rows)
    assert [r["advantage"] for r in rows] == pytest.approx(want["advantages"], abs=1e-5)
    assert verl["actor/kl_loss"] == pytest.approx(0.0, abs=1e-7)
    assert verl["actor/pg_loss"] == pytest.approx(0.0, abs=1e-6)
    coefs = [-a / (len(rows) * len(r["response_ids"])) for a, r in zip(want["advantages"], rows)]
    norm = reference_grad_norm(resolve_model_path("tiny", 0), rows, coefs)
    assert verl["actor/grad_norm"] == pytest.approx(norm, rel=1e-4)
    assert norm > 1e-3
    # verl's bypass_mode: old log-probs are the rollout's, so 2 mini-batches run no recompute
    bypass_cfg = _smoke(
        tmp_path,
        "actor.objective.policy_loss=bypass_mode",
        "algorithm.rollout_correction=bypass",
        "batch.mini_batches=2",
        "trainer.steps=1",
        "trainer.dump_generations=1",
        f"trainer.run_dir={tmp_path / 'bypass'}",
    )
    run(bypass_cfg)
    (bypass,) = read_jsonl(tmp_path / "bypass" / "metrics.jsonl")
    assert not [k for k in bypass if "old_log_probs" in k]
    # the update in plain torch: PPO's clip against the rollout's log-probs for both
    # mini-batches (the second after an AdamW step: its ratios are not 1), grad norms averaged
    rows = _dumped(tmp_path / "bypass", 1)
    want = ppo_update_reference(bypass_cfg, rows, [r["advantage"] for r in rows])
    assert bypass["actor/pg_loss"] == pytest.approx(want["pg_loss"], abs=1e-5)
    assert bypass["actor/grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4)
    assert bypass["actor/ratio_max"] == pytest.approx(want["ratio_max"], abs=1e-5)
    assert want["ratio_maxes"][1] > 1.001  # the second mini-batch ran off-policy

    import torch
    from safetensors.torch import load_file
    from transformers import (
        AutoModelForSequenceClassification,
        AutoTokenizer,
        Qwen2Config,
        Qwen2ForSequenceClassification,
    )

    policy = resolve_model_path("tiny", 0)
    rm_dir = tmp_path / "rm"
    tok = AutoTokenizer.from_pretrained(policy)
    torch.manual_seed(0)
    Qwen2ForSequenceClassification(
        Qwen2Config(
            vocab_size=len(tok),
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            num_labels=1,
            pad_token_id=tok.pad_token_id,
        )
    ).save_pretrained(rm_dir)
    tok.save_pretrained(rm_dir)
    lora = run(
        parse_config(
            [
                "-p",
                "smoke",
                "actor.lora.rank=4",
                "actor.lora.target_modules=[q_proj,v_proj]",
                "actor.optimizer.lr=0.05",  # each step moves the policy by much
                "actor.objective.use_kl_loss=true",
                "actor.objective.kl_loss_coef=0.1",
                f"reward.reward_model_path={rm_dir}",
                "trainer.export_hf=true",
                "trainer.dump_generations=1",
                f"trainer.run_dir={tmp_path / 'lora'}",
            ]
        )
    )
    rows = read_jsonl(tmp_path / "lora" / "metrics.jsonl")
    assert lora["steps"] == 2 and all("actor/kl_loss" in r for r in rows)
    # the syncs sent the adapter alone (actor.lora_sync=auto on the hf backend), which the
    # rollout serves over its base weights: its log-probs are the trainer's up to rounding
    # (with the adapter left unapplied, the smoke preset with LoRA on every linear layer and
    # this lr gave kl_k3 0.37 at step 2)
    for row in rows:
        assert row["rollout_corr/probe_rows"] == 8.0
        assert 0 <= row["rollout_corr/kl_k3"] < 1e-4, row["rollout_corr/kl_k3"]
    # every trained sample's reward is the score the reward model gives its text (prompt +
    # response) run here in plain transformers, one text at a time, without padding
    rm = AutoModelForSequenceClassification.from_pretrained(rm_dir, dtype=torch.float32).eval()
    for step, record in zip((1, 2), rows, strict=True):
        path = tmp_path / "lora" / "generations" / f"train_step{step}.jsonl"
        dumped = [json.loads(x) for x in path.read_text().splitlines()]
        want = []
        for r in dumped:
            ids = tok(r["prompt"] + r["response"], return_tensors="pt")["input_ids"]
            with torch.no_grad():
                want.append(float(rm(input_ids=ids).logits[0, 0]))
            assert r["score"] == pytest.approx(want[-1], abs=1e-5)
        assert record["reward/mean"] == pytest.approx(sum(want) / len(want), abs=1e-5)
    base = load_file(f"{policy}/model.safetensors")
    tuned = load_file(f"{tmp_path / 'lora' / 'hf'}/model.safetensors")
    layer = "model.layers.0.self_attn"
    # only the named modules were adapted: merged q/v moved, k and the MLP did not
    assert not torch.equal(base[f"{layer}.q_proj.weight"], tuned[f"{layer}.q_proj.weight"])
    assert not torch.equal(base[f"{layer}.v_proj.weight"], tuned[f"{layer}.v_proj.weight"])
    assert torch.equal(base[f"{layer}.k_proj.weight"], tuned[f"{layer}.k_proj.weight"])
    assert torch.equal(
        base["model.layers.0.mlp.up_proj.weight"], tuned["model.layers.0.mlp.up_proj.weight"]
    )
