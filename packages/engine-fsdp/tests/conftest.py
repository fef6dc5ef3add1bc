"""Leave no process group behind: engines built in this process at world size 1 create a
1-rank group; other packages' tests in the same pytest process must not inherit it."""

import pytest

from tephra.engine_fsdp.sharding import release_process_group


@pytest.fixture(autouse=True, scope="module")
def _release_engine_process_group():
    yield
    release_process_group()
