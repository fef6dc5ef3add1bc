"""On-policy distillation's teacher in the RL loop: the check that it shares the student's
tokenizer, and the advantage it adds."""

from __future__ import annotations

from typing import Any

import torch

from tephra.algos import distillation_advantages, masked_mean
from tephra.algos.recipe_config import DistillationConfig
from tephra.controller.models import resolve_model_path
from tephra.engine_api.errors import ConfigError


def check_distillation(section: DistillationConfig, distill_loss_coef: float) -> None:
    """The teacher and the ways it is used agree (no teacher without a use, no use without
    a teacher)."""
    if distill_loss_coef > 0 and not section.enabled:
        raise ConfigError(
            f"actor.objective.distill_loss_coef={distill_loss_coef} needs a teacher: set "
            "algorithm.distillation.teacher_path"
        )
    if section.enabled and section.advantage_coef == 0 and distill_loss_coef == 0:
        raise ConfigError(
            f"algorithm.distillation.teacher_path={section.teacher_path!r} is set but unused: "
            "set algorithm.distillation.advantage_coef > 0 (distillation in the advantage) or "
            "actor.objective.distill_loss_coef > 0 (as a loss term)"
        )


def check_teacher(teacher_path: str, seed: int, student_tokenizer: Any) -> str:
    """The teacher's folder (resolved like `model.path`), refused unless it is a complete
    model folder whose tokenizer is the student's; run by `prepare`, before Ray starts."""
    # transformers only where a teacher is configured (the config checks import this module)
    from transformers import AutoTokenizer

    try:
        folder = resolve_model_path(teacher_path, seed)
    except ConfigError as exc:
        raise ConfigError(f"algorithm.distillation.teacher_path: {exc}") from None
    teacher = AutoTokenizer.from_pretrained(folder)
    if teacher.pad_token_id is None:  # as the student's (load_tokenizer)
        teacher.pad_token = teacher.eos_token
    check_same_tokenizer(student_tokenizer, teacher, teacher_path)
    return folder


def check_same_tokenizer(student: Any, teacher: Any, teacher_path: str) -> None:
    """Refuse a teacher whose tokenizer differs from the student's (the teacher's log-prob of
    token id k must be about the same text as the student's): same vocabulary (token ->
    id) and the same end-of-sequence and padding ids."""
    sv, tv = student.get_vocab(), teacher.get_vocab()
    if sv != tv:
        only_s = sorted(set(sv) - set(tv))[:3]
        only_t = sorted(set(tv) - set(sv))[:3]
        moved = sorted(k for k in set(sv) & set(tv) if sv[k] != tv[k])[:3]
        raise ConfigError(
            f"algorithm.distillation.teacher_path={teacher_path!r}: the teacher's tokenizer "
            f"is not the student's (vocabularies of {len(tv)} and {len(sv)} tokens; only the "
            f"student's: {only_s}, only the teacher's: {only_t}, other ids: {moved}); "
            "on-policy distillation compares log-probs of the same token ids, so choose a "
            "teacher of the student's model family (same tokenizer)"
        )
    for what in ("eos_token_id", "pad_token_id"):
        s, t = getattr(student, what), getattr(teacher, what)
        if t is not None and s != t:
            raise ConfigError(
                f"algorithm.distillation.teacher_path={teacher_path!r}: the teacher's {what} "
                f"is {t}, the student's {s}; give the teacher the student's tokenizer"
            )


def add_distillation_advantages(
    advantages: torch.Tensor,
    old_log_probs: torch.Tensor,
    teacher_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    section: DistillationConfig,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The step's advantages with the teacher's term: `advantages` (or 0 where
    `rl_advantage` is false) + advantage_coef * (log q - log pi_old) on response tokens."""
    distill = distillation_advantages(
        old_log_probs, teacher_log_probs, response_mask, section.advantage_coef
    )
    base = advantages if section.rl_advantage else torch.zeros_like(advantages)
    rkl = masked_mean((old_log_probs - teacher_log_probs).float(), response_mask)
    return (base + distill.to(advantages.dtype)), {"distill/reverse_kl": float(rkl)}
