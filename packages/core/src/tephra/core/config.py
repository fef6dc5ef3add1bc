"""Typed configs from dicts, YAML presets and dotted command-line overrides: the one loader.

A config is a tree of dataclasses, each field documented where it is defined and validated in
its `__post_init__`. Values come, in order of precedence, from the dataclass defaults, then YAML
presets (in order), then `a.b.c=value` overrides. Unknown keys are errors that name the full
dotted key and suggest the closest valid one; values are checked against the field's type and
converted (`"3"` -> 3 for an int, `"a,b"` -> ["a", "b"] for a list).
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import yaml

from tephra.core.errors import ConfigError

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

C = TypeVar("C", bound="DataclassInstance")


def _close(key: str, names: list[str]) -> str:
    close = difflib.get_close_matches(key, names, n=1, cutoff=0.5)
    return f"; did you mean {close[0]!r}?" if close else ""


def _dataclass_of(tp: Any) -> type | None:
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return tp
    for arg in typing.get_args(tp):
        if dataclasses.is_dataclass(arg) and isinstance(arg, type):
            return arg
    return None


def dotted_key_types(cls: type, prefix: str = "") -> dict[str, Any]:
    """Every valid dotted key of dataclass `cls` (sections and their fields) -> its type."""
    out: dict[str, Any] = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        out[key] = hints[f.name]
        sub = _dataclass_of(hints[f.name])
        if sub is not None:
            out.update(dotted_key_types(sub, key + "."))
    return out


def retired_dotted_keys(cls: type, prefix: str = "") -> dict[str, str]:
    """Every removed dotted key that a section of `cls` lists in its `RETIRED_KEYS` -> what
    replaced it."""
    out = {f"{prefix}{k}": v for k, v in getattr(cls, "RETIRED_KEYS", {}).items()}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        sub = _dataclass_of(hints[f.name])
        if sub is not None:
            out.update(retired_dotted_keys(sub, f"{prefix}{f.name}."))
    return out


def all_dotted_keys(cls: type, prefix: str = "") -> list[str]:
    """Every valid dotted key of dataclass `cls` (sections and their fields)."""
    return list(dotted_key_types(cls, prefix))


def _is_text(tp: Any) -> bool:
    """A `str` field (or `str | None`): its override is taken as written, so that YAML does
    not turn `off` or `no` into a bool, or `1e-3` into a float."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return tp is str or (typing.get_origin(tp) in (typing.Union, types.UnionType) and args == [str])


def _matches(value: Any, tp: Any) -> bool:
    """Whether `value` already has type `tp` (so a union picks it without converting)."""
    origin = typing.get_origin(tp) or tp
    if tp is Any:
        return True
    if origin is typing.Literal:
        return value in typing.get_args(tp)
    if origin in (list, tuple, dict, str, bool):
        return isinstance(value, origin)
    if origin is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if origin is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return False


def coerce(value: Any, tp: Any, where: str) -> Any:  # noqa: C901, PLR0915 (older than the limit; to split)
    """Convert a YAML/CLI value to the annotated type, or raise naming the key."""
    origin = typing.get_origin(tp)
    if tp is Any or tp is object:
        return value
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None and len(args) < len(typing.get_args(tp)):
            return None
        for arg in args:  # a value that already fits one member keeps its type
            if _matches(value, arg):
                return coerce(value, arg, where)
        errors = []
        for arg in args:
            try:
                return coerce(value, arg, where)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0] if errors else f"{where}: cannot use {value!r}")
    if origin is typing.Literal:
        if value not in typing.get_args(tp):
            raise ConfigError(f"{where}={value!r}: choose one of {list(typing.get_args(tp))}")
        return value
    if origin in (list, tuple) or tp in (list, tuple):
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}={value!r} must be a list")
        params = typing.get_args(tp)
        if origin is tuple and len(params) > 1 and params[1] is not Ellipsis:
            if len(value) != len(params):
                raise ConfigError(f"{where}={value!r} must hold {len(params)} values")
            return tuple(coerce(v, a, where) for v, a in zip(value, params))
        inner = params[0] if params else Any
        items = [coerce(v, inner, where) for v in value]
        return tuple(items) if (origin or tp) is tuple else items
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}={value!r} must be a mapping")
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ConfigError(f"{where}={value!r} must be true or false")
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, (int, str, float)):
            raise ConfigError(f"{where}={value!r} must be an integer")
        try:
            out = float(value) if isinstance(value, str) and "." in value else value
            if isinstance(out, float):
                if not out.is_integer():
                    raise ValueError
                out = int(out)
            return int(out)
        except ValueError:
            raise ConfigError(f"{where}={value!r} must be an integer") from None
    if tp is float:
        if isinstance(value, bool):
            raise ConfigError(f"{where}={value!r} must be a number")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{where}={value!r} must be a number") from None
    if tp is str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise ConfigError(f"{where}={value!r} must be a string")
        return str(value)
    sub = _dataclass_of(tp)
    if sub is not None and isinstance(value, dict):
        return from_dict(sub, value, where + ".")
    return value


def _explicit_fields(instance: Any) -> dict[str, Any]:
    """The fields of a default instance that differ from its class's own defaults.

    A parent's `field(default_factory=lambda: Inner(lr=3e-5))` sets some fields of `Inner`;
    a partial override (`inner.steps=2`) must keep those and nothing else, so that fields a
    `__post_init__` derives from others (a bound that follows another field) derive again.
    """
    cls = type(instance)
    try:
        bare = cls()
    except (TypeError, ValueError):  # required fields, or defaults that do not validate alone
        bare = None
    out = {}
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        value = getattr(instance, f.name)
        if bare is not None:
            default = getattr(bare, f.name)
        elif f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = dataclasses.MISSING
        if value != default:
            out[f.name] = value
    return out


def _default_of(f: dataclasses.Field[Any]) -> Any:
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None if f.default is dataclasses.MISSING else f.default


def _check_required(
    cls: type,
    fields: list[dataclasses.Field[Any]],
    data: dict[str, Any],
    given: dict[str, Any],
    prefix: str,
) -> None:
    """A field without a default that neither `data` nor the base sets is an error naming
    the key and, where the class gives one in its `REQUIRED_HINTS` (a `ClassVar` mapping the
    field to the fix), how to set it; not a TypeError about `__init__` arguments."""
    hints: dict[str, str] = getattr(cls, "REQUIRED_HINTS", {})
    for f in fields:
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if required and f.name not in data and f.name not in given:
            fix = hints.get(f.name) or f"set it in a preset or as `{prefix}{f.name}=...`"
            raise ConfigError(f"config key {prefix + f.name!r} is required and not set: {fix}")


def from_dict(cls: type[C], data: dict[str, Any] | None, prefix: str = "", base: Any = None) -> C:
    """Build dataclass `cls` (recursively) from nested dicts; unknown keys are errors, and a
    key the class lists in its `RETIRED_KEYS` (a `ClassVar` mapping the removed key to what
    replaced it) is refused with that text.

    Sections absent from `data` keep their defaults, and a section given in part keeps the
    rest of its default (`base`, or the parent's default for it). A field without a default
    must be in `data` or set in `base`. Each dataclass validates
    itself in `__post_init__`, so a bad value fails here, before anything is started.
    """
    if data is not None and not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'the config'} must be a mapping, got {data!r}")
    data = dict(data or {})
    hints = typing.get_type_hints(cls)
    fields = [f for f in dataclasses.fields(cls) if f.init]
    names = [f.name for f in fields]
    retired: dict[str, str] = getattr(cls, "RETIRED_KEYS", {})
    for key in data:
        if key in retired:
            raise ConfigError(f"config key {prefix + str(key)!r} was removed: {retired[key]}")
        if key not in names:
            raise ConfigError(
                f"unknown config key {prefix + str(key)!r}{_close(str(key), names)} "
                f"(valid keys under {prefix.rstrip('.') or 'the top level'}: {names})"
            )
    kwargs = _explicit_fields(base) if base is not None else {}
    _check_required(cls, fields, data, kwargs, prefix)
    for f in fields:
        if f.name not in data:
            continue
        value, tp, where = data[f.name], hints[f.name], f"{prefix}{f.name}"
        sub = _dataclass_of(tp)
        if sub is not None and isinstance(value, dict):
            current = kwargs[f.name] if f.name in kwargs else _default_of(f)
            kwargs[f.name] = from_dict(
                sub, value, where + ".", current if isinstance(current, sub) else None
            )
        elif sub is not None and dataclasses.is_dataclass(value):
            kwargs[f.name] = value
        else:
            kwargs[f.name] = coerce(value, tp, where)
    try:
        return cls(**kwargs)
    except ConfigError as exc:  # say which section a nested dataclass's own message is about
        where, message = prefix.rstrip("."), str(exc)
        if where and not message.startswith(where):
            # a section names its fields by its own name ("optimizer.lr=..."): give the
            # full key ("actor.optimizer.lr=..."), which is what the user writes
            own = where.rsplit(".", 1)[-1] + "."
            if message.startswith(own):
                raise ConfigError(f"{where}.{message[len(own) :]}") from None
            raise ConfigError(f"{where}: {message}") from None
        raise


def to_dict(config: Any) -> dict[str, Any]:
    """Nested plain dict of a dataclass config (for YAML dumps and tracker hyper-parameters)."""
    return dataclasses.asdict(config)


def merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """`extra` over `base`, recursively for nested mappings."""
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def parse_overrides(cls: type, args: list[str]) -> dict[str, Any]:
    """`["a.b=1", "c=x"]` -> nested dict; each key is checked against `cls` right away."""
    types_of = dotted_key_types(cls)
    valid = list(types_of)
    retired = retired_dotted_keys(cls)
    out: dict[str, Any] = {}
    for arg in args:
        if "=" not in arg:
            raise ConfigError(
                f"command-line argument {arg!r} is not an override; write key=value, "
                f"e.g. algorithm.adv_estimator=grpo"
            )
        key, _, raw = arg.partition("=")
        key = key.strip().lstrip("-")
        if key in retired:
            raise ConfigError(f"config key {key!r} was removed: {retired[key]}")
        if key not in valid:
            raise ConfigError(f"unknown config key {key!r}{_close(key, valid)}")
        if _is_text(types_of[key]):
            value = None if raw in ("null", "~") else raw
        else:
            try:
                value = yaml.safe_load(raw) if raw != "" else ""
            except yaml.YAMLError as exc:
                problem = getattr(exc, "problem", None) or "bad YAML"
                raise ConfigError(
                    f"override {arg!r}: the value is not valid YAML ({problem}); quote it or "
                    "close its brackets, e.g. trainer.trackers=[console,jsonl]"
                ) from None
        node = out
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(
                    f"override {arg!r} sets a field inside {part!r}, which an "
                    "earlier override set to a plain value"
                )
        node[parts[-1]] = value
    return out


def read_preset(preset: str | Path, preset_dir: Path | None = None) -> dict[str, Any]:
    """A preset: a YAML file path, or a name looked up as `preset_dir/<name>.yaml`."""
    path = Path(preset)
    if not path.suffix and preset_dir is not None:
        path = preset_dir / f"{preset}.yaml"
    if not path.exists():
        known = sorted(p.stem for p in preset_dir.glob("*.yaml")) if preset_dir else []
        raise ConfigError(
            f"preset {str(preset)!r} not found (looked for {path}); known presets: {known}"
        )
    try:
        loaded = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"preset {path} is not valid YAML: {exc}") from None
    if not isinstance(loaded, dict):
        raise ConfigError(f"preset {path} must hold a mapping at the top level")
    return loaded


def load_config(
    cls: type[C],
    presets: Sequence[str | Path] = (),
    overrides: Sequence[str] = (),
    preset_dir: Path | None = None,
    base: C | None = None,
) -> C:
    """Defaults <- YAML presets (in order) <- dotted overrides, validated into `cls`.

    `base`, an instance of `cls`, stands in for the class's defaults: an app's own defaults
    over a library's neutral ones. A preset's section then keeps what `base` set in it and
    changes what the preset names, exactly as over a `default_factory` (a mapping or list
    field is replaced whole, never merged key by key)."""
    data: dict[str, Any] = {}
    for preset in presets:
        data = merge(data, read_preset(preset, preset_dir))
    data = merge(data, parse_overrides(cls, list(overrides)))
    return from_dict(cls, data, base=base)


def split_cli(argv: list[str]) -> tuple[list[str], list[str]]:
    """Split argv into presets (`--preset NAME`, `-p NAME` or `preset=NAME`) and overrides."""
    presets, overrides = [], []
    it = iter(argv)
    for arg in it:
        if arg in ("--preset", "-p"):
            try:
                presets.append(next(it))
            except StopIteration:
                raise ConfigError(f"{arg} needs a preset name or YAML path") from None
        elif arg.startswith(("preset=", "--preset=")):
            presets.extend(p for p in arg.split("=", 1)[1].split(",") if p)
        else:
            overrides.append(arg)
    return presets, overrides
