"""Exceptions raised for people: each message names the argument or field, the value and the fix.

`tephra.algos` depends on torch only, so these do not derive from `tephra.engine_api`'s
errors; they derive from the builtin types callers already catch (`ValueError`, `KeyError`).
"""


class AlgosError(Exception):
    """Base class of every error `tephra.algos` raises on purpose."""


class ConfigError(AlgosError, ValueError):
    """A configuration field holds a value that cannot work."""


class InputError(AlgosError, ValueError):
    """A tensor argument has the wrong shape or dtype, or a required one is missing."""


class RegistryError(AlgosError, KeyError):
    """A name was looked up that nothing registered, or a name was registered twice."""

    def __str__(self) -> str:  # KeyError quotes its message; people want it plain
        return str(self.args[0]) if self.args else ""
