"""One small `Registry` type for everything in `tephra.algos` chosen by name.

Same semantics as `tephra.engine_api.registry.Registry` (register / get / names, refuses to
rebind a name, unknown names raise listing the registered ones and the closest match); it is
repeated here because algos must not depend on the engine API.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

from tephra.algos.errors import RegistryError

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

    def register(self, name: str, obj: T | None = None) -> Callable[[T], T] | T:
        """Register `obj` under `name`; without `obj`, return a decorator."""

        def add(item: T) -> T:
            if name in self._items and self._items[name] is not item:
                raise RegistryError(
                    f"{self.kind} {name!r} is already registered to {self._items[name]!r}; "
                    f"choose another name"
                )
            self._items[name] = item
            return item

        return add(obj) if obj is not None else add

    def get(self, name: str) -> T:
        """Return the object registered under `name`, or raise listing the known names."""
        if name not in self._items:
            raise RegistryError(unknown_name_message(self.kind, name, self.names()))
        return self._items[name]

    def names(self) -> list[str]:
        return sorted(self._items)

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._items)


def unknown_name_message(kind: str, name: str, known: list[str]) -> str:
    close = difflib.get_close_matches(name, known, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"unknown {kind} {name!r}{hint} registered: {', '.join(known) or '(none)'}"
