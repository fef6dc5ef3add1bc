"""One registry type for everything chosen by name.

    ESTIMATORS = Registry("advantage estimator")

    @ESTIMATORS.register("gae", needs_values=True)
    def gae(...): ...

    ESTIMATORS.get("gae")            # the function
    ESTIMATORS.meta("gae")           # {"needs_values": True}
    ESTIMATORS.names(needs_values=True)

Metadata says what a caller must supply (an estimator that needs a critic, groups of samples,
baselines); apps read it instead of keeping their own lists of names.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar, overload

from tephra.core.errors import ConfigError, RegistryError

T = TypeVar("T")


class Registry(Generic[T]):
    """Named objects of one kind (`kind` is used in error messages).

    Registering a second, different object under a taken name is an error (rebinding a
    name silently is how a typo in one module changes another module's algorithm).
    Registering the same object again, or under a second name (an alias), is allowed.
    """

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, T] = {}
        self._meta: dict[str, dict[str, Any]] = {}

    @overload
    def register(self, name: str, obj: None = None, **meta: Any) -> Callable[[T], T]: ...

    @overload
    def register(self, name: str, obj: T, **meta: Any) -> T: ...

    def register(self, name: str, obj: T | None = None, **meta: Any) -> Callable[[T], T] | T:
        """Register `obj` under `name` with metadata `meta`; without `obj`, a decorator."""

        def add(item: T) -> T:
            if name in self._items and self._items[name] is not item:
                raise RegistryError(
                    f"{self.kind} {name!r} is already registered to {self._items[name]!r}; "
                    f"choose another name"
                )
            self._items[name] = item
            self._meta[name] = {**self._meta.get(name, {}), **meta}
            return item

        return add(obj) if obj is not None else add

    def get(self, name: str) -> T:
        """Return the object registered under `name`, or raise listing the known names."""
        self.check(name)
        return self._items[name]

    def check(self, name: str, field: str | None = None) -> None:
        """Raise a `RegistryError` (naming `field` when given) unless `name` is registered."""
        if name not in self._items:
            message = unknown_name_message(self.kind, name, self.names())
            raise RegistryError(f"{field}={name!r}: {message}" if field else message)

    def meta(self, name: str) -> dict[str, Any]:
        """The metadata `name` was registered with (a copy; empty when none)."""
        self.check(name)
        return dict(self._meta.get(name, {}))

    def names(self, **where: Any) -> list[str]:
        """Registered names, sorted; `names(needs_values=True)` filters on metadata."""
        return sorted(
            n
            for n in self._items
            if all(self._meta.get(n, {}).get(k) == v for k, v in where.items())
        )

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._items)


def unknown_name_message(kind: str, name: str, known: list[str]) -> str:
    close = difflib.get_close_matches(str(name), known, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"unknown {kind} {name!r}{hint} registered: {', '.join(known) or '(none)'}"


def check_registered(field_name: str, value: str, registry: Registry[Any]) -> None:
    """Refuse a config field's registry name as a ConfigError naming the field, the nearest
    registered name and the choices."""
    if value not in registry:
        close = difflib.get_close_matches(str(value), registry.names(), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(
            f"{field_name}={value!r} is not a registered {registry.kind}{hint}; "
            f"choose one of {registry.names()}"
        )
