"""`uv run apps/ppo [overrides]` runs tephra.apps.ppo.cli (`--help` first, then the app)."""

from tephra.apps.ppo.cli import main

main()
