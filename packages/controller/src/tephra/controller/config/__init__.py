"""The RL trainer's typed config tree."""
