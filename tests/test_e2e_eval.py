"""The evaluation app end to end: its numbers agree with the generations it wrote, and a
trainer run's checkpoints are exported, evaluated and plotted."""

from __future__ import annotations

import io
import json
import os

import pytest

from tephra.apps.eval.config import parse_config
from tephra.apps.eval.main import curves_figure, models_to_evaluate, plot_across, run
from tephra.controller.run.evaluation import pass_at_k
from tephra.core.errors import ConfigError


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

    train(
        ppo_config(
            [
                "-p",
                "smoke",
                "trainer.save_every=1",
                "trainer.keep_checkpoints=2",
                f"trainer.run_dir={tmp_path / 'run'}",
            ]
        )
    )
    ray.shutdown()
    results = run(
        parse_config(["-p", "smoke", f"run_dir={tmp_path / 'run'}", f"out_dir={tmp_path / 'eval'}"])
    )
    assert list(results) == ["step_0", "step_1", "step_2", "hf"]
    assert [r["step"] for r in results.values()] == [0, 1, 2, None]
    # step 0 is the model the run started from: the same numbers as evaluating it directly
    direct = run(parse_config(["-p", "smoke", f"out_dir={tmp_path / 'direct'}"]))
    assert results["step_0"]["summary"] == direct["tiny"]["summary"]
    # the plot: acc@4 and pass@4 (the largest k) through the checkpoints' saved numbers, the
    # export's as dashed lines; the PNG on disk is that figure drawn from eval.json
    saved = json.loads((tmp_path / "eval" / "eval.json").read_text())
    assert saved == json.loads(json.dumps(results, default=str))
    title = "run: 8 held-out prompts, 4 samples each at temperature 1"
    _assert_curves(saved, ["acc@4", "pass@4"], title, tmp_path / "eval" / "curves.png")
    assert (tmp_path / "eval" / "exports" / "step_2" / "config.json").exists()
    # the last checkpoint is the final weights: same samples, same numbers as the export
    assert results["step_2"]["summary"] == results["hf"]["summary"]


def test_a_runs_start_model_is_step_0_and_read_from_its_config(tmp_path):
    from tephra.controller.run.models import resolve_model_path

    run_dir = tmp_path / "run"
    (run_dir / "hf").mkdir(parents=True)
    (run_dir / "hf" / "config.json").write_text("{}")
    args = ["-p", "smoke", f"run_dir={run_dir}"]
    with pytest.raises(ConfigError, match="config.yaml is missing.*start_model=false"):
        models_to_evaluate(parse_config(args), tmp_path)
    (run_dir / "config.yaml").write_text("model:\n  path: tiny\ntrainer:\n  seed: 3\n")
    found = models_to_evaluate(parse_config(args), tmp_path)
    assert found == [
        ("step_0", resolve_model_path("tiny", 3), 0),
        ("hf", str(run_dir / "hf"), None),
    ]
    only = models_to_evaluate(parse_config(args + ["start_model=false"]), tmp_path)
    assert [label for label, _, _ in only] == ["hf"]


def _assert_curves(results, metrics, title, png):
    """The curves drawn from `results` hold their numbers, written out here (checkpoints in
    step order, the export `hf` a horizontal line), and `png` is that figure's PNG."""
    fig = curves_figure(results, metrics, title)
    (ax,) = fig.axes
    points = sorted(
        (r["step"], r["summary"]["all"]) for r in results.values() if r["step"] is not None
    )
    lines = ax.get_lines()
    assert len(lines) == 2 * len(metrics)  # a curve and the export's line per metric
    for i, metric in enumerate(metrics):
        curve, final = lines[2 * i], lines[2 * i + 1]
        assert list(curve.get_xdata()) == [step for step, _ in points]
        assert list(curve.get_ydata()) == [summary[metric] for _, summary in points]
        assert list(final.get_ydata()) == [results["hf"]["summary"]["all"][metric]] * 2
        assert curve.get_color() == final.get_color() == f"C{i}"
        assert curve.get_label() == f"{metric}, checkpoints"
    assert ax.get_title() == title
    assert [t.get_text() for t in ax.texts] == [
        f"{summary[m]:.3f}" for m in metrics for _, summary in points
    ]
    drawn = io.BytesIO()
    fig.savefig(drawn, dpi=100)
    assert png.read_bytes() == drawn.getvalue()


def test_the_plot_is_drawn_from_saved_results(tmp_path):
    def entry(step, acc):
        return {"step": step, "summary": {"all": {"acc@4": acc, "pass@4": acc + 0.1}}}

    results = {"step_9": entry(9, 0.5), "step_0": entry(0, 0.2), "hf": entry(None, 0.4)}
    path = plot_across(results, tmp_path, ["acc@4", "pass@4"], "a run")
    assert path == tmp_path / "curves.png" and path.read_bytes()[:4] == b"\x89PNG"
    _assert_curves(results, ["acc@4", "pass@4"], "a run", path)
    # by hand: step 0 then step 9, the export's line at its own value
    (ax,) = curves_figure(results, ["acc@4", "pass@4"]).axes
    acc, acc_hf, pass4, pass4_hf = ax.get_lines()
    assert list(acc.get_xdata()) == [0, 9] and list(acc.get_ydata()) == [0.2, 0.5]
    assert list(pass4.get_ydata()) == [pytest.approx(0.3), pytest.approx(0.6)]
    assert list(acc_hf.get_ydata()) == [0.4, 0.4] and acc_hf.get_linestyle() == "--"
    assert list(pass4_hf.get_ydata()) == [pytest.approx(0.5)] * 2


def test_a_second_evaluation_keeps_numbers_of_unchanged_models_only(tmp_path, monkeypatch):
    import shutil

    import tephra.apps.eval.main as app
    from tephra.controller.run.models import resolve_model_path

    model = tmp_path / "m"  # a copy: its files are touched below
    shutil.copytree(resolve_model_path("tiny"), model)
    args = ["-p", "smoke", f"model.path={model}", f"out_dir={tmp_path / 'eval'}"]
    first = run(parse_config(args))
    calls = []
    real = app.evaluate_model
    monkeypatch.setattr(
        app, "evaluate_model", lambda cfg, path: calls.append(path) or real(cfg, path)
    )
    assert run(parse_config(args)) == first and calls == []
    changed = run(parse_config(args + ["seed=1"]))  # another setting: evaluated again
    assert len(calls) == 1 and changed["m"]["settings"]["seed"] == 1
    again = run(parse_config(args + ["seed=1", "reuse=false"]))
    assert again["m"]["summary"] == changed["m"]["summary"] and len(calls) == 2
    # the same settings but the model's files rewritten: evaluated again
    config = model / "config.json"
    os.utime(config, ns=(config.stat().st_atime_ns, config.stat().st_mtime_ns + 1))
    run(parse_config(args + ["seed=1"]))
    assert len(calls) == 3
