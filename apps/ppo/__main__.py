"""`uv run apps/ppo [overrides]` runs the PPO/GRPO trainer (tephra.apps.ppo.main)."""

from tephra.apps.ppo.main import main

main()
