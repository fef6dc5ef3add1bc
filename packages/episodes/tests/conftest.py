"""Fixtures of the episodes tests: one tiny model per session, the vLLM environment on demand
(shared with the other packages' tests through tephra.rollout.fixtures)."""

from tephra.rollout.fixtures import tiny_model, tiny_tied_model, vllm_python

__all__ = ["tiny_model", "tiny_tied_model", "vllm_python"]
