"""Failing on purpose (``launcher.inject_fault``), and what a restarted attempt resumes from.

Faults are a testing aid for the failure paths: ``RANK:raise`` or ``RANK:kill`` fails that rank as
it starts; ``RANK:kill@STEP`` after that step instead, and only in the job's first attempt, so an
elastic restart (``launcher.max_restarts``) can be shown to resume and finish like an uninterrupted run.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

from ppctl.checkpoint.files import latest_checkpoint
from ppctl.resolve import parse_fault


def restart_count() -> int:
    """Which attempt this worker belongs to: 0 first, then torchrun's restarts (``TORCHELASTIC_RESTART_COUNT``)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def inject_fault(spec: str | None, rank: int, done_before: int | None = None, done: int | None = None) -> None:
    """Fail ``rank`` when ``spec`` says so: at start (both counts None) or when this call's steps, those after
    ``done_before`` up to ``done``, include the spec's step (first attempt only)."""
    if not spec:
        return
    fault_rank, kind, at_step = parse_fault(spec)
    if fault_rank != rank:
        return
    if at_step is None:
        if done is not None:
            return
    elif done is None or not done_before < at_step <= done or restart_count() > 0:
        return
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    raise RuntimeError(f"injected fault on rank {rank}" + (f" after step {at_step}" if at_step is not None else ""))


def restart_resume_point(resume_from: str | None, run_dir: Path) -> str | None:
    """Where this attempt starts: a restarted one continues from the run's latest complete checkpoint (what the
    failed attempt saved), else from ``resume_from``, the launch's."""
    if restart_count() > 0:
        latest = latest_checkpoint(run_dir)
        if latest is not None:
            return str(latest)
    return resume_from
