"""On-policy distillation as a recipe: a frozen `teacher` engine (beside the reference) scores
the student's own samples, and its per-token log-prob minus the student's joins the advantage
(`algorithm.distillation.advantage_coef`) or the loss (`actor.objective.distill_loss_coef`).
The maths is `tephra.algos.distillation`; the teacher must share the student's tokenizer."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tephra.algos import add_distillation_advantages
from tephra.algos.recipe_config import DistillationConfig
from tephra.controller.recipes.base import RECIPES, EngineRole, Recipe, StepState
from tephra.controller.run.models import resolve_model_path
from tephra.core.errors import ConfigError

if TYPE_CHECKING:
    from tephra.controller.config.tree import PPOConfig


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


@RECIPES.register("distillation")
class Distillation(Recipe):
    """`algorithm.distillation`: the teacher's pass beside the reference's (its log-probs go
    into the batch, where `distill_loss_coef` reads them) and its advantage term."""

    name = "distillation"

    @classmethod
    def enabled(cls, cfg: PPOConfig) -> bool:
        return cfg.algorithm.distillation.enabled

    @classmethod
    def check(cls, cfg: PPOConfig) -> None:
        check_distillation(cfg.algorithm.distillation, cfg.actor.objective.distill_loss_coef)

    @classmethod
    def check_models(cls, cfg: PPOConfig, tokenizer: Any) -> None:
        teacher = cfg.algorithm.distillation.teacher_path
        assert teacher is not None  # the recipe is enabled by a teacher
        check_teacher(teacher, cfg.trainer.seed, tokenizer)

    def roles(self) -> tuple[EngineRole, ...]:
        # forward-only, with the reference (on its pool when it has one)
        return (
            EngineRole("teacher", "ref", model_path=self.cfg.algorithm.distillation.teacher_path),
        )

    def forward_passes(self, state: StepState) -> None:
        state.batch["teacher_log_probs"] = state.engines.log_probs("teacher", state.batch)
        state.forward_passes += 1
        state.lap("teacher")

    def after_advantages(self, state: StepState) -> None:
        batch = state.batch
        old_log_probs = batch.get("old_log_probs", batch["rollout_log_probs"])
        batch["advantages"], metrics = add_distillation_advantages(
            batch["advantages"],
            old_log_probs,
            batch["teacher_log_probs"],
            batch["response_mask"],
            self.cfg.algorithm.distillation,
        )
        state.metrics.update(metrics)
