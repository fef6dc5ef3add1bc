"""The rank side: the RL worker, generation and the rollout replica workers."""
