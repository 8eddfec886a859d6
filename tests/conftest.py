"""Session-wide fixtures: the long-lived gloo worker pools of the multi-process tests (tests/pool.py)."""

import pytest

from tests.pool import POOLS


@pytest.fixture(scope="session", autouse=True)
def worker_pools():
    """Close every worker pool when the session ends (pools start on a test's first use)."""
    yield POOLS
    POOLS.close()
