"""The parts of one RL step, by stage: rounds, scoring, advantages, batch order, metrics."""
