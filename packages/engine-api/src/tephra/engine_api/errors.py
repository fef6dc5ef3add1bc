"""Exceptions raised for people: each message names the field, the value and the fix."""


class TephraError(Exception):
    """Base class of every error tephra raises on purpose."""


class ConfigError(TephraError, ValueError):
    """A configuration field holds a value that cannot work."""


class BatchError(TephraError, ValueError):
    """A batch is missing a field, has the wrong shape or dtype, or breaks a budget."""


class RegistryError(TephraError, KeyError):
    """A name was looked up that nothing registered."""

    def __str__(self) -> str:  # KeyError quotes its message; people want it plain
        return str(self.args[0]) if self.args else ""


class CheckpointError(TephraError, RuntimeError):
    """A checkpoint is missing, incomplete, or belongs to another model."""
