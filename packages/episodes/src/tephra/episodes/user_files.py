"""Importing a user's Python file (a reward function, an environment, an agent) by path."""

from __future__ import annotations

import hashlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def import_file(file: Path, prefix: str, reuse: bool = True) -> ModuleType:
    """`file` imported as module `prefix` + a digest of its path, registered in `sys.modules`
    (dataclasses and pickling inside the file need that). With `reuse`, a file imported before
    is not run again. An exception raised while importing propagates, the module unregistered."""
    module_name = prefix + hashlib.sha1(str(file).encode()).hexdigest()[:12]
    if reuse and module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, file)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]
        raise
    return module
