"""Fixtures of the cross-package tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def ray_session():
    """One local Ray session for a test module (a fresh one: a session another module left
    behind in this process could still hold its resources)."""
    import ray

    from tephra.controller.worker_group import ray_init

    if ray.is_initialized():
        ray.shutdown()
    ray_init(num_cpus=2)
    yield
    ray.shutdown()
