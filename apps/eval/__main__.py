"""`uv run apps/eval [overrides]` runs tephra.apps.eval.cli (`--help` first, then the app)."""

from tephra.apps.eval.cli import main

main()
