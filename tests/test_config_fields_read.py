"""Every field of the apps' config trees is read somewhere in the source: a field that nothing
reads is an option the config accepts and then ignores. Static (the AST of every source file of
the packages and apps): a field counts as read where an attribute of its name is loaded outside
its own class's `__post_init__` (validation alone does nothing), or inside one of its class's
own methods that is itself read. The server settings that one class gives several sections
(`rollout.vllm`, `rollout.sglang`) are checked per section, in the modules that serve it."""

from __future__ import annotations

import ast
import dataclasses
import typing
from pathlib import Path

from tephra.apps.eval.config import EvalConfig
from tephra.apps.ppo.config import PPOConfig
from tephra.apps.sft.config import SFTConfig
from tephra.core.config import dotted_key_types

ROOT = Path(__file__).resolve().parent.parent
SOURCES = sorted([*ROOT.glob("packages/*/src/**/*.py"), *ROOT.glob("apps/*/src/**/*.py")])
APPS = (PPOConfig, SFTConfig, EvalConfig)

BACKENDS = "packages/rollout/src/tephra/rollout/backends"
SERVER_SHARED = (f"{BACKENDS}/server_client.py", f"{BACKENDS}/server_process.py")
SCOPED = {
    # section -> the modules whose reads count for its fields: one `ServerSettings` class
    # serves both backends, so a field read only by vLLM's module does nothing for SGLang
    "rollout.vllm": (f"{BACKENDS}/vllm.py", *SERVER_SHARED),
    "rollout.sglang": (f"{BACKENDS}/sglang.py", *SERVER_SHARED),
    "reward.judge.vllm": (f"{BACKENDS}/vllm.py", *SERVER_SHARED),
}

ALLOWED: dict[str, str] = {
    # dotted key -> where it is read dynamically (no attribute load of its name)
}


@dataclasses.dataclass(frozen=True)
class Read:
    file: str
    scope: tuple[tuple[str, str], ...]  # enclosing (class | def, name) pairs, outermost first


def _loaded_name(node: ast.AST) -> str | None:
    """The attribute name `node` loads: `x.name` or `getattr(x, "name")`."""
    if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
        return node.attr
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "getattr"
        and len(node.args) >= 2
        and isinstance(node.args[1], ast.Constant)
        and isinstance(node.args[1].value, str)
    ):
        return node.args[1].value
    return None


def _collect(node: ast.AST, file: str, stack: tuple, out: dict[str, list[Read]]) -> None:
    name = _loaded_name(node)
    if name is not None:
        out.setdefault(name, []).append(Read(file, stack))
    if isinstance(node, ast.ClassDef):
        stack = (*stack, ("class", node.name))
    elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
        stack = (*stack, ("def", node.name))
    for child in ast.iter_child_nodes(node):
        _collect(child, file, stack, out)


def _reads() -> dict[str, list[Read]]:
    """Attribute name -> every load of it in the sources."""
    out: dict[str, list[Read]] = {}
    for path in SOURCES:
        rel = str(path.relative_to(ROOT))
        _collect(ast.parse(path.read_text(), filename=rel), rel, (), out)
    return out


def _fields() -> list[tuple[str, type, str]]:
    """(dotted key, owning dataclass, field name) of every leaf and section of the apps."""
    out = []
    for app in APPS:
        for key in dotted_key_types(app):
            owner: type = app
            parts = key.split(".")
            for part in parts[:-1]:
                hint = typing.get_type_hints(owner)[part]
                owner = next(
                    t
                    for t in (hint, *typing.get_args(hint))
                    if dataclasses.is_dataclass(t) and isinstance(t, type)
                )
            out.append((key, owner, parts[-1]))
    return out


def _own_method(read: Read, cls: type) -> str | None:
    """The method of `cls` (or a base) the read sits in, if any."""
    names = {c.__name__ for c in cls.__mro__}
    for (kind, name), nxt in zip(read.scope, (*read.scope[1:], None)):
        if kind == "class" and name in names and nxt is not None and nxt[0] == "def":
            return nxt[1]
    return None


def unread_fields(reads: dict[str, list[Read]]) -> list[str]:
    def used(name: str, cls: type, files: tuple[str, ...] | None, seen: frozenset = frozenset()):
        for read in reads.get(name, []):
            if files is not None and read.file not in files:
                continue
            method = _own_method(read, cls)
            if method is None:
                return True
            if method == "__post_init__" or method in seen:
                continue
            # a read inside the class's own method counts where that method is used
            if used(method, cls, None, seen | {method}):
                return True
        return False

    missing = []
    for key, cls, name in _fields():
        if key in ALLOWED:
            continue
        section = key.rsplit(".", 1)[0]
        files = next((f for s, f in SCOPED.items() if section.endswith(s)), None)
        if not used(name, cls, files):
            missing.append(key)
    return sorted(set(missing))


def test_every_config_field_is_read_somewhere():
    missing = unread_fields(_reads())
    assert not missing, (
        f"config fields that no source file reads (an option accepted and ignored): {missing}; "
        "wire each to what it configures or remove it (a field read only dynamically goes in "
        "ALLOWED with where it is read)"
    )


def test_the_scoped_sections_exist():
    """The scope table names real sections and files (a rename would silently widen it)."""
    keys = {k for app in APPS for k in dotted_key_types(app)}
    for section, files in SCOPED.items():
        assert any(k == section or k.endswith("." + section) for k in keys), section
        assert all((ROOT / f).is_file() for f in files), files
    assert set(ALLOWED) <= keys
