"""The engine lookup by entry point, beside tephra's one `Registry` type (from `tephra.core`).

Estimators, losses, rollout backends, reward scorers, agent loops and tools all use
`tephra.core.Registry`. Training engines are found through the entry-point group `tephra.engines`, so
installing a backend package is enough to make it selectable by name.
"""

from __future__ import annotations

from importlib.metadata import entry_points
from typing import TYPE_CHECKING

from tephra.core.registry import Registry, unknown_name_message
from tephra.engine_api.errors import RegistryError

if TYPE_CHECKING:  # this module stays light (no torch): reward workers import it
    from tephra.engine_api.config import EngineConfig
    from tephra.engine_api.engine import Engine

__all__ = [
    "Registry",
    "get_engine",
    "get_engine_class",
    "installed_engines",
    "unknown_name_message",
]

ENGINE_ENTRY_POINT_GROUP = "tephra.engines"


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
        loaded: type[Engine] = eps[name].load()
    except ImportError as exc:
        raise RegistryError(
            f"engine {name!r} is registered by {eps[name].value} but could not be imported: "
            f"{exc}. Reinstall its package with its dependencies."
        ) from exc
    return loaded


def get_engine(name: str, config: EngineConfig) -> Engine:
    """Build the engine registered as `name` from `config` (the app's `engine=fsdp`)."""
    return get_engine_class(name).build(config)
