"""Entry points: building a run from its config (ppo), preflight checks, export."""
