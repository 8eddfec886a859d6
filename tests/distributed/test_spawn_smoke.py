"""run_workers: one process per rank, results returned by rank, a failing rank named with its error."""

import pytest

from tests.harness.spawn import run_workers


def _allreduce_rank(rank, world_size):
    """This worker's rank, world size, process id and the all-reduced sum of (rank + 1) squared."""
    import os

    import torch
    import torch.distributed as dist

    value = torch.tensor([float(rank + 1) ** 2])
    dist.all_reduce(value)
    return dist.get_rank(), dist.get_world_size(), os.getpid(), value.item()


def _fail_on_rank_one(rank, world_size):
    if rank == 1:
        raise ValueError("boom")
    return rank


@pytest.mark.timeout(60)
def test_run_workers_collects_results():
    """Results come back in rank order, each from its own process of the right rank, the sum over all of them."""
    results = run_workers(_allreduce_rank, 3)
    assert [(rank, world) for rank, world, _, _ in results] == [(0, 3), (1, 3), (2, 3)]
    assert len({pid for _, _, pid, _ in results}) == 3
    assert [value for *_, value in results] == [14.0, 14.0, 14.0]  # 1 + 4 + 9


@pytest.mark.timeout(60)
def test_run_workers_names_failing_rank():
    """The failing rank is named and its traceback carries the exception."""
    with pytest.raises(RuntimeError, match="rank 1 failed") as failure:
        run_workers(_fail_on_rank_one, 2, timeout=30)
    assert "ValueError: boom" in str(failure.value)
