"""The field checks the algorithms' config sections share: a message names the section, the
field, the value it got and what it must be."""

from __future__ import annotations

import difflib
from typing import Any

from tephra.algos.errors import ConfigError


def in_range(section: str, name: str, value: float, lo: float, hi: float) -> None:
    if not lo <= value <= hi:
        raise ConfigError(f"{section}.{name}={value!r} must be in [{lo}, {hi}]")


def positive(section: str, name: str, value: float, *, zero_ok: bool = False) -> None:
    if value < 0 or (value == 0 and not zero_ok):
        bound = ">= 0" if zero_ok else "> 0"
        raise ConfigError(f"{section}.{name}={value!r} must be {bound}")


def registered(section: str, name: str, value: str, registry: Any) -> None:
    if value not in registry:
        close = difflib.get_close_matches(str(value), registry.names(), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(
            f"{section}.{name}={value!r} is not registered{hint}; choose one of {registry.names()}"
        )
