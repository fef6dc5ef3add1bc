"""`uv run apps/sft [overrides]` runs supervised fine-tuning (tephra.apps.sft.main)."""

from tephra.apps.sft.main import main

main()
