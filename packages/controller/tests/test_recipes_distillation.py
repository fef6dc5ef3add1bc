"""The distillation teacher's pieces: the tokenizer check on real tiny tokenizers, the
advantage it adds by hand, and the refused options."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from tephra.algos import add_distillation_advantages
from tephra.algos.recipe_config import DistillationConfig
from tephra.controller.recipes.distillation import check_distillation, check_same_tokenizer
from tephra.engine_api.errors import ConfigError
from tephra.rollout.testing import build_tiny_model


def test_same_tokenizer_passes_and_another_is_refused(tmp_path):
    a = build_tiny_model(tmp_path / "a", seed=0)
    b = build_tiny_model(tmp_path / "b", seed=1, hidden_size=32)  # other weights, same tokenizer
    c = build_tiny_model(tmp_path / "c", vocab_size=400)
    ta, tb, tc = (AutoTokenizer.from_pretrained(m.path) for m in (a, b, c))
    check_same_tokenizer(ta, tb, b.path)
    with pytest.raises(
        ConfigError, match=r"teacher_path=.*the teacher's tokenizer is not the student's"
    ):
        check_same_tokenizer(ta, tc, c.path)


def test_distillation_advantage_added_by_hand():
    adv = torch.tensor([[0.0, 1.0, 1.0], [0.0, -1.0, 0.0]])
    old = torch.tensor([[-5.0, -1.0, -2.0], [-5.0, -0.5, -5.0]])
    teacher = torch.tensor([[-9.0, -0.5, -3.0], [-9.0, -0.5, -9.0]])
    mask = torch.tensor([[0, 1, 1], [0, 1, 0]])
    out, metrics = add_distillation_advantages(
        adv, old, teacher, mask, DistillationConfig(teacher_path="t", advantage_coef=2.0)
    )
    # + 2 * (teacher - old) on response tokens: +1, -2; 0
    torch.testing.assert_close(out, torch.tensor([[0.0, 2.0, -1.0], [0.0, -1.0, 0.0]]))
    # reverse KL estimate: mean of old - teacher over response tokens = (-0.5 + 1 + 0) / 3
    assert metrics["distill/reverse_kl"] == pytest.approx(0.5 / 3)
    alone, _ = add_distillation_advantages(
        adv,
        old,
        teacher,
        mask,
        DistillationConfig(teacher_path="t", advantage_coef=1.0, rl_advantage=False),
    )
    torch.testing.assert_close(alone, torch.tensor([[0.0, 0.5, -1.0], [0.0, 0.0, 0.0]]))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"advantage_coef": -1.0}, r"advantage_coef=-1\.0 must be a finite number >= 0"),
        ({"advantage_coef": 1.0}, r"advantage_coef=1\.0 needs a teacher"),
        ({"teacher_path": "t", "rl_advantage": False}, r"rl_advantage=false leaves no advantage"),
    ],
)
def test_bad_distillation_sections(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        DistillationConfig(**kwargs)


def test_teacher_and_its_uses_must_agree():
    with pytest.raises(ConfigError, match=r"distill_loss_coef=0\.5 needs a teacher"):
        check_distillation(DistillationConfig(), 0.5)
    with pytest.raises(ConfigError, match=r"teacher_path='t' is set but unused"):
        check_distillation(DistillationConfig(teacher_path="t"), 0.0)
    check_distillation(DistillationConfig(teacher_path="t"), 0.5)
