"""One registry type for everything chosen by name, and the engine lookup by entry point.

Estimators, losses, rollout backends, reward scorers, agent loops and tools all use
`Registry`. Training engines are found through the entry-point group `tephra.engines`, so
installing a backend package is enough to make it selectable by name.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterator
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Generic, TypeVar

from tephra.engine_api.errors import RegistryError

if TYPE_CHECKING:
    from tephra.engine_api.config import EngineConfig
    from tephra.engine_api.engine import Engine

T = TypeVar("T")

ENGINE_ENTRY_POINT_GROUP = "tephra.engines"


class Registry(Generic[T]):
    """Named objects of one kind.

    Registering a second, different object under a taken name is an error (rebinding a
    name silently is how a typo in one module changes another module's algorithm).
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


def installed_engines() -> dict[str, str]:
    """Engine names found in the `tephra.engines` entry-point group -> 'module:Class'."""
    return {ep.name: ep.value for ep in entry_points(group=ENGINE_ENTRY_POINT_GROUP)}


def get_engine_class(name: str) -> type[Engine]:
    """Load the engine class registered as `name` by an installed package."""
    eps = {ep.name: ep for ep in entry_points(group=ENGINE_ENTRY_POINT_GROUP)}
    if name not in eps:
        known = sorted(eps)
        hint = {"fsdp": "tephra-engine-fsdp", "megatron": "tephra-engine-megatron"}.get(name)
        install = f" Install it with `uv add {hint}`." if hint else ""
        raise RegistryError(unknown_name_message("engine", name, known) + "." + install)
    try:
        return eps[name].load()
    except ImportError as exc:
        raise RegistryError(
            f"engine {name!r} is registered by {eps[name].value} but could not be imported: "
            f"{exc}. Reinstall its package with its dependencies."
        ) from exc


def get_engine(name: str, config: EngineConfig) -> Engine:
    """Build the engine registered as `name` from `config` (the app's `engine=fsdp`)."""
    return get_engine_class(name).build(config)
