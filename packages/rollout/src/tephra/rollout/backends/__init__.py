"""The built-in rollout backends (listed by name in `tephra.rollout.registry`)."""

from tephra.rollout.backends.hf import HFRollout
from tephra.rollout.backends.sglang import SglangProtocol, SglangRollout
from tephra.rollout.backends.vllm import VllmProtocol, VllmRollout, default_vllm_python

__all__ = [
    "HFRollout",
    "SglangProtocol",
    "SglangRollout",
    "VllmProtocol",
    "VllmRollout",
    "default_vllm_python",
]
