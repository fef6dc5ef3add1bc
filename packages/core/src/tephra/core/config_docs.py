"""A Markdown reference of a config tree, read from its dataclasses' field docstrings.

Each field of a config dataclass is documented by the string literal under it (the habit every
tephra config follows). `config_reference(title, cls)` walks the dataclass tree and writes, for
every dotted key, its type and default as written in the source, and its docstring. Defaults are
the source expression (normalised by `ast.unparse`), never a computed value (a default that `__post_init__` resolves, such as an
`auto` dtype, differs between machines), and a section built by a `default_factory` lambda shows
the keyword arguments that lambda passes (`field(default_factory=lambda: Opt(lr=1e-4))` gives
`opt.lr` the default `1e-4`).

    uv run python -m tephra.core.config_docs tephra.controller.config.tree:PPOConfig
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib
import inspect
import sys
import textwrap
import typing
from dataclasses import dataclass

from tephra.core.config import _dataclass_of
from tephra.core.errors import ConfigError


@dataclass(frozen=True)
class FieldSource:
    """What the source of a dataclass says about one of its fields."""

    annotation: str
    """The annotation's source (`float | None`)."""
    default: str | None
    """The default's source (`0.0001`, `field(default_factory=list)`), None when required."""
    factory_kwargs: dict[str, ast.expr]
    """A `default_factory=lambda: Cls(k=v, ...)` call's keyword arguments (else empty)."""
    doc: str
    """The string literal under the field, dedented (empty when none)."""


@dataclass(frozen=True)
class Row:
    """One dotted key of the reference."""

    key: str
    type: str
    default: str
    doc: str


def _class_tree(cls: type) -> ast.ClassDef:
    """The `ClassDef` node of `cls`, parsed from its source."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError) as exc:
        raise ConfigError(
            f"config_docs: cannot read the source of {cls.__qualname__} ({exc}); the reference "
            "is built from the field docstrings in the source"
        ) from exc
    node = ast.parse(source).body[0]
    if not isinstance(node, ast.ClassDef):
        raise ConfigError(f"config_docs: the source of {cls.__qualname__} is not a class")
    return node


@functools.cache
def _own_fields(cls: type) -> dict[str, FieldSource]:
    """The fields `cls` itself declares (not inherited), in source order."""
    node = _class_tree(cls)
    out: dict[str, FieldSource] = {}
    body = node.body
    for i, stmt in enumerate(body):
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        nxt = body[i + 1] if i + 1 < len(body) else None
        doc = ""
        if (
            isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            doc = inspect.cleandoc(nxt.value.value)
        default = None if stmt.value is None else ast.unparse(stmt.value)
        kwargs = {} if stmt.value is None else _factory_kwargs(stmt.value)
        out[stmt.target.id] = FieldSource(ast.unparse(stmt.annotation), default, kwargs, doc)
    return out


def _factory_kwargs(value: ast.expr) -> dict[str, ast.expr]:
    """`field(default_factory=lambda: Cls(k=v))` -> {k: v}; anything else -> {}."""
    if not (isinstance(value, ast.Call) and isinstance(value.func, ast.Name)):
        return {}
    if value.func.id != "field":
        return {}
    for kw in value.keywords:
        if kw.arg == "default_factory" and isinstance(kw.value, ast.Lambda):
            return _call_kwargs(kw.value.body)
    return {}


def _call_kwargs(node: ast.expr) -> dict[str, ast.expr]:
    if isinstance(node, ast.Call):
        return {kw.arg: kw.value for kw in node.keywords if kw.arg is not None}
    return {}


def _field_source(cls: type, name: str) -> FieldSource:
    """The declaration of field `name` of `cls`: the nearest class in the MRO that declares it,
    with its docstring taken from further up when a subclass re-declares it without one."""
    found: FieldSource | None = None
    for klass in cls.__mro__:
        if not dataclasses.is_dataclass(klass) or name not in klass.__dict__.get(
            "__annotations__", {}
        ):
            continue
        src = _own_fields(klass).get(name)
        if src is None:
            continue
        if found is None:
            found = src
        if src.doc:
            return dataclasses.replace(found, doc=src.doc)
    if found is None:
        raise ConfigError(f"config_docs: no declaration of {cls.__qualname__}.{name} found")
    return found


def _shown_default(src: FieldSource) -> str:
    if src.default is None:
        return "(required)"
    if src.factory_kwargs or src.default.startswith("field("):
        return _factory_text(src.default)
    return src.default


def _factory_text(default: str) -> str:
    """`field(default_factory=lambda: X(a=1))` -> `X(a=1)`; `field(default_factory=list)` ->
    `list()`; `field(default=3)` -> `3`."""
    node = ast.parse(default, mode="eval").body
    if isinstance(node, ast.Call):
        for kw in node.keywords:
            if kw.arg == "default_factory":
                body = kw.value.body if isinstance(kw.value, ast.Lambda) else kw.value
                text = ast.unparse(body)
                return text if isinstance(kw.value, ast.Lambda) else f"{text}()"
            if kw.arg == "default":
                return ast.unparse(kw.value)
    return default


def rows(cls: type, prefix: str = "", overrides: dict[str, ast.expr] | None = None) -> list[Row]:
    """Every dotted key of dataclass `cls`, sections before their fields, in field order."""
    overrides = overrides or {}
    hints = typing.get_type_hints(cls)
    out: list[Row] = []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        src = _field_source(cls, f.name)
        key = f"{prefix}{f.name}"
        given = overrides.get(f.name)
        default = ast.unparse(given) if given is not None else _shown_default(src)
        sub = _dataclass_of(hints[f.name])
        if sub is None:
            out.append(Row(key, src.annotation, default, src.doc))
            continue
        section_kwargs = _call_kwargs(given) if given is not None else src.factory_kwargs
        out.append(Row(key, src.annotation, default, src.doc))
        out.extend(rows(sub, key + ".", section_kwargs))
    return out


def _cell(text: str) -> str:
    """One Markdown table cell: one line, pipes escaped."""
    return " ".join(text.split()).replace("|", "\\|")


def with_app_defaults(all_rows: list[Row], values: dict[str, typing.Any], where: str) -> list[Row]:
    """`rows` with an app's own defaults (dotted key -> value, e.g. from the preset it lays
    under every run) shown in place of the library's, each saying where it is set and what
    the library's default is."""
    out = []
    for r in all_rows:
        if r.key in values:
            note = f"(Default set by {where}; the library's default: `{r.default}`.)"
            r = dataclasses.replace(r, default=repr(values[r.key]), doc=f"{r.doc} {note}")
        out.append(r)
    return out


def config_reference(title: str, cls: type, command: str, all_rows: list[Row] | None = None) -> str:
    """The Markdown reference of config `cls`: one table per section (a dotted prefix);
    `all_rows` in place of `rows(cls)` (as `with_app_defaults` gives them)."""
    doc = inspect.cleandoc(cls.__doc__ or "")
    lines = [f"## {title}", "", f"`{cls.__module__}.{cls.__qualname__}`: {_cell(doc)}", ""]
    lines += [f"Set a key on the command line with `{command} key=value`.", ""]
    all_rows = rows(cls) if all_rows is None else all_rows
    sections = {r.key for r in all_rows} & {r.key.rsplit(".", 1)[0] for r in all_rows}
    groups: dict[str, list[Row]] = {"": []}
    for r in all_rows:
        if r.key in sections:
            groups.setdefault(r.key, [])
        groups.setdefault(r.key.rsplit(".", 1)[0] if "." in r.key else "", []).append(r)
    for section, members in groups.items():
        if not members:
            continue
        lines += [f"### `{section}`" if section else "### top level", ""]
        lines += ["| key | type | default | description |", "| --- | --- | --- | --- |"]
        for r in members:
            lines.append(
                f"| `{r.key}` | `{_cell(r.type)}` | `{_cell(r.default)}` | {_cell(r.doc)} |"
            )
        lines.append("")
    return "\n".join(lines)


def load_class(spec: str) -> type:
    """`package.module:Class` -> the class."""
    module, _, name = spec.partition(":")
    cls = getattr(importlib.import_module(module), name, None)
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise ConfigError(f"config_docs: {spec!r} is not a dataclass (expected module:Class)")
    return cls


def main(argv: list[str]) -> int:
    """Print the reference of each `module:Class` given."""
    if not argv:
        print("usage: python -m tephra.core.config_docs module:Class [...]", file=sys.stderr)
        return 2
    for spec in argv:
        cls = load_class(spec)
        print(config_reference(cls.__qualname__, cls, "..."))
    return 0


__all__ = ["FieldSource", "Row", "config_reference", "load_class", "rows", "with_app_defaults"]

if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
