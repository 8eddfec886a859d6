"""Supervising torchrun while it runs: its stderr copied to ``launcher.log``, and a stop on a signal.

torchrun runs in its own session, so a terminal's Ctrl-C reaches only ``ppctl``. On SIGINT or SIGTERM
``ppctl`` sends that same signal to the workers themselves (torchrun, left alone, sees them end normally;
signalled, it would treat the job as failed and kill them after its own shutdown timeout; the workers
record which signal stopped them), waits up to ``launcher.shutdown_timeout_s`` for torchrun to end, then
kills whatever is left; a second signal kills at once. If ``ppctl`` itself is killed, the parent-death
signal sends torchrun SIGTERM, and torchrun stops its workers. A ``launcher.log`` that cannot be written
(a full disk) stops the job as a signal would.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

from ppctl.run.interrupt import STOP_SIGNALS, ParentDeathSignal
from ppctl.run.proctree import kill_job, terminate_workers

POLL_S = 0.1  # how often the launcher looks at torchrun and at the signals it received
DRAIN_S = 5.0  # how long the launcher still copies torchrun's stderr after torchrun ended


def die_with(parent_pid: int):
    """Popen's ``preexec_fn`` for torchrun: SIGTERM it when ``ppctl`` dies (and do not start if that happened)."""
    death_signal = ParentDeathSignal(signal.SIGTERM)

    def arm() -> None:
        if not death_signal.arm(parent_pid):
            os._exit(1)

    return arm


class SignalInbox:
    """While the launcher runs torchrun, SIGINT and SIGTERM are only recorded; ``supervise`` acts on them."""

    def __init__(self) -> None:
        self.received: list[int] = []
        self._previous: dict[int, object] = {}

    def __enter__(self) -> SignalInbox:
        if threading.current_thread() is threading.main_thread():  # handlers can only be set from there
            for signum in STOP_SIGNALS:
                self._previous[signum] = signal.signal(signum, lambda signum, frame: self.received.append(signum))
        return self

    def __exit__(self, *exc_info) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def take(self) -> list[int]:
        """The signals received since the last call."""
        taken, self.received[:] = list(self.received), []
        return taken


@dataclass
class Stopping:
    """How the job stops (how long the workers get, and what they do meanwhile), and the stop in progress: why
    it began (the first signal, or the log that cannot be written), when to give up waiting (``deadline``, None
    until a stop began), why the job was killed."""

    shutdown_timeout_s: float = 60.0
    notice: str = "the workers finish their step"
    signum: int | None = None
    deadline: float | None = None
    killed: str | None = None
    signalled: set[int] = field(default_factory=set)  # worker pids already sent SIGTERM
    next_scan: float = 0.0  # when to look for workers again
    log_error: OSError | None = None

    @property
    def begun(self) -> bool:
        """Whether a stop is under way."""
        return self.deadline is not None


def supervise(process: subprocess.Popen, inbox: SignalInbox, log_file, stop: Stopping) -> Stopping:
    """Copy torchrun's stderr to the log until it ends, acting on signals every ``POLL_S``; return ``stop``.

    All in this one thread: the parent-death signal is sent each time a thread of the parent that
    holds the child ends, so a second thread here would give torchrun two SIGTERMs when ``ppctl``
    is killed, and torchrun takes a second one as "kill the workers now".
    """
    stderr_fd = process.stderr.fileno()
    stderr_open, drain_until = True, None
    while True:
        if stderr_open and select.select([stderr_fd], [], [], POLL_S)[0]:
            chunk = os.read(stderr_fd, 65536)
            _copy_to_log(log_file, chunk, stop)
            stderr_open = bool(chunk)
        elif not stderr_open:
            time.sleep(POLL_S)
        if process.poll() is None:
            _on_signals(stop, inbox.take(), process.pid)
        elif not stderr_open or (drain_until is not None and time.monotonic() > drain_until):
            break
        elif drain_until is None:  # copy what torchrun left in the pipe; a stray holder may keep it open
            drain_until = time.monotonic() + DRAIN_S
    process.stderr.close()
    return stop


def _copy_to_log(log_file, chunk: bytes, stop: Stopping) -> None:
    """Append torchrun's stderr to the log; once that fails, stop the job and drop the rest (still read, so that
    torchrun never blocks on a full pipe)."""
    if stop.log_error is not None:
        return
    try:
        _append_log(log_file, chunk)
    except OSError as error:
        stop.log_error = error
        if not stop.begun:
            stop.deadline = time.monotonic() + stop.shutdown_timeout_s


def _append_log(log_file, chunk: bytes) -> None:
    """Write all of ``chunk`` to the (unbuffered) log file."""
    view = memoryview(chunk)
    while view:
        view = view[log_file.write(view):]


def _on_signals(stop: Stopping, received: list[int], torchrun_pid: int) -> None:
    """First signal: SIGTERM the workers (again for any that start later); a second one, or the deadline: kill."""
    for signum in received:
        if not stop.begun:
            stop.signum, stop.deadline = signum, time.monotonic() + stop.shutdown_timeout_s
            say(f"stopping ({signal.Signals(signum).name}): {stop.notice}; waiting up to "
                 f"{stop.shutdown_timeout_s:g} s (Ctrl-C again to kill them now)")
        elif stop.killed is None:
            stop.killed = f"on a second signal ({signal.Signals(signum).name})"
            kill_job(torchrun_pid)
    if not stop.begun or stop.killed is not None:
        return
    if time.monotonic() > stop.deadline:
        stop.killed = f"still running {stop.shutdown_timeout_s:g} s after the stop (launcher.shutdown_timeout_s)"
        if stop.log_error is None:  # a log failure ends with its own single line
            say(f"the workers are {stop.killed}: killing them")
        kill_job(torchrun_pid)
    elif time.monotonic() >= stop.next_scan:
        # The user's signal itself, so that the checkpoint says which one stopped the run (a log that cannot be
        # written stops the job as SIGTERM would).
        stop.signalled |= terminate_workers(torchrun_pid, stop.signalled, stop.signum or signal.SIGTERM)
        stop.next_scan = time.monotonic() + POLL_S


def say(line: str) -> None:
    """``line`` on stderr at once (the launcher's own lines, beside torchrun's)."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
