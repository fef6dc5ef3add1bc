"""tephra.apps.eval: evaluation of models and of a run's checkpoints."""
