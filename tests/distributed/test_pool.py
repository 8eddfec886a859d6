"""The session's worker pools: cases share workers, and a failing, hanging, dying or leaking case fails alone.

Each case below runs on the pool of 2 workers; after every broken case the next one must
pass on a fresh pool, with the same fresh state a first case sees.
"""

import pytest

from tests.harness.pool import CASE_SEED, POOLS, run_workers

pytestmark = [pytest.mark.dist, pytest.mark.timeout(120)]


def _identity_and_state(rank, world_size):
    """(pid, rank, the first random number of the case, subgroups alive, sum of ranks over a new subgroup)."""
    import os

    import torch
    import torch.distributed as dist

    from tests.harness.pool import _process_groups

    groups_before = len(_process_groups())
    group = dist.new_group(list(range(world_size)))
    total = torch.tensor([float(rank)])
    dist.all_reduce(total, group=group)
    return os.getpid(), rank, torch.rand(1).item(), groups_before, total.item()


def _fail_on_rank_one(rank, world_size):
    import torch
    import torch.distributed as dist

    if rank == 1:
        raise ValueError("injected failure on rank 1")
    dist.all_reduce(torch.zeros(1))  # rank 0 waits on the failed rank: the pool must not wait with it


def _die_on_rank_zero(rank, world_size):
    import os

    if rank == 0:
        os._exit(3)
    import time
    time.sleep(60)


def _hang(rank, world_size):
    import time
    time.sleep(60)


def _leak_a_patch(rank, world_size):
    from ppctl.model import stages

    stages.MaskedTokenLoss.__call__ = lambda self, losses, microbatch: None  # never restored


def _leak_a_setting(rank, world_size):
    import torch

    torch.set_default_dtype(torch.float64)


def test_cases_share_workers_and_start_from_the_same_state():
    first = run_workers(_identity_and_state, 2)
    second = run_workers(_identity_and_state, 2)
    assert [pid for pid, *_ in first] == [pid for pid, *_ in second]  # the same processes
    import torch

    expected = torch.Generator().manual_seed(CASE_SEED)
    draw = torch.rand(1, generator=expected).item()
    for _pid, rank, random_value, groups_before, total in first + second:
        assert random_value == draw  # seeded alike whatever ran before
        assert groups_before == 0  # the earlier case's subgroup was destroyed
        assert total == 1.0


BROKEN_CASES = [
    (_fail_on_rank_one, RuntimeError, "(?s)worker rank 1 failed:.*injected failure on rank 1"),
    (_die_on_rank_zero, RuntimeError, "worker rank 0 died with exit code 3"),
    (_hang, TimeoutError, "workers did not finish within 1s"),
    (_leak_a_patch, RuntimeError, "left state behind: ppctl attribute replaced: ppctl.model.stages.MaskedTokenLoss.__call__"),
    (_leak_a_setting, RuntimeError, "left state behind: torch setting default_dtype changed"),
]


def test_a_broken_case_fails_alone_named_and_the_next_runs_on_a_fresh_pool():
    """Each broken case in turn (raises, dies, hangs, leaves a patch, leaves a setting): named, then a fresh pool."""
    before = [pid for pid, *_ in run_workers(_identity_and_state, 2)]
    for case, error, message in BROKEN_CASES:
        with pytest.raises(error, match=message):
            run_workers(case, 2, timeout=1 if case is _hang else 60)
        assert not POOLS.pools[2].processes, case.__name__  # torn down: nothing of the broken case survives
        after = run_workers(_identity_and_state, 2)
        assert set(before).isdisjoint(pid for pid, *_ in after), case.__name__
        assert all(total == 1.0 and groups_before == 0 for *_, groups_before, total in after), case.__name__
        before = [pid for pid, *_ in after]


def _threads(rank, world_size):
    """This worker's thread count (Linux)."""
    import os

    return len(os.listdir("/proc/self/task"))


def _groups_in_a_cycle(rank, world_size):
    """Three subgroups held by a reference cycle, as a case's contexts and trainers hold theirs."""
    import torch.distributed as dist

    holder = {"groups": [dist.new_group(list(range(world_size))) for _ in range(3)]}
    holder["self"] = holder


def test_a_cases_groups_and_their_threads_end_with_it():
    """The pool destroys a case's groups and collects what still held them: their gloo threads end too, so a
    long-lived worker does not gather the threads of every case it ran."""
    run_workers(_groups_in_a_cycle, 2)  # the first groups also start what every later one shares
    before = run_workers(_threads, 2)
    for _ in range(3):
        run_workers(_groups_in_a_cycle, 2)
    assert run_workers(_threads, 2) == before  # without the collection: 9 more per case and rank
