"""Session-wide fixtures: the long-lived worker pools of the multi-process tests (tests/harness/pool.py), and the
backend they run on (tests/harness/backend.py: gloo, or NCCL with ``PPCTL_TEST_BACKEND=nccl``)."""

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from ppctl.run.launch import INDUCTOR_CACHE_ENV as INDUCTOR_CACHE
from tests.harness.backend import chosen_backend, gloo_only_reason
from tests.harness.pool import POOLS


OWN_INDUCTOR_CACHE = pytest.StashKey[str]()


def pytest_configure(config):
    """One inductor cache folder for the whole suite run (``trainer.compile``'s tests): set here, in the first pytest
    process, before any worker starts, so that every process of the run (pytest-xdist's, their worker pools' and the
    CLI tests' launches) inherits it, and a block shape compiled by one is loaded, not compiled, by the others. A
    fresh folder per run: a stale cache from another torch or ppctl would time the suite wrongly. One set by the
    caller is kept."""
    if INDUCTOR_CACHE not in os.environ:
        os.environ[INDUCTOR_CACHE] = config.stash[OWN_INDUCTOR_CACHE] = tempfile.mkdtemp(prefix="ppctl-inductor-")


def pytest_unconfigure(config):
    """Remove the inductor cache folder this process made (``pytest_configure``) once the run ends."""
    folder = config.stash.get(OWN_INDUCTOR_CACHE, None)
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)
        del os.environ[INDUCTOR_CACHE]


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


def modules_sharing_a_launch() -> frozenset[str]:
    """The multi-process and CLI test modules whose tests share a module-scoped fixture (a launch, a worker pool's
    measurements): each is kept to one pytest process, or every process that runs one of its tests would run the
    fixture again (``make test`` once launched the Hugging Face round trip and the memory measurements twice)."""
    root = Path(__file__).resolve().parent
    return frozenset(str(path.relative_to(root.parent)) for folder in ("cli", "distributed")
                     for path in (root / folder).glob("test_*.py") if 'scope="module"' in path.read_text())


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist: unknown where it is not installed
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadgroup`` with every test under tests/slurm in one work unit, as their ``xdist_group("slurm")`` asks,
    and each module of ``modules_sharing_a_launch`` in one of its own.

    pytest-xdist groups a test by appending ``@group`` to the item's ``_nodeid``, which pytest 9.2 no longer reads
    (a node's id is its ``_id`` there): the group was lost, and each Slurm test went to whichever pytest process was
    free, both processes then starting a cluster and submitting the module's jobs (twice the work, side by side)."""
    if config.getvalue("dist") != "loadgroup":
        return None  # pytest-xdist's own scheduler
    from xdist.scheduler import LoadGroupScheduling

    together = modules_sharing_a_launch()

    class SlurmTogether(LoadGroupScheduling):
        def _split_scope(self, nodeid: str) -> str:
            if nodeid.startswith("tests/slurm/"):
                return "slurm"
            module = nodeid.split("::", 1)[0]
            return module if module in together else super()._split_scope(nodeid)

    return SlurmTogether(config, log)


def pytest_collection_modifyitems(config, items):
    """The Slurm tests first, then the rest in their order; under ``PPCTL_TEST_BACKEND=nccl`` only the
    multi-process tests marked ``nccl`` run (tests/harness/backend.py).

    The Slurm tests are one unit of work for ``make test``'s pytest processes (they share their cluster) and the
    longest, mostly waiting for the scheduler: started first, they run beside everything else rather than
    after it, with the quick unit tests left to fill the end."""
    items.sort(key=lambda item: _folder(item) != "slurm")  # stable: every other test keeps its place
    reason = gloo_only_reason(chosen_backend())
    if reason is None:
        return
    for item in items:
        if _folder(item) == "distributed" and item.get_closest_marker("nccl") is None:
            item.add_marker(pytest.mark.skip(reason=reason))
