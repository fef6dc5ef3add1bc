"""`uv run apps/eval [--preset NAME] [key=value ...]`: evaluate a model, or a run's checkpoints.

With no arguments: the bundled SmolLM2-135M-Instruct (the demo's starting point) on the demo's
200 held-out reasoning-gym items, 4 samples each. Generation runs in this process on the
configured rollout backend; scores come from the same scorers as training; the metrics are
`tephra.controller.run.evaluation`'s (the trainer's validation uses the same code).
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, cast

import yaml
from matplotlib.figure import Figure
from transformers import AutoTokenizer

from tephra.apps.eval.cli import HELP
from tephra.apps.eval.config import EvalConfig, parse_config
from tephra.controller.data.code_problems import code_problem_records
from tephra.controller.data.prompts import (
    load_hf_dataset,
    load_parquet,
    reasoning_gym_records,
    tokenize_prompts,
)
from tephra.controller.data.swe_tasks import swe_task_records
from tephra.controller.launch.export import export_checkpoint
from tephra.controller.launch.ppo import config_to_save, resolve_tools_file
from tephra.controller.run.checkpoints import CheckpointManager
from tephra.controller.run.evaluation import EvalRow, markdown_table, summarise, write_jsonl
from tephra.controller.run.models import resolve_model_path
from tephra.controller.step.scoring import Scorer
from tephra.core.app_help import app_main
from tephra.core.errors import ConfigError
from tephra.episodes.agent import ChatTemplateDelta
from tephra.episodes.episode import run_episodes, run_to_completion
from tephra.episodes.prompt import Prompt
from tephra.episodes.registry import EPISODES
from tephra.episodes.tools import close_tools, load_tools
from tephra.rollout.base import RolloutConfig, SamplingParams
from tephra.rollout.registry import get_rollout


def models_to_evaluate(cfg: EvalConfig, out: Path) -> list[tuple[str, str, int | None]]:
    """(label, HF folder, step) of each model: `model.path`, or a run's starting model (step 0,
    with `start_model`), its checkpoints (exported to `out/exports/step_<N>`) and its final
    `hf/` export."""

    if cfg.run_dir is None:
        # validated: model.path is set when run_dir is not
        model = cast(str, cfg.model.path)
        return [(Path(model).name, resolve_model_path(model, cfg.seed), None)]

    run = Path(cfg.run_dir).expanduser().resolve()
    if not run.is_dir():
        raise ConfigError(f"run_dir={cfg.run_dir!r} is not a folder; give a trainer run folder")
    found: list[tuple[str, str, int | None]] = []
    if cfg.start_model:
        found.append(("step_0", start_model_path(run), 0))
    for step, folder in sorted(CheckpointManager(run / "checkpoints").committed()):
        target = out / "exports" / f"step_{step}"
        if not (target / "config.json").exists():
            export_checkpoint(folder, target)
        found.append((f"step_{step}", str(target), step))
    if (run / "hf" / "config.json").exists():
        found.append(("hf", str(run / "hf"), None))
    if len(found) == int(cfg.start_model):
        raise ConfigError(
            f"run_dir={cfg.run_dir!r} holds neither checkpoints/ nor hf/; train "
            "with trainer.save_every or trainer.export_hf"
        )
    return found


def start_model_path(run: Path) -> str:
    """The HF folder a trainer run started from: its config.yaml's `model.path`, resolved as
    the trainer resolved it (`tiny` is built from `trainer.seed`)."""

    config_file = run / "config.yaml"
    if not config_file.exists():
        raise ConfigError(
            f"{config_file} is missing: the run's config names the model it "
            "started from; set start_model=false to evaluate the checkpoints only"
        )
    saved = yaml.safe_load(config_file.read_text()) or {}
    path = (saved.get("model") or {}).get("path")
    if not path:
        raise ConfigError(
            f"{config_file} has no model.path; set start_model=false to evaluate "
            "the checkpoints only"
        )
    return resolve_model_path(path, (saved.get("trainer") or {}).get("seed", 0))


def evaluate_model(
    cfg: EvalConfig, model_path: str
) -> tuple[dict[str, dict[str, float]], list[EvalRow]]:
    """(summary, rows) of one model on the held-out prompts."""

    tok: Any = AutoTokenizer.from_pretrained(model_path)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    d = cfg.data
    if d.source == "reasoning_gym":
        records = reasoning_gym_records(
            d.task, d.val_size, d.val_seed, d.task_config, d.instruction
        )
    elif d.source == "code_problems":
        records = code_problem_records("val", d.val_size)
    elif d.source == "swe_tasks":
        records = swe_task_records("val", d.val_size)
    else:
        if not d.val_files:
            raise ConfigError(f"data.source={d.source!r}: set data.val_files to evaluate on")

        records = [
            r
            for f in d.val_files
            for r in (
                load_parquet(f)
                if d.source == "parquet"
                else load_hf_dataset(f.partition(":")[0], f.partition(":")[2] or "train")
            )
        ]
    r, v = cfg.rollout, cfg.val
    tools = load_tools(resolve_tools_file(r.tools_file)) if r.agent_loop and r.tools_file else {}
    render = None
    if r.agent_loop:  # the prompt as the episode renders it (with the tools' schemas)
        schemas = [t.schema() for t in tools.values()] if r.agent.render_tool_schemas else []
        render = ChatTemplateDelta(tok, schemas or None).prompt_ids
    ids, records, dropped = tokenize_prompts(records, tok, d.max_prompt_tokens, render)
    if dropped:
        print(f"dropped {dropped} prompts longer than data.max_prompt_tokens", flush=True)
    if not ids:
        raise ConfigError("no held-out prompt left to evaluate")
    stops = tuple(t for t in {tok.eos_token_id} if t is not None)
    sampling = SamplingParams(
        n=v.n,
        temperature=v.temperature,
        top_p=v.top_p,
        max_tokens=r.max_tokens,
        stop_token_ids=stops,
        seed=cfg.seed,
        logprobs=False,
    )
    config = RolloutConfig(
        model_path=model_path,
        dtype=r.dtype,
        max_model_len=d.max_prompt_tokens + r.response_budget + 8,
        seed=cfg.seed,
        hf=r.hf,
        vllm=r.vllm,
        sglang=r.sglang,
    )
    try:
        with get_rollout(r.backend, config) as rollout:
            if r.agent_loop:
                texts, recs, prompt_index, env_scores = run_agent_episodes(
                    cfg, tok, tools, rollout, ids, records, sampling
                )
                prompt_ids = [ids[i] for i in prompt_index]
            else:
                out = rollout.generate(ids, sampling)
                texts = [tok.decode(resp, skip_special_tokens=True) for resp in out.response_ids]
                prompt_index = [out.prompt_index[k] for k in range(len(out))]
                recs = [records[i] for i in prompt_index]
                prompt_ids = [out.prompt_ids[k] for k in range(len(out))]
                env_scores = [None] * len(out)
    finally:
        close_tools(tools.values())
    todo = [k for k, s in enumerate(env_scores) if s is None]
    scored = Scorer(cfg.reward).score([texts[k] for k in todo], [recs[k] for k in todo])
    scores = [float(s) if s is not None else 0.0 for s in env_scores]
    for k, result in zip(todo, scored):
        scores[k] = result.score
    rows = [
        EvalRow(
            prompt=tok.decode(prompt_ids[k], skip_special_tokens=True),
            response=texts[k],
            score=scores[k],
            ground_truth=recs[k].ground_truth,
            data_source=recs[k].data_source,
            answer=texts[k].strip(),
            prompt_index=prompt_index[k],
        )
        for k in range(len(texts))
    ]
    return summarise(rows, v.n, v.ks), rows


def run_agent_episodes(
    cfg: EvalConfig,
    tok: Any,
    tools: dict,
    rollout: Any,
    ids: list[list[int]],
    records: list[Prompt],
    sampling: SamplingParams,
) -> tuple[list[str], list[Prompt], list[int], list[float | None]]:
    """`val.n` episodes of `rollout.agent_loop` per prompt, as the trainer's validation runs
    them: (each sample's final text, its prompt, the prompt's index, the environment's
    reward or None where the reward scorer judges the text)."""
    r = cfg.rollout
    episode = EPISODES.get(cast(str, r.agent_loop))(tok, r.agent, tools)
    items = [
        replace(
            records[i],
            sample_id=f"eval{i}-{k}",
            prompt_ids=list(ids[i]),
            messages=list(records[i].messages),
            interaction_kwargs=dict(records[i].interaction_kwargs),
        )
        for i in range(len(ids))
        for k in range(sampling.n)
    ]
    samples = run_to_completion(
        run_episodes(episode, rollout, items, sampling.replace(n=1), r.max_in_flight)
    )
    index = [i for i in range(len(ids)) for _ in range(sampling.n)]
    return (
        [s.text for s in samples],
        [records[i] for i in index],
        index,
        [s.env_reward for s in samples],
    )


def plot_across(results: dict, out: Path, metrics: list[str], title: str = "") -> Path:
    """Each of `metrics` against the checkpoints' steps (step 0: the start model), the final
    export drawn as a horizontal line per metric (`curves_figure`); written to
    `out/curves.png`. `results` is what `run` returns (or its `eval.json`), so a plot can be
    redrawn without evaluating."""
    path = out / "curves.png"
    curves_figure(results, metrics, title).savefig(path, dpi=100)
    return path


def curves_figure(results: dict, metrics: list[str], title: str = "") -> Figure:
    """The figure `plot_across` saves: per metric (colour C0, C1, ... in order) one line
    through (step, value) of each checkpoint, then, where `results` has the final export
    `hf`, a dashed horizontal line at its value."""
    points = sorted(
        (r["step"], r["summary"]["all"]) for r in results.values() if r["step"] is not None
    )
    fig = Figure(figsize=(6, 4))  # no pyplot: no GUI backend, no global figure state
    ax = fig.subplots()
    for i, metric in enumerate(metrics):
        color = f"C{i}"
        if points:
            steps = [s for s, _ in points]
            values = [summary[metric] for _, summary in points]
            ax.plot(steps, values, marker="o", c=color, label=f"{metric}, checkpoints")
            for x, y in zip(steps, values):
                ax.annotate(
                    f"{y:.3f}",
                    (x, y),
                    textcoords="offset points",
                    xytext=(0, 6),
                    ha="center",
                    fontsize=8,
                    color=color,
                )
            ax.set_xticks(steps)
        if "hf" in results:
            ax.axhline(
                results["hf"]["summary"]["all"][metric],
                ls="--",
                c=color,
                alpha=0.5,
                label=f"{metric}, final export (hf/)",
            )
    ax.set_xlabel("RL step (0: the model before training)")
    ax.set_ylabel("score on the held-out prompts")
    ax.set_ylim(0, 1.08)  # room for the value labels above 1.0
    ax.set_yticks([0, 0.2, 0.4, 0.6, 0.8, 1.0])
    ax.grid(alpha=0.3)
    if title:
        ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    return fig


def curve_metrics(cfg: EvalConfig) -> list[str]:
    """acc@n (mean share of correct samples) and pass@k at the largest k."""
    ks = [k for k in cfg.val.ks if k <= cfg.val.n]
    return [f"acc@{cfg.val.n}"] + ([f"pass@{max(ks)}"] if ks else [])


def folder_fingerprint(folder: str) -> str:
    """sha256 of the (name, size, modification time) of every file under `folder`: a model
    folder rewritten in place (a new export, a retrained run) gets another fingerprint."""
    h = hashlib.sha256()
    for f in sorted(Path(folder).rglob("*")):
        if f.is_file():
            st = f.stat()
            h.update(f"{f.relative_to(folder)}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def eval_settings(cfg: EvalConfig) -> dict:
    """What a model's numbers depend on besides its weights (compared before reusing them)."""

    return json.loads(
        json.dumps(
            {
                "data": asdict(cfg.data),
                "rollout": asdict(cfg.rollout),
                "val": asdict(cfg.val),
                "reward": asdict(cfg.reward),
                "seed": cfg.seed,
            },
            default=str,
        )
    )


def run(cfg: EvalConfig) -> dict:
    out = Path(cfg.out_dir).expanduser().resolve()
    out.mkdir(parents=True, exist_ok=True)
    saved = out / "eval.json"
    previous = json.loads(saved.read_text()) if cfg.reuse and saved.exists() else {}
    settings = eval_settings(cfg)
    results = {}
    tables = []
    for label, path, step in models_to_evaluate(cfg, out):
        fingerprint = folder_fingerprint(path)
        old = previous.get(label, {})
        if (
            old.get("model") == path
            and old.get("step") == step
            and old.get("fingerprint") == fingerprint
            and old.get("settings") == settings
        ):
            results[label] = old
            print(f"## {label}: kept from {saved} (same model files and settings)", flush=True)
        else:
            t = time.perf_counter()
            summary, rows = evaluate_model(cfg, path)
            write_jsonl(rows, out / f"generations_{label}.jsonl")
            results[label] = {
                "model": path,
                "step": step,
                "summary": summary,
                "seconds": round(time.perf_counter() - t, 1),
                "fingerprint": fingerprint,
                "settings": settings,
            }
            print(
                f"## {label} ({results[label]['seconds']} s)\n{markdown_table(summary)}", flush=True
            )
        tables.append(f"## {label}\n\n{markdown_table(results[label]['summary'])}")
        # written after every model, so a stopped evaluation keeps what it finished
        saved.write_text(json.dumps(results, indent=1, default=str))
    (out / "eval.md").write_text("\n".join(tables))
    if cfg.run_dir is not None:
        prompts = next(iter(results.values()))["summary"]["all"]["prompts"]
        plot_across(
            results,
            out,
            curve_metrics(cfg),
            f"{Path(cfg.run_dir).name}: {int(prompts)} held-out prompts, {cfg.val.n} samples "
            f"each at temperature {cfg.val.temperature:g}",
        )
    return results


def main(argv: list[str] | None = None) -> None:
    app_main(
        sys.argv[1:] if argv is None else argv,
        HELP,
        parse_config,
        config_to_save,
        run,
        lambda results: {label: r["summary"]["all"] for label, r in results.items()},
    )


if __name__ == "__main__":
    main()
