import pytest

from ppctl.testing import run_workers


def _allreduce_rank(rank, world_size):
    import torch
    import torch.distributed as dist

    value = torch.tensor([float(rank)])
    dist.all_reduce(value)
    return value.item()


def _fail_on_rank_one(rank, world_size):
    if rank == 1:
        raise ValueError("boom")
    return rank


@pytest.mark.timeout(60)
def test_run_workers_collects_results():
    assert run_workers(_allreduce_rank, 3) == [3.0, 3.0, 3.0]


@pytest.mark.timeout(60)
def test_run_workers_names_failing_rank():
    with pytest.raises(RuntimeError, match="rank 1 failed"):
        run_workers(_fail_on_rank_one, 2, timeout=30)
