"""`uv run apps/eval [overrides]` runs the evaluation app (tephra.apps.eval.main)."""

from tephra.apps.eval.main import main

main()
