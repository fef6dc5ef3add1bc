"""Silence warnings about installed packages' own source code, which no user of a run can act on."""

from __future__ import annotations

import warnings

INSTALLED_CODE = r".*[/\\](site|dist)-packages[/\\]"
"""The module a compile-time warning names is its file's path: anything under site-packages."""


def quiet_third_party_warnings() -> None:
    """Drop `SyntaxWarning`s raised while compiling installed packages (reasoning-gym's
    cellpylib prints several on every import when bytecode is not cached, e.g. under
    `PYTHONDONTWRITEBYTECODE=1`, in every Ray worker). Warnings from tephra and from the
    user's own files are kept."""
    warnings.filterwarnings("ignore", category=SyntaxWarning, module=INSTALLED_CODE)
