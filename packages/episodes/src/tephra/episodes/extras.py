"""The optional extras of tephra-episodes: a clear error, before Ray starts, when an adapter's
package is not installed."""

from __future__ import annotations

import importlib.util

from tephra.core.errors import ConfigError


def require_package(module: str, field: str, extra: str) -> None:
    """Raise a ConfigError naming `field` and the extra to install when `module` is missing."""
    if importlib.util.find_spec(module) is None:
        raise ConfigError(
            f"{field} needs the `{module}` package, which is not installed; install the extra: "
            f"uv add '{extra}' (or pip install '{extra}')"
        )
