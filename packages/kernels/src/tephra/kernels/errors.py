"""The one error type of tephra.kernels: bad arguments, named by field with the fix."""

from tephra.core.errors import InputError


class KernelInputError(InputError):
    """An argument of a kernel call has the wrong shape, dtype, device or value.

    The message names the argument, what was given and what is expected.
    """
