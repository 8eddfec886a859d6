"""The `slurm_cluster` fixture: one private slurmctld + slurmd on localhost per test session (cluster.py)."""

import os

import pytest

from tests.slurm.cluster import LocalSlurm, missing_commands


def skip_reason() -> str | None:
    """Why the local cluster cannot run here, or None when it can."""
    missing = missing_commands()
    if missing:
        return f"Slurm not installed ({', '.join(missing)} not on PATH): run `make slurm-setup` as root"
    if os.geteuid() != 0:
        return "the local Slurm cluster needs root (slurmd runs jobs as their user)"
    return None


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    """A started LocalSlurm, shared by the session's tests and stopped at its end (also when tests fail)."""
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    cluster = LocalSlurm(tmp_path_factory.mktemp("slurm"))
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()
