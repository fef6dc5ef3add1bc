"""End to end through Ray: the PPO app's smoke preset (GRPO and PPO with a critic), exact
resume, and the errors a user meets first. One Ray session for the module."""

from __future__ import annotations

import json
import math

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tephra.apps.ppo.main import parse_config, run
from tephra.controller.rewarding import RewardFailure
from tephra.controller.trackers import read_jsonl
from tephra.core.errors import ConfigError

# A reward with variance on a random tiny model (rule scorers would give all zeros, and
# zero advantages would make "resume is exact" trivially true).
REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return (sum(map(ord, solution_str)) % 5) / 4.0
'''


@pytest.fixture(scope="module")
def ray_session():
    import ray

    from tephra.controller.worker_group import ray_init

    ray_init(num_cpus=2)
    yield
    ray.shutdown()


def _smoke(tmp_path, *overrides):
    reward = tmp_path / "reward.py"
    reward.write_text(REWARD)
    return parse_config(["-p", "smoke", f"reward.custom_function_path={reward}", *overrides])


def _compared(records):
    # wall-clock metrics differ run to run; everything computed from data must not
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "perf/tokens_per_s", "perf/mfu"))}
            for r in records]


@pytest.mark.multiproc
def test_grpo_resume_is_exact(ray_session, tmp_path):
    # with the DAPO preset on top: dynamic sampling's extra rounds move the prompt loader,
    # which the checkpoint must restore too
    dapo = ("-p", "dapo", "algorithm.max_gen_batches=2")
    full = run(_smoke(tmp_path, *dapo, "trainer.steps=4", "trainer.save_every=2",
                      f"trainer.run_dir={tmp_path / 'full'}"))
    assert full["steps"] == 4
    run(_smoke(tmp_path, *dapo, "trainer.steps=2", "trainer.save_every=2",
               f"trainer.run_dir={tmp_path / 'split'}"))
    resumed = run(_smoke(tmp_path, *dapo, "trainer.steps=4", "trainer.save_every=2",
                         f"trainer.run_dir={tmp_path / 'split'}"))
    assert resumed["steps"] == 4
    a = read_jsonl(tmp_path / "full" / "metrics.jsonl")
    b = read_jsonl(tmp_path / "split" / "metrics.jsonl")
    assert [r["step"] for r in a] == [1, 2, 3, 4]
    # the test means something only if training moved the weights
    assert any(r["actor/grad_norm"] > 0 for r in a) and len({r["reward/mean"] for r in a}) > 1
    assert _compared(a) == _compared(b)  # bitwise: floats compared with ==
    for key in ("reward/mean", "accuracy/train", "response/length_mean", "actor/entropy",
                "actor/pg_clipfrac", "actor/grad_norm", "time/generate_s", "perf/tokens_per_s",
                "dapo/gen_rounds", "dapo/groups_flat", "reward/overlong_penalty_mean"):
        assert key in a[0], key
    assert (tmp_path / "full" / "curves.png").exists()
    assert json.loads((tmp_path / "full" / "summary.json").read_text())["steps"] == 4


@pytest.mark.multiproc
def test_ppo_with_critic_and_reference(ray_session, tmp_path):
    summary = run(_smoke(tmp_path, "-p", "ppo_critic", "actor.objective.use_kl_loss=true",
                         "actor.objective.kl_loss_coef=0.01",
                         "trainer.val_after=true", "trainer.export_hf=true",
                         f"trainer.run_dir={tmp_path / 'ppo'}"))
    records = read_jsonl(tmp_path / "ppo" / "metrics.jsonl")
    train = [r for r in records if "reward/mean" in r]
    assert len(train) == 2
    for r in train:
        assert math.isfinite(r["critic/grad_norm"]) and r["critic/grad_norm"] > 0
        assert "actor/kl_loss" in r and "time/values_s" in r and "time/ref_s" in r
    assert 0.0 <= summary["accuracy_after"] <= 1.0
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(tmp_path / "ppo" / "hf")


@pytest.mark.multiproc
def test_smoke_preset_on_megatron_matches_fsdp(ray_session, tmp_path):
    """`actor.engine=megatron`, nothing else changed: the first step's rollout is the same
    (same initial weights and seeds) and the update agrees with FSDP's to parity tolerance."""
    first = {}
    for engine in ("fsdp", "megatron"):
        run(_smoke(tmp_path, f"actor.engine={engine}", "trainer.steps=1",
                   f"trainer.run_dir={tmp_path / engine}"))
        (first[engine],) = read_jsonl(tmp_path / engine / "metrics.jsonl")
    fsdp, mega = first["fsdp"], first["megatron"]
    assert fsdp["actor/grad_norm"] > 0
    for key in ("reward/mean", "response/length_mean", "perf/trained_tokens"):
        assert fsdp[key] == mega[key], key
    for key, tol in (("actor/pg_loss", 1e-5), ("actor/entropy", 1e-5), ("actor/grad_norm", 1e-4)):
        assert abs(fsdp[key] - mega[key]) <= tol, (key, fsdp[key], mega[key])


@pytest.mark.multiproc
def test_reward_failing_everywhere_is_one_clear_error(ray_session, tmp_path):
    bad = tmp_path / "bad_reward.py"
    bad.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                   "    raise ValueError('no answer key')\n")
    cfg = parse_config(["-p", "smoke", f"reward.custom_function_path={bad}",
                        f"trainer.run_dir={tmp_path / 'bad'}"])
    with pytest.raises(RewardFailure, match=r"failed on all 8 samples.*ValueError: no answer key"):
        run(cfg)


def test_config_and_input_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown config key 'algorithm.adv_estimater'; did you mean 'algorithm.adv_estimator'"):
        parse_config(["algorithm.adv_estimater=grpo"])
    with pytest.raises(ConfigError, match=r"2 x 4 / 1 = 8 samples, which batch.mini_batches=3 does not divide"):
        parse_config(["-p", "smoke", "batch.mini_batches=3"])
    with pytest.raises(ConfigError, match=r"prompts_per_step=3 must be a multiple of the data-parallel size 2"):
        parse_config(["batch.prompts_per_step=3", "resources.world_size=2"])
    with pytest.raises(ConfigError, match=r"96 \+ 8 = 104 tokens, more than actor.micro_batch.max_tokens_per_microbatch=100"):
        parse_config(["-p", "smoke", "actor.micro_batch.max_tokens_per_microbatch=100"])
    with pytest.raises(ConfigError, match=r"model.path='/nonexistent/model': folder does not exist"):
        run(parse_config(["-p", "smoke", "model.path=/nonexistent/model"]))
    rows = {"prompt": [[{"role": "user", "content": "2+2?"}]] * 3, "data_source": ["gsm8k"] * 3,
            "reward_model": [{"ground_truth": "4"}, {"ground_truth": "4"}, {"style": "rule"}]}
    pq.write_table(pa.table(rows), tmp_path / "train.parquet")
    from tephra.controller.data import DatasetError

    with pytest.raises(DatasetError, match=r"row 2 of train.parquet: field 'reward_model.ground_truth' is missing"):
        run(parse_config(["-p", "smoke", "data.source=parquet",
                          f"data.train_files=[{tmp_path / 'train.parquet'}]"]))
