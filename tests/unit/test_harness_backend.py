"""``PPCTL_TEST_BACKEND``: the multi-process harness on gloo (the default) or NCCL with one GPU per rank
(tests/harness/backend.py). On a machine without enough GPUs the NCCL harness skips, named; the tests not marked
``nccl`` skip under it with the reason."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness.backend import chosen_backend, gloo_only_reason, missing_gpus, rank_device
from tests.harness.pool import WorkerPools

REPO = Path(__file__).resolve().parents[2]


def test_the_backend_is_gloo_unless_the_variable_names_nccl():
    assert chosen_backend({}) == "gloo"
    assert chosen_backend({"PPCTL_TEST_BACKEND": ""}) == "gloo"
    assert chosen_backend({"PPCTL_TEST_BACKEND": " NCCL "}) == "nccl"
    with pytest.raises(ValueError, match=r"PPCTL_TEST_BACKEND='mpi': must be one of gloo, nccl"):
        chosen_backend({"PPCTL_TEST_BACKEND": "mpi"})


def test_each_nccl_rank_takes_its_own_gpu_and_a_world_larger_than_the_gpus_is_named():
    assert [rank_device("nccl", rank) for rank in range(3)] == ["cuda:0", "cuda:1", "cuda:2"]
    assert rank_device("gloo", 3) == "cpu"
    assert missing_gpus("nccl", 4, 4) is None
    assert missing_gpus("gloo", 8, 0) is None
    assert missing_gpus("nccl", 4, 1) == "PPCTL_TEST_BACKEND=nccl: a world of 4 ranks needs 4 GPUs, this machine has 1"
    assert gloo_only_reason("gloo") is None
    assert "marked nccl" in gloo_only_reason("nccl")


def _never_called(rank, world_size):
    raise AssertionError("a world without its GPUs must not start")


def test_an_nccl_pool_without_its_gpus_skips_before_starting_a_worker(monkeypatch):
    monkeypatch.setattr("tests.harness.pool.gpu_count", lambda: 1)
    pools = WorkerPools("nccl")
    with pytest.raises(pytest.skip.Exception, match="a world of 2 ranks needs 2 GPUs, this machine has 1"):
        pools.run(_never_called, 2)
    assert pools.pools == {}


@pytest.mark.timeout(120)
def test_under_nccl_only_the_marked_tests_run_and_each_other_one_says_why():
    """A real pytest session with PPCTL_TEST_BACKEND=nccl on this machine: the marked equivalence test skips for
    its GPUs (4 ranks; a machine with 4 GPUs would run it), the unmarked one for being gloo-only."""
    environment = {**os.environ, "PPCTL_TEST_BACKEND": "nccl", "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                             "tests/distributed/test_uneven_layouts.py"],
                            cwd=REPO, env=environment, capture_output=True, text=True, timeout=110)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "2 skipped" in result.stdout, result.stdout[-2000:]
    assert "a world of 4 ranks needs 4 GPUs, this machine has 0" in result.stdout
    assert "runs only the tests marked nccl" in result.stdout
