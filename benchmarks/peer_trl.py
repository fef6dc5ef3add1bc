"""RL step time of tephra vs TRL's GRPOTrainer on the identical workload, side by side.

    uv sync --all-packages --group bench                 # TRL lives in the `bench` group only
    uv run python benchmarks/peer_trl.py                 # 2 runs each -> results/peer_trl.json
    uv run python benchmarks/peer_trl.py --quick         # 1 run each, 2 steps, prints only

Workload (the `uv run apps/ppo` demo): SmolLM2-135M-Instruct (the folder converted by
`tephra.controller.data.smollm2.smollm2_folder()`), reasoning-gym basic_arithmetic, 4 prompts x 8
samples x at most 32 new tokens per step, temperature 1, AdamW lr 3e-5 (no weight decay,
grad clip 1, constant schedule), clip 0.2, no reference model / KL (beta 0), one optimizer
step per RL step, per-sequence-then-token mean loss (TRL `loss_type="grpo"`), group-std
normalised advantages, fp32 master weights with compute in the dtype this CPU runs fastest
(tephra's `auto`, timed once per machine: bf16 with bf16 units, fp32 without; TRL gets the same
choice as `bf16=True` autocast or not),
torch on 2 threads. Both see the same prompts in the same order (tephra's `PromptLoader`
order, fed to TRL with `shuffle_dataset=False`) and the same reward (tephra's `Scorer`).

Each run is a fresh process (`--run tephra|trl`); runs alternate tephra, TRL, tephra, TRL so
that the load other processes put on the machine falls on both alike. Per run: the wall time
of every RL step (tephra: `time/step_s`; TRL: `on_step_begin` -> `on_step_end`), the first
step left out of the median as warm-up; per-stage times (tephra: its `time/*_s` metrics;
TRL: generation, reward + old-log-prob bookkeeping (`_generate_and_score_completions` minus
generation) and the rest of the step, i.e. forward/backward/optimizer); and greedy held-out
accuracy after training on the same `--val-size` items (tephra's own validation; for TRL the
same prompts, greedy, 32 tokens, the same scorer). Reported: the median over runs of
`step_time_ratio_trl_over_tephra` (median TRL step / median tephra step) and its spread.

Round r runs both frameworks with seed `--first-seed` + r (default 0): the training
prompts' order and every sampling draw follow it; the model and the held-out items stay. So
the rounds are independent draws of the same comparison. Four steps of 32 samples move
held-out accuracy by a seed-dependent amount (200 items: tephra 0.545 vs TRL 0.630 at seed
0, 0.645 vs 0.500 at seed 1), and only the mean over seeds compares the two learners.
Reported: each round's accuracies, `val_accuracy_mean` per framework, and the differences
paired by seed (`val_accuracy_diff_over_trl`: each round's, their mean and its standard
error). The JSON is rewritten after every round, so a stopped run keeps the rounds it finished,
and `--append --runs K` adds K rounds to the run in the file (the next seeds; refused if the
settings or the machine differ).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "peer_trl.json"
THREADS = 2
SETTINGS = dict(
    prompts_per_step=4,
    samples_per_prompt=8,
    max_tokens=32,
    lr=3e-5,
    temperature=1.0,
    clip=0.2,
    threads=THREADS,
    seed=0,
    task="basic_arithmetic",
)


def tephra_overrides(
    steps: int, val_size: int, run_dir: str, extra: list[str], seed: int = SETTINGS["seed"]
) -> list[str]:
    s = SETTINGS
    return [
        f"trainer.steps={steps}",
        f"data.val_size={val_size}",
        "trainer.val_before=false",
        "trainer.val_after=true",
        "trainer.trackers=[jsonl]",
        "trainer.progress_bar=false",
        "trainer.export_hf=false",
        "trainer.resume=off",
        f"trainer.run_dir={run_dir}",
        f"trainer.seed={seed}",
        f"batch.prompts_per_step={s['prompts_per_step']}",
        f"batch.samples_per_prompt={s['samples_per_prompt']}",
        f"rollout.max_tokens={s['max_tokens']}",
        f"actor.optimizer.lr={s['lr']}",
        f"resources.cpus_per_rank={float(THREADS)}",
        *extra,
    ]


# per-step training signals under one name for both (tephra metric, TRL log key); flat groups
# from TRL's fraction of groups whose rewards have zero std. tephra's entropy is over the rows
# it trained on (flat groups left out), TRL's over every row.
TEPHRA_TRAIN = {
    "reward_mean": "reward/mean",
    "grad_norm": "actor/grad_norm",
    "entropy": "actor/entropy",
    "length_mean": "response/length_mean",
    "truncated_frac": "response/clip_frac",
    "flat_groups": "actor/skipped_flat_groups",
}
TRL_TRAIN = {
    "reward_mean": "reward",
    "grad_norm": "grad_norm",
    "entropy": "entropy",
    "length_mean": "completions/mean_length",
    "truncated_frac": "completions/clipped_ratio",
    "flat_groups": "frac_reward_zero_std",
}


def run_tephra(steps: int, val_size: int, extra: list[str], seed: int) -> dict:
    from tephra.apps.ppo.main import parse_config, run

    with tempfile.TemporaryDirectory(prefix="peer_trl_tephra_") as tmp:
        cfg = parse_config(tephra_overrides(steps, val_size, tmp, extra, seed))
        t0 = time.perf_counter()
        run(cfg)
        total = time.perf_counter() - t0
        records = [
            json.loads(line) for line in (Path(tmp) / "metrics.jsonl").read_text().splitlines()
        ]
    steps_rec = [r for r in records if "time/step_s" in r]
    stages = {
        k: [round(r[k], 3) for r in steps_rec]
        for k in sorted({k for r in steps_rec for k in r})
        if k.startswith("time/") and k.endswith("_s")
    }
    acc = [r["accuracy/val"] for r in records if "accuracy/val" in r]
    extras = {
        k: [r.get(k) for r in steps_rec]
        for k in ("actor/skipped_flat_groups",)
        if any(k in r for r in steps_rec)
    }
    train = {name: [r.get(key) for r in steps_rec] for name, key in TEPHRA_TRAIN.items()}
    return {
        "framework": "tephra",
        "step_s": stages.pop("time/step_s"),
        "stages_s": stages,
        "val_accuracy": acc[-1] if acc else None,
        "process_wall_s": round(total, 1),
        "train": train,
        **extras,
    }


def trl_records(steps: int, val_size: int, seed: int):
    """The training prompts in tephra's order for `steps` steps, and the held-out records."""
    from tephra.apps.ppo.main import parse_config
    from tephra.controller.data.prompts import PromptLoader
    from tephra.controller.launch.ppo import prepare

    with tempfile.TemporaryDirectory() as tmp:
        p = prepare(parse_config(tephra_overrides(steps, val_size, tmp, [], seed)))
    loader = PromptLoader(len(p.train.ids), SETTINGS["prompts_per_step"], seed)
    order = [i for _ in range(steps) for i in loader.next_indices()]
    return p, [p.train.records[i] for i in order], p.val.records


def trl_trainer(model_path: str, train: list, steps: int, seed: int, scorer):
    """TRL's GRPOTrainer on `train` (the records in step order) with the workload's settings;
    and its tokenizer."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from tephra.engine_api.fastest_dtype import fastest_dtype

    rows = {"prompt": [r.messages for r in train], "idx": list(range(len(train)))}

    def reward(completions, idx, **_):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [r.score for r in scorer.score(texts, [train[i] for i in idx])]

    s = SETTINGS
    n = s["samples_per_prompt"]
    args = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="peer_trl_trl_"),
        max_steps=steps,
        use_cpu=True,
        bf16=fastest_dtype("cpu") == "bfloat16",
        per_device_train_batch_size=s["prompts_per_step"] * n,
        gradient_accumulation_steps=1,
        num_generations=n,
        max_completion_length=s["max_tokens"],
        temperature=s["temperature"],
        top_p=1.0,
        top_k=0,
        learning_rate=s["lr"],
        weight_decay=0.0,
        lr_scheduler_type="constant",
        warmup_steps=0,
        max_grad_norm=1.0,
        beta=0.0,
        epsilon=s["clip"],
        num_iterations=1,
        loss_type="grpo",
        scale_rewards="group",
        shuffle_dataset=False,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        seed=seed,
        dataloader_num_workers=0,
        disable_dropout=True,
    )
    tok = AutoTokenizer.from_pretrained(model_path, padding_side="left")
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=args,
        train_dataset=Dataset.from_dict(rows),
        processing_class=tok,
    )
    return trainer, tok


def run_trl(steps: int, val_size: int, seed: int) -> dict:
    import torch
    from transformers import TrainerCallback

    from tephra.controller.step.scoring import Scorer

    torch.set_num_threads(THREADS)
    prepared, train, val = trl_records(steps, val_size, seed)
    scorer = Scorer()
    trainer, tok = trl_trainer(prepared.model_path, train, steps, seed, scorer)

    timings: dict[str, list[float]] = {"step": [], "generate": [], "score": []}
    pending = {"generate": 0.0, "score": 0.0}

    def timed(name: str, fn):
        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            out = fn(*a, **kw)
            pending[name] += time.perf_counter() - t0
            return out

        return wrapper

    # `_generate` is the sampling call; `_generate_and_score_completions` wraps it with the
    # reward, advantages and bookkeeping (no old-log-prob pass: one iteration, on-policy)
    trainer._generate = timed("generate", trainer._generate)
    trainer._generate_and_score_completions = timed(
        "score", trainer._generate_and_score_completions
    )

    class Clock(TrainerCallback):
        def on_step_begin(self, *_, **__):
            self.t0 = time.perf_counter()
            pending.update(generate=0.0, score=0.0)

        def on_step_end(self, *_, **__):
            timings["step"].append(time.perf_counter() - self.t0)
            timings["generate"].append(pending["generate"])
            timings["score"].append(pending["score"] - pending["generate"])

    trainer.add_callback(Clock())
    t0 = time.perf_counter()
    trainer.train()
    total = time.perf_counter() - t0
    step = timings["step"]
    logs = [entry for entry in trainer.state.log_history if "reward" in entry]
    train = {
        name: [float(entry[key]) if key in entry else None for entry in logs]
        for name, key in TRL_TRAIN.items()
    }
    train["flat_groups"] = [
        None if f is None else f * SETTINGS["prompts_per_step"] for f in train["flat_groups"]
    ]
    stages = {
        "time/generate_s": timings["generate"],
        "time/reward_and_advantages_s": timings["score"],
        "time/update_s": [
            st - g - sc for st, g, sc in zip(step, timings["generate"], timings["score"])
        ],
    }
    return {
        "framework": "trl",
        "step_s": [round(x, 3) for x in step],
        "stages_s": {k: [round(x, 3) for x in v] for k, v in stages.items()},
        "val_accuracy": greedy_accuracy(trainer.model, tok, val, scorer),
        "process_wall_s": round(total, 1),
        "train": train,
    }


def greedy_accuracy(model, tok, records, scorer, batch: int = 32) -> float:
    """Greedy held-out accuracy (score >= 1), 32 new tokens, as tephra's validation."""
    import torch

    from tephra.controller.step.scoring import accuracy_of

    model.eval()
    correct = 0
    for i in range(0, len(records), batch):
        chunk = records[i : i + batch]
        texts = [
            tok.apply_chat_template(r.messages, tokenize=False, add_generation_prompt=True)
            for r in chunk
        ]
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=SETTINGS["max_tokens"], do_sample=False)
        answers = tok.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
        correct += sum(accuracy_of(r.score) for r in scorer.score(answers, chunk))
    return correct / len(records)


def machine() -> dict:
    import torch

    from tephra.core.machine import cpu_fields
    from tephra.engine_api.fastest_dtype import fastest_dtype

    cpuinfo = cpu_fields()
    model = cpuinfo.get("model name") or platform.processor()
    family_model = "/".join(cpuinfo[k] for k in ("cpu family", "model") if k in cpuinfo)
    flags = cpuinfo.get("flags", "")
    return {
        "cpu": model,
        "cpu_family_model": family_model,
        "cores": os.cpu_count(),
        "bf16_units": [f for f in ("avx512_bf16", "amx_bf16") if f in flags.split()],
        "compute_dtype": fastest_dtype("cpu"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "load_average_at_start": os.getloadavg(),
    }


def versions() -> dict:
    from importlib.metadata import version

    return {p: version(p) for p in ("trl", "transformers", "torch", "accelerate")}


def entry_settings(entries) -> dict:
    """What each entry runs, as the JSON's settings record it (and --append compares)."""
    return {label: {"framework": fw, "overrides": extra} for label, fw, _, extra in entries}


def summarise(args, entries, runs: list[dict], info: dict) -> dict:
    """The JSON written to --results: settings, machine, every run and the summary figures."""
    by = {label: [r for r in runs if r["label"] == label] for label, *_ in entries}
    done = len(runs) // len(entries)  # finished rounds
    result = {
        "settings": {
            **SETTINGS,
            "steps": args.steps,
            "runs_each": done,
            "rounds_planned": args.rounds_planned,
            "val_size": args.val_size,
            "entries": entry_settings(entries),
            "order": "interleaved, one of each per round; fresh process each",
            "seeds": sorted({r["seed"] for r in runs}),
            "median_over": "steps 2.. of each run",
        },
        "machine": info,
        "versions": versions(),
        "runs": runs,
    }
    for label, rs in by.items():
        result[f"{label}_median_step_s"] = round(
            statistics.median(r["median_step_s"] for r in rs), 3
        )
        result[f"{label}_median_stages_s"] = {
            k: round(statistics.median(r["median_stages_s"][k] for r in rs), 3)
            for k in rs[0]["median_stages_s"]
        }
        result[f"{label}_val_accuracy"] = [r["val_accuracy"] for r in rs]
        result[f"{label}_val_accuracy_mean"] = round(
            statistics.mean(r["val_accuracy"] for r in rs), 4
        )
    if "trl" in by:
        for label in [x for x in by if x.startswith("tephra")]:
            ratios = [t["median_step_s"] / p["median_step_s"] for p, t in zip(by[label], by["trl"])]
            suffix = "" if label == "tephra" else f"_{label.removeprefix('tephra_')}"
            result[f"step_time_ratio_trl_over_tephra{suffix}"] = round(statistics.median(ratios), 2)
            result[f"step_time_ratio_per_round{suffix}"] = [round(r, 2) for r in ratios]
            # paired by seed: each round's accuracy difference, their mean and its standard error
            diffs = [p["val_accuracy"] - t["val_accuracy"] for p, t in zip(by[label], by["trl"])]
            result[f"val_accuracy_diff_over_trl{suffix}"] = {
                "per_round": [round(d, 4) for d in diffs],
                "mean": round(statistics.mean(diffs), 4),
                "standard_error": (
                    round(statistics.stdev(diffs) / len(diffs) ** 0.5, 4)
                    if len(diffs) > 1
                    else None
                ),
            }
    result["noise"] = {
        label: {
            "min_step_s": min(v),
            "max_step_s": max(v),
            "stdev_step_s": round(statistics.pstdev(v), 3),
        }
        for label, v in (
            (label, [s for r in rs for s in r["step_s"][1:]]) for label, rs in by.items()
        )
        if v
    }
    return result


def appended_to(args, entries, info: dict) -> tuple[list[dict], dict]:
    """The runs and machine of an earlier run in --results that --append continues; refused
    when its settings or machine differ (its timings would not compare)."""
    old = json.loads(Path(args.results).read_text())
    s = old["settings"]
    wanted = {"steps": args.steps, "val_size": args.val_size, "entries": entry_settings(entries)}
    differ = [f"{k}: {s[k]} there, {v} here" for k, v in wanted.items() if s[k] != v]
    differ += [
        f"machine {k}: {old['machine'][k]} there, {v} here"
        for k, v in info.items()
        if k in ("cpu", "cores", "bf16_units", "compute_dtype", "cpu_family_model", "torch")
        and k in old["machine"]
        and old["machine"][k] != v
    ]
    if differ:
        raise SystemExit(
            f"--append: {args.results} is another comparison ({'; '.join(differ)}); "
            "pass the same --steps/--val-size/--tephra-args on the same machine, or "
            "start a new file with --results"
        )
    args.first_seed = s["seeds"][0]
    args.rounds_planned = s["runs_each"] + args.runs
    return old["runs"], {**old["machine"], "appended_load_average": os.getloadavg()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 steps, 1 run each, no json")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--runs", type=int, default=2, help="runs of each framework")
    parser.add_argument("--val-size", type=int, default=64)
    parser.add_argument("--only", choices=["tephra", "trl"], help="run one framework only")
    parser.add_argument("--run", choices=["tephra", "trl"], help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=SETTINGS["seed"], help=argparse.SUPPRESS)
    parser.add_argument(
        "--first-seed",
        type=int,
        default=SETTINGS["seed"],
        help="seed of round 0 (round r: this + r), to add rounds to a run",
    )
    parser.add_argument("--tephra-args", default="", help="extra tephra overrides, space-separated")
    parser.add_argument(
        "--variant", default="", help="also run tephra with these overrides (label tephra_variant)"
    )
    parser.add_argument(
        "--base-python",
        default="",
        help="also run tephra from another checkout's interpreter (label "
        "tephra_base), e.g. main's .venv/bin/python",
    )
    parser.add_argument("--results", default=str(RESULTS), help="where the JSON goes")
    parser.add_argument(
        "--append",
        action="store_true",
        help="add --runs rounds to the run in --results (same settings and "
        "machine), seeds following its last",
    )
    args = parser.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.quick:
        args.steps, args.runs, args.val_size = 2, 1, 16
    if args.run:  # child process: one run, result to --out
        result = (
            run_tephra(args.steps, args.val_size, args.tephra_args.split(), args.seed)
            if args.run == "tephra"
            else run_trl(args.steps, args.val_size, args.seed)
        )
        Path(args.out).write_text(json.dumps(result))
        return

    # (label, framework, interpreter, extra tephra overrides): run in this order each round
    entries = [
        ("tephra", "tephra", sys.executable, args.tephra_args),
        ("trl", "trl", sys.executable, ""),
    ]
    if args.only:
        entries = [e for e in entries if e[0] == args.only]
    if args.base_python:  # tephra before this branch's changes: another checkout's venv
        entries.insert(0, ("tephra_base", "tephra", args.base_python, args.tephra_args))
    if args.variant:  # tephra with extra overrides (an ablation / a tuned config)
        entries.insert(-1, ("tephra_variant", "tephra", sys.executable, args.variant))
    runs, info = [], machine()
    args.rounds_planned = args.runs
    if args.append:
        runs, info = appended_to(args, entries, info)
    for i in range(len(runs) // len(entries), args.rounds_planned):
        seed = args.first_seed + i  # one seed per round, the same for every entry
        for label, fw, python, extra in entries:
            with tempfile.NamedTemporaryFile(suffix=".json") as out:
                cmd = [
                    python,
                    __file__,
                    "--run",
                    fw,
                    "--out",
                    out.name,
                    "--steps",
                    str(args.steps),
                    "--val-size",
                    str(args.val_size),
                    "--tephra-args",
                    extra,
                    "--seed",
                    str(seed),
                ]
                env = dict(os.environ, OMP_NUM_THREADS=str(THREADS))
                subprocess.run(cmd, check=True, env=env)
                res = json.loads(Path(out.name).read_text())
            steady = res["step_s"][1:] or res["step_s"]
            res.update(
                label=label,
                overrides=extra,
                run=i,
                seed=seed,
                median_step_s=round(statistics.median(steady), 3),
                median_stages_s={
                    k: round(statistics.median(v[1:] or v), 3) for k, v in res["stages_s"].items()
                },
            )
            print(
                f"{label} run {i} (seed {seed}): median step {res['median_step_s']} s, stages "
                f"{res['median_stages_s']}, val acc {res['val_accuracy']}",
                flush=True,
            )
            runs.append(res)
        result = summarise(args, entries, runs, info)
        if not args.quick and not args.only:  # after every round, so a stopped run keeps its rounds
            Path(args.results).write_text(json.dumps(result, indent=2) + "\n")

    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=2))


if __name__ == "__main__":
    main()
