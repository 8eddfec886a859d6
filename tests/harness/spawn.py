"""Helpers for multi-process tests: run a function on N gloo workers with a time limit.

Each worker is a fresh process with one intra-op thread, joined to a gloo process group
on a free local port. A worker that raises fails the whole run with its rank and
traceback; a run that exceeds its time limit is killed, never hangs.

Workers are forked from one forkserver per session (``worker_context``) that has imported
torch and every ppctl module once: a new worker then costs a fork, not seconds of imports
(what made starting a world cost more than most cases). The forkserver runs nothing but
those imports (no op, no thread pool, no process group), so each worker starts as clean as
a spawned one; like a spawned one it takes its parent's working directory and ``sys.path``,
but its environment is the session's as it was when the forkserver started.
"""

from __future__ import annotations

import datetime
import os
import pickle
import socket
import traceback
from typing import Any, Callable


def free_port() -> int:
    """Return a TCP port on localhost that is free right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# Imported by the forkserver before it forks any worker (tests/harness/preload.py imports every ppctl module).
PRELOAD = ["tests.harness.preload"]


def worker_context():
    """The multiprocessing context the test workers start from: a forkserver with torch and ppctl loaded."""
    import torch.multiprocessing as mp

    context = mp.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    return context


def _worker_entry(rank, world_size, port, fn, args, result_queue):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    try:
        dist.init_process_group(
            "gloo", rank=rank, world_size=world_size,
            timeout=datetime.timedelta(seconds=60),
        )
        value = fn(rank, world_size, *args)
        # Plain pickle copies tensor data: torch's shared-memory handles would vanish with this process.
        result_queue.put((rank, "ok", pickle.dumps(value)))
    except BaseException:  # report every failure, including assertion errors
        result_queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_workers(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo workers.

    ``fn`` must be importable (module level). Returns the list of return values
    by rank (they must be picklable). Raises ``RuntimeError`` naming the first
    failing rank with its traceback, or ``TimeoutError`` after ``timeout`` seconds.
    """
    import queue as queue_module
    import time

    ctx = worker_context()
    result_queue = ctx.Queue()
    port = free_port()
    processes = [
        ctx.Process(target=_worker_entry, args=(rank, world_size, port, fn, args, result_queue), daemon=True)
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"workers did not finish within {timeout:.0f}s; done: {sorted(results)}")
            try:
                rank, status, value = result_queue.get(timeout=min(remaining, 1.0))
            except queue_module.Empty:
                dead = [r for r, p in enumerate(processes) if p.exitcode not in (None, 0) and r not in results]
                if dead:
                    raise RuntimeError(f"worker rank {dead[0]} died with exit code {processes[dead[0]].exitcode}")
                continue
            if status == "error":
                raise RuntimeError(f"worker rank {rank} failed:\n{value}")
            results[rank] = pickle.loads(value)
    finally:
        for process in processes:
            process.join(timeout=5)
            if process.is_alive():
                process.kill()
    return [results[rank] for rank in range(world_size)]
