"""A failed launch in one line: the rank that failed first and why, or the log that could not be written.

A worker that raises writes ``errors/rank<N>.txt`` (its exception's first line, then the traceback);
torchrun stops the others and logs its failure report. The rank named is the one that failed first,
not the peers that failed because of it (a lost connection, torchrun's SIGTERM).
"""

from __future__ import annotations

import os
import re
import signal
from dataclasses import dataclass
from pathlib import Path

from ppctl.checkpoint.files import CheckpointError, latest_checkpoint
from ppctl.fileio import mount_point

# A worker whose error says a peer went away failed because another one did: gloo's socket errors, and NCCL's
# remote error, the abort of a communicator a failed peer shared, and its watchdog's timeout of a collective that a
# dead or stuck peer never joined.
PEER_LOST_MARKERS = ("closed by peer", "reset by peer", "Broken pipe", "remote process exited", "ncclRemoteError",
                     "communicator was aborted", "Watchdog caught collective operation timeout")


@dataclass(frozen=True)
class WorkerExit:
    """One failed worker as torchrun's failure report lists it."""

    rank: int
    exitcode: int


_FAILURE_RECORD = re.compile(r"rank\s*:\s*(\d+)[^\n]*\n\s*exitcode\s*:\s*(-?\d+)")


def torchrun_failures(log_text: str) -> list[WorkerExit]:
    """The failed workers in torchrun's last failure report: its root cause first, then the others."""
    start = log_text.rfind("Failures:")
    if start < 0:
        return []
    root = log_text.find("Root Cause", start)
    end = root if root >= 0 else len(log_text)
    others = [WorkerExit(int(m.group(1)), int(m.group(2))) for m in _FAILURE_RECORD.finditer(log_text, start, end)]
    first = _FAILURE_RECORD.search(log_text, root) if root >= 0 else None
    return ([WorkerExit(int(first.group(1)), int(first.group(2)))] if first else []) + others


def exit_cause(exitcode: int) -> str:
    """``killed by signal 9`` or ``exit code 1``."""
    return f"killed by signal {-exitcode}" if exitcode < 0 else f"exit code {exitcode}"


def is_consequence(cause: str) -> bool:
    """Whether a worker's end follows from another's: stopped by torchrun's SIGTERM, or it lost a peer."""
    return cause == exit_cause(-signal.SIGTERM) or any(marker in cause for marker in PEER_LOST_MARKERS)


def first_failure(exits: list[WorkerExit], errors: dict[int, str]) -> tuple[int, str] | None:
    """The rank that failed first and its cause, or None when nothing names one.

    ``exits``: torchrun's failed workers, its root cause first; ``errors``: rank -> the first line of
    its error file, oldest first. torchrun's root cause is the failure it saw first, to the second;
    a peer that lost its connection to a killed rank ends within milliseconds and may come first, so
    a rank whose end is a consequence of another's (``is_consequence``) is named only if all are.
    """
    candidates = [(worker.rank, errors.get(worker.rank) or exit_cause(worker.exitcode)) for worker in exits]
    listed = {worker.rank for worker in exits}
    candidates += [(rank, line) for rank, line in errors.items() if rank not in listed]
    if not candidates:
        return None
    primary = [candidate for candidate in candidates if not is_consequence(candidate[1])]
    return (primary or candidates)[0]


def describe_failure(run_dir: Path, log_path: Path, returncode: int, log_start: int = 0,
                     since: float = 0.0) -> str:
    """One line: the first rank that failed and why (its exception, or its exit signal).

    Only this launch counts: the log from byte ``log_start`` and error files written after ``since``
    (a resumed run reuses its run directory).
    """
    log_text = ""
    if log_path.exists():
        with open(log_path, "rb") as log_file:
            log_file.seek(log_start)
            log_text = log_file.read().decode(errors="replace")
    found = first_failure(torchrun_failures(log_text), error_lines(run_dir, since))
    if found is None:
        return f"torchrun exited with code {returncode} (log: {log_path})"
    rank, cause = found
    return f"worker rank {rank} failed: {cause} (log: {log_path})"


def error_lines(run_dir: Path, since: float = 0.0) -> dict[int, str]:
    """rank -> the first line of its ``errors/rank<N>.txt`` (written after ``since``, to the second), oldest first."""
    files = []
    for path in (run_dir / "errors").glob("rank*.txt"):
        try:
            modified, lines = path.stat().st_mtime, path.read_text(errors="replace").strip().splitlines()
        except OSError:
            continue
        if modified >= since - 1.0 and lines and path.stem.removeprefix("rank").isdigit():
            files.append((modified, int(path.stem.removeprefix("rank")), lines[0]))
    return {rank: line for _, rank, line in sorted(files)}


def describe_log_failure(log_path: Path, error: OSError, run_dir: Path) -> str:
    """One line: the log could not be written (why, and on which file system), the job was stopped, and what of
    the run is saved (its last complete checkpoint, if any)."""
    try:
        checkpoint = latest_checkpoint(run_dir)
    except CheckpointError:
        checkpoint = None
    if checkpoint is not None and checkpoint.is_dir():
        saved = (f"the last complete checkpoint is {checkpoint}: free space, then resume with "
                 f"trainer.resume_from={run_dir}")
    else:
        saved = "no checkpoint of this run was saved"
    reason = error.strerror or str(error)
    return (f"cannot write {log_path}: {reason} (the file system mounted at {mount_point(run_dir)}); "
            f"the workers were stopped; {saved}")
