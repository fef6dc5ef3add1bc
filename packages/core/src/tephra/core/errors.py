"""The one error tree of tephra. Every error raised on purpose derives from `TephraError` and
says, for people, which field or input is wrong, the value it got and the fix.

The leaves also derive from the builtin types callers already catch (`ValueError`,
`KeyError`, `RuntimeError`).
"""


class TephraError(Exception):
    """Base class of every error tephra raises on purpose."""


class ConfigError(TephraError, ValueError):
    """A configuration field holds a value that cannot work."""


class InputError(TephraError, ValueError):
    """A function argument (a tensor, a list) has the wrong shape, dtype or content."""


class BatchError(InputError):
    """A batch is missing a field, has the wrong shape or dtype, or breaks a budget."""


class RegistryError(TephraError, KeyError):
    """A name was looked up that nothing registered, or a name was registered twice."""

    def __str__(self) -> str:  # KeyError quotes its message; people want it plain
        return str(self.args[0]) if self.args else ""


class CheckpointError(TephraError, RuntimeError):
    """A checkpoint is missing, incomplete, or belongs to another model."""


def tephra_cause(exc: BaseException) -> TephraError | None:
    """The `TephraError` that `exc` is or wraps, else None.

    Ray re-raises a worker's exception in the driver as a `RayTaskError` holding it in
    `.cause` (also when Ray cannot make the subclass of both), and its text is the worker's
    whole traceback; an app prints the cause's one line instead."""
    seen: set[int] = set()
    while id(exc) not in seen:
        seen.add(id(exc))
        inner = getattr(exc, "cause", None)  # RayTaskError's public attribute (core has no Ray)
        if not isinstance(inner, BaseException):
            break
        exc = inner
    return exc if isinstance(exc, TephraError) else None
