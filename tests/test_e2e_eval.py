"""The evaluation app end to end: its numbers agree with the generations it wrote, and a
trainer run's checkpoints are exported, evaluated and plotted."""

from __future__ import annotations

import json

import pytest

from tephra.apps.eval.config import parse_config
from tephra.apps.eval.main import run
from tephra.controller.evaluation import pass_at_k


def test_smoke_preset_metrics_match_the_generations(tmp_path):
    results = run(parse_config(["-p", "smoke", f"out_dir={tmp_path}"]))
    summary = results["tiny"]["summary"]["all"]
    rows = [json.loads(x) for x in (tmp_path / "generations_tiny.jsonl").read_text().splitlines()]
    assert len(rows) == 8 * 4 and summary["prompts"] == 8
    # recompute from the dump: acc@4 and pass@2 per prompt, averaged
    by_prompt = {}
    for r in rows:
        by_prompt.setdefault(r["prompt_index"], []).append(r["score"] >= 1.0)
    acc = sum(sum(c) / 4 for c in by_prompt.values()) / 8
    p2 = sum(pass_at_k(4, sum(c), 2) for c in by_prompt.values()) / 8
    assert summary["acc@4"] == pytest.approx(acc) and summary["pass@2"] == pytest.approx(p2)
    saved = json.loads((tmp_path / "eval.json").read_text())
    assert saved["tiny"]["summary"]["all"] == summary
    assert "| all | 8 |" in (tmp_path / "eval.md").read_text()


@pytest.mark.multiproc
def test_a_runs_checkpoints_are_evaluated_and_plotted(tmp_path):
    import ray

    from tephra.apps.ppo.main import parse_config as ppo_config
    from tephra.apps.ppo.main import run as train

    train(ppo_config(["-p", "smoke", "trainer.save_every=1", "trainer.keep_checkpoints=2",
                      f"trainer.run_dir={tmp_path / 'run'}"]))
    ray.shutdown()
    results = run(parse_config(["-p", "smoke", f"run_dir={tmp_path / 'run'}",
                                f"out_dir={tmp_path / 'eval'}"]))
    assert list(results) == ["step_1", "step_2", "hf"]
    assert [r["step"] for r in results.values()] == [1, 2, None]
    assert (tmp_path / "eval" / "curves.png").stat().st_size > 0
    assert (tmp_path / "eval" / "exports" / "step_2" / "config.json").exists()
    # the last checkpoint is the final weights: same samples, same numbers as the export
    assert results["step_2"]["summary"] == results["hf"]["summary"]
