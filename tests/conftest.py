"""Session-wide fixtures: the long-lived gloo worker pools of the multi-process tests (tests/pool.py)."""

import pytest

from tests.pool import POOLS


@pytest.fixture(scope="session", autouse=True)
def worker_pools():
    """Close every worker pool when the session ends (pools start on a test's first use)."""
    yield POOLS
    POOLS.close()


def pytest_runtest_teardown(item, nextitem):
    """Close the pools when the run leaves a test folder (tests/distributed, say): idle workers and the threads
    they keep would otherwise load the cores under every later folder's tests. A later case that needs a pool
    starts it again (a fork of the preloaded forkserver: a fraction of a second)."""
    if nextitem is not None and _folder(nextitem) != _folder(item):
        POOLS.close()


def _folder(item) -> str:
    """The test's folder under tests/ (``distributed``, ``cli``, ...)."""
    return item.nodeid.split("/")[1] if item.nodeid.count("/") >= 2 else ""
