"""Long-lived gloo worker pools for the multi-process tests: one pool per world size, kept for the session.

Starting a world costs more than most cases: every worker is a fresh process (forked from the
session's forkserver, which has imported torch and ppctl once: ``tests.harness.spawn.worker_context``)
that joins a new gloo group. A pool starts ``world_size`` workers once; each then runs
case after case, ``fn(rank, world_size, *args)``, in the same process group. Each case builds
its own subgroups (destroyed when it ends) and starts from the same state: seeds, one
intra-op thread, float32 default dtype, grad mode on. After a case every worker checks that it
left nothing behind (no patched ppctl attribute, no changed torch setting, no process group
of its own still alive, the default group still answering) and the case fails, named, if it did.

A case that raises on any rank, runs past its time limit or loses a worker fails alone: the
pool is torn down (every worker killed, so no rank waits on a collective forever) and the
next case starts a fresh one. ``run_workers`` keeps the signature of ``tests.harness.spawn``'s.
"""

from __future__ import annotations

import datetime
import gc
import itertools
import os
import pickle
import queue as queue_module
import sys
import time
import traceback
from typing import Any, Callable

from tests.harness.backend import chosen_backend, gpu_count, missing_gpus, rank_device
from tests.harness.spawn import free_port, worker_context

CASE_SEED = 1234


def _ppctl_fingerprint() -> dict[str, int]:
    """``module.attribute`` (and ``module.Class.attribute``) -> id of the object, for every loaded ppctl module.

    A case that monkeypatches ppctl and forgets to restore it changes one of these ids.
    """
    fingerprint = {}
    for module_name, module in list(sys.modules.items()):
        if not module_name.startswith("ppctl") or module is None:
            continue
        for name, value in list(vars(module).items()):
            fingerprint[f"{module_name}.{name}"] = id(value)
            if isinstance(value, type) and value.__module__ == module_name:
                for attribute, member in list(vars(value).items()):
                    fingerprint[f"{module_name}.{name}.{attribute}"] = id(member)
    return fingerprint


def _torch_settings() -> dict[str, Any]:
    """The process-wide torch settings a case may change and must put back."""
    import torch

    return {"num_threads": torch.get_num_threads(), "default_dtype": torch.get_default_dtype(),
            "grad_enabled": torch.is_grad_enabled(), "anomaly": torch.is_anomaly_enabled(),
            "deterministic": torch.are_deterministic_algorithms_enabled()}


def _process_groups() -> set:
    """Every live process group other than the default one."""
    import torch.distributed.distributed_c10d as c10d

    return {group for group in c10d._world.pg_map if group is not c10d.GroupMember.WORLD}


def _start_case() -> None:
    """The state every case starts from, whatever ran before."""
    import random

    import numpy
    import torch

    torch.manual_seed(CASE_SEED)
    random.seed(CASE_SEED)
    numpy.random.seed(CASE_SEED)


def _leftovers(fingerprint: dict[str, int], settings: dict[str, Any], groups: set) -> list[str]:
    """What the case left behind: changed ppctl attributes and torch settings, its own process groups."""
    import torch.distributed as dist

    now = _ppctl_fingerprint()
    changed = sorted(name for name, ident in fingerprint.items() if name in now and now[name] != ident)
    found = [f"ppctl attribute replaced: {name}" for name in changed[:5]]
    found += [f"torch setting {key} changed: {settings[key]} -> {value}"
              for key, value in _torch_settings().items() if settings[key] != value]
    for group in _process_groups() - groups:  # the case's subgroups: destroyed, they must not reach the next
        dist.destroy_process_group(group)
    # A destroyed group lives on while the case's objects (contexts, trainers: reference cycles) still hold it,
    # and so do its gloo threads (three per group): without a collection here a long-lived worker gathered
    # hundreds, whose loops kept the machine busy (a pool worker at 30% CPU between cases, most of it in the
    # kernel), slowing every test after them.
    gc.collect()
    return found


def _run_case(rank: int, world_size: int, fn: Callable, args: tuple) -> tuple[str, Any]:
    """One case on this worker: ("ok", result), ("error", traceback) or ("leak", what was left behind)."""
    import torch.distributed as dist

    fingerprint, settings, groups = _ppctl_fingerprint(), _torch_settings(), _process_groups()
    _start_case()
    try:
        value = fn(rank, world_size, *args)
    except BaseException:  # report every failure, assertion errors included
        return "error", traceback.format_exc()
    left = _leftovers(fingerprint, settings, groups)
    dist.barrier()  # the default group still answers on every rank
    if left:
        return "leak", "; ".join(left)
    # Plain pickle copies tensor data: torch's shared-memory handles would vanish with this process.
    return "ok", pickle.dumps(value)


def _import_ppctl() -> None:
    """Import every ppctl module once, so each case's leftovers are checked everywhere (and cost no import)."""
    import importlib
    import pkgutil

    import ppctl

    for module in pkgutil.walk_packages(ppctl.__path__, "ppctl."):
        importlib.import_module(module.name)


def _pool_worker(rank: int, world_size: int, port: int, backend: str, tasks, results) -> None:
    """A pool worker: join the world once (gloo, or NCCL on GPU ``rank``), then run cases from ``tasks`` until the
    pool kills it."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    _import_ppctl()
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    device_id = None
    if backend == "nccl":  # as ppctl's worker does: its own GPU, communicators made eagerly on it
        device_id = torch.device(rank_device(backend, rank))
        torch.cuda.set_device(device_id)
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=60),
                            device_id=device_id)
    while True:  # until the pool kills this worker
        case_id, fn, args = tasks.get()
        results.put((case_id, rank, *_run_case(rank, world_size, fn, args)))


class WorkerPool:
    """``world_size`` workers (``backend``: gloo or NCCL) that run many cases; torn down on a failure, started
    again on demand."""

    def __init__(self, world_size: int, backend: str = "gloo"):
        self.world_size = world_size
        self.backend = backend
        self.processes: list = []
        self.cases = itertools.count()

    def _start(self) -> None:
        context = worker_context()
        self.results = context.Queue()
        self.tasks = [context.Queue() for _ in range(self.world_size)]
        port = free_port()
        self.processes = [context.Process(target=_pool_worker, daemon=True,
                                          args=(rank, self.world_size, port, self.backend, self.tasks[rank],
                                                self.results))
                          for rank in range(self.world_size)]
        for process in self.processes:
            process.start()

    def run(self, fn: Callable[..., Any], args: tuple, timeout: float) -> list[Any]:
        """``fn(rank, world_size, *args)`` on every worker; the results by rank. Raises (and tears the pool
        down) on the first failing rank, a dead worker, a leak or the time limit."""
        if not self.processes:
            self._start()
        case_id = next(self.cases)
        for task_queue in self.tasks:
            task_queue.put((case_id, fn, args))
        try:
            return self._collect(case_id, timeout)
        except BaseException:
            self.close()
            raise

    def _collect(self, case_id: int, timeout: float) -> list[Any]:
        results: dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        while len(results) < self.world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"workers did not finish within {timeout:.0f}s; done: {sorted(results)}")
            try:
                done_id, rank, status, value = self.results.get(timeout=min(remaining, 1.0))
            except queue_module.Empty:
                dead = [rank for rank, process in enumerate(self.processes) if process.exitcode is not None]
                if dead:
                    raise RuntimeError(f"worker rank {dead[0]} died with exit code {self.processes[dead[0]].exitcode}")
                continue
            assert done_id == case_id, "a result of an earlier case"  # impossible: a failed case kills the pool
            if status == "error":
                raise RuntimeError(f"worker rank {rank} failed:\n{value}")
            if status == "leak":
                raise RuntimeError(f"worker rank {rank}: the case left state behind: {value}")
            results[rank] = pickle.loads(value)
        return [results[rank] for rank in range(self.world_size)]

    def close(self) -> None:
        """Kill every worker at once (a worker may be blocked in a collective: nothing waits for it)."""
        for process in self.processes:
            process.kill()
            process.join(timeout=5)
        self.processes = []


class WorkerPools:
    """One ``WorkerPool`` per world size, started when first asked for, on the suite's backend
    (``tests/harness/backend.py``)."""

    def __init__(self, backend: str = "gloo"):
        self.backend = backend
        self.pools: dict[int, WorkerPool] = {}

    def run(self, fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0) -> list[Any]:
        """Run ``fn(rank, world_size, *args)`` on the pool of ``world_size`` workers (see ``WorkerPool.run``);
        skips the test where the backend needs more GPUs than the machine has."""
        if self.backend != "gloo":
            reason = missing_gpus(self.backend, world_size, gpu_count())
            if reason:
                import pytest

                pytest.skip(reason)
        pool = self.pools.setdefault(world_size, WorkerPool(world_size, self.backend))
        return pool.run(fn, args, timeout)

    def close(self) -> None:
        """Stop every pool."""
        for pool in self.pools.values():
            pool.close()
        self.pools.clear()


# The session's pools: opened on first use, closed by the session fixture in tests/conftest.py.
POOLS = WorkerPools(chosen_backend())


def run_workers(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on the session's pool of ``world_size`` workers (gloo, or NCCL with
    ``PPCTL_TEST_BACKEND=nccl``).

    ``fn`` must be importable (module level) and its results picklable. Raises ``RuntimeError``
    naming the first failing rank with its traceback, or ``TimeoutError`` after ``timeout`` seconds.
    """
    return POOLS.run(fn, world_size, *args, timeout=timeout)
