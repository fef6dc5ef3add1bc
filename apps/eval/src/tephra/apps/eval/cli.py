"""The `uv run apps/eval` entry point: `--help` is answered from the shipped config index before
the evaluation app is imported (torch, Ray, transformers: seconds)."""

from __future__ import annotations

from pathlib import Path

from tephra.core.app_help import AppHelp, run_app

HERE = Path(__file__).parent

HELP = AppHelp(
    command="uv run apps/eval",
    summary=(
        "Evaluates a model folder, or every checkpoint and the export of a trainer run (run_dir=RUN), on held-out prompts with the scorers training uses: pass@k, maj@k and mean score, written to out_dir as eval.json, eval.md and a plot. With no arguments: the bundled SmolLM2-135M-Instruct on the demo's 200 held-out items, 4 samples each."
    ),
    preset_dir=HERE / "presets",
    index=HERE / "config_index.json",
    title="`uv run apps/eval`: evaluation",
)


def main(argv: list[str] | None = None) -> None:
    run_app(HELP, "tephra.apps.eval.main", argv)
