"""The errors `tephra.algos` raises: tephra's one error tree (`tephra.core.errors`).

Each message names the argument or field, the value and the fix.
"""

from tephra.core.errors import ConfigError, InputError, RegistryError, TephraError

__all__ = ["ConfigError", "InputError", "RegistryError", "TephraError"]
