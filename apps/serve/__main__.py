"""`uv run apps/serve [options]` runs tephra.apps.serve.cli (`--help` lists the options)."""

from tephra.apps.serve.cli import main

main()
