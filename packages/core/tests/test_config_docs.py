"""The config reference: every dotted key with its type, default as written, and docstring."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from tephra.core.config_docs import Row, config_reference, load_class, rows
from tephra.core.errors import ConfigError


@dataclass
class Opt:
    """An optimizer."""

    lr: float = 1e-3
    """Learning rate.
    Peak value."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam betas."""


@dataclass
class Base:
    name: str = "adamw"
    """The base's doc."""
    steps: int = 3
    """Steps."""


@dataclass
class Child(Base):
    steps: int = 5  # re-declared without a docstring: the base's doc is kept
    opt: Opt = field(default_factory=lambda: Opt(lr=0.5))
    """Its optimizer."""


@dataclass
class Top:
    """The top."""

    path: str
    """Required."""
    child: Child = field(default_factory=Child)
    """A section."""
    tags: list[str] = field(default_factory=lambda: ["a"])
    """Tags."""
    other: Child | None = field(default_factory=lambda: Child(opt=Opt(lr=2.0, betas=(0.5, 0.6))))
    """An optional section whose factory sets a nested section."""


def test_rows_give_key_type_source_default_and_doc() -> None:
    assert rows(Top) == [
        Row("path", "str", "(required)", "Required."),
        Row("child", "Child", "Child()", "A section."),
        Row("child.name", "str", "'adamw'", "The base's doc."),
        Row("child.steps", "int", "5", "Steps."),
        Row("child.opt", "Opt", "Opt(lr=0.5)", "Its optimizer."),
        Row("child.opt.lr", "float", "0.5", "Learning rate.\nPeak value."),
        Row("child.opt.betas", "tuple[float, float]", "(0.9, 0.999)", "Adam betas."),
        Row("tags", "list[str]", "['a']", "Tags."),
        Row(
            "other",
            "Child | None",
            "Child(opt=Opt(lr=2.0, betas=(0.5, 0.6)))",
            "An optional section whose factory sets a nested section.",
        ),
        Row("other.name", "str", "'adamw'", "The base's doc."),
        Row("other.steps", "int", "5", "Steps."),
        Row("other.opt", "Opt", "Opt(lr=2.0, betas=(0.5, 0.6))", "Its optimizer."),
        Row("other.opt.lr", "float", "2.0", "Learning rate.\nPeak value."),
        Row("other.opt.betas", "tuple[float, float]", "(0.5, 0.6)", "Adam betas."),
    ]


def test_reference_has_one_table_per_section() -> None:
    text = config_reference("Top", Top, "run")
    headings = [line for line in text.splitlines() if line.startswith("### ")]
    assert headings == [
        "### top level",
        "### `child`",
        "### `child.opt`",
        "### `other`",
        "### `other.opt`",
    ]
    assert "| `child.opt.lr` | `float` | `0.5` | Learning rate. Peak value. |" in text
    assert "| `other` | `Child \\| None` |" in text  # a pipe in a type is escaped


def test_load_class_refuses_what_is_not_a_dataclass() -> None:
    assert load_class("tephra.core.config_docs:Row") is Row
    with pytest.raises(ConfigError, match="'tephra.core.errors:ConfigError' is not a dataclass"):
        load_class("tephra.core.errors:ConfigError")
