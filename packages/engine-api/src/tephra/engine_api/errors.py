"""The errors of the engine contract: tephra's one error tree (`tephra.core.errors`)."""

from tephra.core.errors import (
    BatchError,
    CheckpointError,
    ConfigError,
    InputError,
    RegistryError,
    TephraError,
)

__all__ = [
    "BatchError",
    "CheckpointError",
    "ConfigError",
    "InputError",
    "RegistryError",
    "TephraError",
]
