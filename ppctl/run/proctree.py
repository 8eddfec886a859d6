"""torchrun's process tree: who is whose child (from ``/proc``), and signalling the workers or killing the job.

torchrun starts each worker in a session of its own, so a signal to torchrun's process group does not
reach them: the launcher finds them as torchrun's children and its descendants by the parent table.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path


def read_parent_table(proc: Path = Path("/proc")) -> dict[int, int] | None:
    """pid -> parent pid of every process, from ``/proc/<pid>/stat``; None where there is no ``/proc``."""
    if not (proc / "self" / "stat").exists():
        return None
    parents = {}
    for stat in proc.glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # the process ended while we looked
            continue
        parents[int(stat.parent.name)] = parent_of_stat(text)
    return parents


def parent_of_stat(stat_line: str) -> int:
    """The parent pid in a ``/proc/<pid>/stat`` line: ``pid (comm) state ppid ...``; comm may hold spaces and ')'."""
    return int(stat_line[stat_line.rindex(")") + 1:].split()[1])


def children(parents: dict[int, int], pid: int) -> list[int]:
    """The pids whose parent is ``pid``, sorted."""
    return sorted(child for child, parent in parents.items() if parent == pid)


def descendants(parents: dict[int, int], pid: int) -> list[int]:
    """Every pid below ``pid`` in the process tree (children first, then theirs), ``pid`` itself excluded."""
    found, frontier = [], [pid]
    while frontier:
        frontier = [child for parent in frontier for child in children(parents, parent)]
        found += frontier
    return found


def terminate_workers(torchrun_pid: int, already: set[int], signum: int = signal.SIGTERM) -> set[int]:
    """Send ``signum`` (SIGTERM or SIGINT: a worker stops on either after its step) to torchrun's workers (its
    children) not in ``already``; return the pids signalled.

    Only the workers: their own children (if any) stop with them. Without ``/proc`` torchrun itself
    gets a SIGTERM and stops its workers its own way (it takes SIGINT as a failure).
    """
    parents = read_parent_table()
    targets = [torchrun_pid] if parents is None else children(parents, torchrun_pid)
    if parents is None:
        signum = signal.SIGTERM
    signalled = set()
    for pid in targets:
        if pid not in already:
            _send(pid, signum)
            signalled.add(pid)
    return signalled


def kill_job(torchrun_pid: int) -> None:
    """SIGKILL torchrun's descendants (each worker runs in a session of its own) and torchrun's process group."""
    parents = read_parent_table() or {}
    for pid in descendants(parents, torchrun_pid):
        _send(pid, signal.SIGKILL)
    try:
        os.killpg(torchrun_pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        _send(torchrun_pid, signal.SIGKILL)


def _send(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass
