"""On-policy distillation: per-token reverse KL to a teacher on the student's own samples.

The student pi samples y; a teacher q (same tokenizer) scores the same tokens. The reverse
KL KL(pi || q) = E_pi[log pi(y_t) - log q(y_t)] is estimated per sampled token, and used
either as the advantage (the student is pushed towards tokens the teacher finds likely,
"on-policy distillation" of Agarwal et al. 2024, "On-Policy Distillation of Language
Models: Learning from Self-Generated Mistakes"; Lu & Thinking Machines 2025) or as a loss
term beside the RL objective (`ActorObjectiveConfig.distill_loss_coef`).
"""

from __future__ import annotations

import torch

from tephra.algos.errors import InputError
from tephra.algos.inputs import check_same_shape
from tephra.algos.masked import masked_mean
from tephra.algos.recipe_config import DistillationConfig


def distillation_advantages(
    student_log_probs: torch.Tensor,
    teacher_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    coef: float = 1.0,
) -> torch.Tensor:
    """Per-token distillation advantage [batch, seq], the negative reverse-KL estimate
        A_t = coef * (log q(y_t) - log pi_old(y_t))    on response tokens, 0 elsewhere
    with pi_old the sampling (student) policy's log-probs and q the teacher's, both on the
    sampled tokens. No discounting, no baseline: each token is its own one-step return, as
    the on-policy distillation recipes do. Computed without a graph."""
    check_same_shape(
        student_log_probs=student_log_probs,
        teacher_log_probs=teacher_log_probs,
        response_mask=response_mask,
    )
    if coef < 0:
        raise InputError(f"distillation coef={coef!r} must be >= 0")
    with torch.no_grad():
        diff = teacher_log_probs.to(student_log_probs.dtype) - student_log_probs
        return torch.where(response_mask > 0, coef * diff, torch.zeros_like(diff))


def add_distillation_advantages(
    advantages: torch.Tensor,
    old_log_probs: torch.Tensor,
    teacher_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    section: DistillationConfig,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The step's advantages with the teacher's term, [batch, seq]:
        A'_t = A_t (0 where `rl_advantage` is false) + advantage_coef * (log q(y_t) - log pi_old(y_t))
    on response tokens; and `distill/reverse_kl`, the masked mean of log pi_old - log q."""
    distill = distillation_advantages(
        old_log_probs, teacher_log_probs, response_mask, section.advantage_coef
    )
    base = advantages if section.rl_advantage else torch.zeros_like(advantages)
    rkl = masked_mean((old_log_probs - teacher_log_probs).float(), response_mask)
    return (base + distill.to(advantages.dtype)), {"distill/reverse_kl": float(rkl)}
