"""The errors the server answers to a client with (HTTP 400, or a failed future)."""

from __future__ import annotations

from tephra.core.errors import TephraError


class UserError(TephraError, ValueError):
    """A request the server cannot serve as asked: the message names the call or field and
    what it accepts."""
