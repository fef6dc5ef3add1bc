"""tephra.core: what every tephra package shares, in pure Python.

- `Registry`: named objects of one kind with metadata (estimators, losses, backends, scorers,
  agent loops, tools); unknown names raise listing the registered ones.
- the error root: `TephraError` and its `ConfigError`, `InputError`, `RegistryError`, ...
- the config loader: dataclass trees from dicts, YAML presets and dotted overrides, with type
  coercion and unknown-key errors that suggest the closest valid key.
- per-machine state: `cache_root()` (`$TEPHRA_CACHE` or `~/.cache/tephra`) and
  `decided_once_per_machine`, which records a timed choice so every process makes the same.
- `retain_freed_memory()`: glibc keeps freed large blocks for reuse instead of unmapping them
  (a CPU training step's page faults, saved).
"""

from tephra.core.config import from_dict, load_config, parse_overrides, split_cli, to_dict
from tephra.core.errors import (
    BatchError,
    CheckpointError,
    ConfigError,
    InputError,
    RegistryError,
    TephraError,
)
from tephra.core.host_memory import retain_freed_memory
from tephra.core.machine import cache_root, cpu_flags, cpu_name, decided_once_per_machine
from tephra.core.registry import Registry, unknown_name_message

__all__ = [
    "BatchError",
    "CheckpointError",
    "ConfigError",
    "InputError",
    "Registry",
    "RegistryError",
    "TephraError",
    "cache_root",
    "cpu_flags",
    "cpu_name",
    "decided_once_per_machine",
    "from_dict",
    "load_config",
    "parse_overrides",
    "retain_freed_memory",
    "split_cli",
    "to_dict",
    "unknown_name_message",
]
