"""tephra.apps.ppo: the RL trainer app."""
