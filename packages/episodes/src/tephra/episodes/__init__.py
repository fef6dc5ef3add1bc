"""tephra.episodes: what runs over a rollout to make training samples (agent loops, tools, rewards)."""
