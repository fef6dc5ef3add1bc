"""Leave no process group behind: engines built in this process at world size 1 create a
1-rank group and megatron's groups; other packages' tests in the same pytest process must
not inherit them."""

import pytest

from tephra.engine_megatron.parallel_setup import release_process_group


@pytest.fixture(autouse=True, scope="module")
def _release_engine_process_group():
    yield
    release_process_group()
