"""Every package and app ships a `py.typed` marker, so type checkers read its annotations."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_every_package_has_py_typed() -> None:
    packages = [
        d
        for pattern in ("packages/*/src/tephra/*", "apps/*/src/tephra/apps/*")
        for d in sorted(ROOT.glob(pattern))
        if (d / "__init__.py").exists()
    ]
    assert len(packages) >= 11, [str(p) for p in packages]  # 8 packages and 3 apps at least
    missing = [str(d.relative_to(ROOT)) for d in packages if not (d / "py.typed").exists()]
    assert not missing, f"add an empty py.typed to: {missing}"
