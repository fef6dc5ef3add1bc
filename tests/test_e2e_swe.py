"""The SWE preset through apps/ppo: two GRPO steps of the tiny model in the `swe`
environment, each trained sample scored with its task's hand-computed share of passing tests
(a random model changes no file), validation's pass@k, and no repository copy left behind."""

from __future__ import annotations

import pytest

from tephra.controller.launch.testing import run_and_read
from tephra.core.errors import ConfigError
from tephra.episodes.environments.swe import TASKS, TRAIN


def _task_of(prompt: str):
    found = [t for t in TASKS if f"Issue: {t.issue}\n" in prompt]
    assert len(found) == 1, prompt[-300:]
    return found[0]


@pytest.mark.multiproc
def test_swe_preset_trains_two_steps(tmp_path):
    from tephra.apps.ppo.main import parse_config, run
    from tephra.controller.run.trackers import read_jsonl

    work = tmp_path / "work"
    work.mkdir()
    cfg = parse_config(
        [
            "-p",
            "swe",
            "model.path=tiny",
            "data.max_prompt_tokens=1024",
            "data.val_size=2",
            "rollout.dtype=float32",
            "rollout.max_tokens=16",
            "rollout.agent.max_response_tokens=64",
            f"rollout.agent.environment_kwargs={{workdir_root: {work}}}",
            "batch.prompts_per_step=2",
            "batch.samples_per_prompt=2",
            "trainer.steps=2",
            "trainer.val_before=false",
            "trainer.val={n: 2, temperature: 1.0, ks: [1, 2]}",
            "trainer.progress_bar=false",
            "trainer.trackers=[jsonl]",
            "trainer.dump_generations=1",
            "resources.cpus_per_rank=1",
            f"trainer.run_dir={tmp_path / 'run'}",
        ]
    )
    summary, trained = run_and_read(run, cfg)
    train_tasks = {t.name for t in TASKS[:TRAIN]}
    for r, rows in trained:
        assert len(rows) == 4
        tasks = [_task_of(row["prompt"]) for row in rows]
        assert {t.name for t in tasks} <= train_tasks
        expected = [t.noop_score for t in tasks]  # (tests - failing) / tests, from the data
        assert [row["score"] for row in rows] == pytest.approx(expected)
        assert r["reward/mean"] == pytest.approx(sum(expected) / 4)
    # validation after training: the first two held-out tasks, 2 samples each, none solved
    records = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    val = [r for r in records if "val/pass@1" in r][-1]
    held_out = TASKS[TRAIN : TRAIN + 2]
    assert val["val/pass@1"] == 0.0 and val["val/pass@2"] == 0.0
    assert val["val/mean@2"] == pytest.approx(sum(t.noop_score for t in held_out) / 2)
    # every trajectory's repository was removed when its episode ended
    assert not [p.name for p in work.iterdir() if p.name.startswith("tephra-sandbox-")]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["-p", "swe", "data.swe_tasks=[clamp, clmap]"],
            r"data.swe_tasks='clmap' is not a shipped SWE task; choose from \['clamp'",
        ),
        (
            ["-p", "swe", "rollout.agent.environment=answer_check"],
            r"data.source='swe_tasks' needs rollout.agent_loop=environment and "
            r"rollout.agent.environment=swe \(got 'environment' and 'answer_check'\)",
        ),
        (
            ["-p", "swe", "rollout.agent.environment_kwargs={test_timeout: 3}"],
            r"rollout.agent.environment_kwargs has \['test_timeout'\], which the `swe` "
            r"environment does not take",
        ),
    ],
)
def test_bad_swe_config_is_refused_at_load(args, message):
    from tephra.apps.ppo.main import parse_config

    with pytest.raises(ConfigError, match=message):
        parse_config(args)
