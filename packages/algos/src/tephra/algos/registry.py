"""The registries of `tephra.algos` use tephra's one `Registry` type (`tephra.core`)."""

from tephra.core.registry import Registry, unknown_name_message

__all__ = ["Registry", "unknown_name_message"]
