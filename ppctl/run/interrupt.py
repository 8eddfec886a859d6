"""Stopping on a signal, and not outliving the process that started us.

``StopRequest`` is what a training worker installs once its process groups exist: SIGTERM
or SIGINT then only asks for a stop (the trainer finishes its step, every rank agrees, a
checkpoint is saved); a second one ends the worker at once (the copies of one SIGTERM that
arrive together, as in a Slurm job, are one stop). ``ParentDeathSignal`` is
Linux's parent-death signal (``prctl(PR_SET_PDEATHSIG)``): the kernel signals a process
when its parent ends, so that nothing of a job outlives ``ppctl`` even when ``ppctl`` is
killed. Nothing here imports torch: the launcher uses this module too.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time
from typing import Callable

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


# One stop can reach a worker several times at once: Slurm signals every process of a job step (ppctl,
# torchrun and the workers), and ppctl and torchrun each pass the signal on. SIGTERMs within this many
# seconds of the first are that same stop, not the second one that ends the worker at once.
SAME_STOP_S = 5.0


class StopRequest:
    """Turns the first SIGTERM/SIGINT into ``requested = True``; a second one raises ``KeyboardInterrupt``
    (a SIGTERM within ``SAME_STOP_S`` of a first SIGTERM is taken as the same stop).

    ``signal_name`` is the first signal's name (``"SIGTERM"``), None until one came. Use it as a
    context manager, or ``install()`` / ``uninstall()``; it must be installed from the main thread.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.requested = False
        self.signal_name: str | None = None
        self._previous: dict[int, object] = {}
        self._clock = clock
        self._first_at = 0.0

    def install(self) -> StopRequest:
        """Handle SIGTERM and SIGINT from now on (the previous handlers are kept for ``uninstall``)."""
        for signum in STOP_SIGNALS:
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def uninstall(self) -> None:
        """Give SIGTERM and SIGINT their previous handlers back."""
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def __enter__(self) -> StopRequest:
        return self.install()

    def __exit__(self, *exc_info) -> None:
        self.uninstall()

    def _handle(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if self.requested:
            if name == self.signal_name == "SIGTERM" and self._clock() - self._first_at < SAME_STOP_S:
                return
            raise KeyboardInterrupt(f"{name} after {self.signal_name}: stopping at once")
        self.requested = True
        self.signal_name = name
        self._first_at = self._clock()


def _libc_prctl() -> Callable[..., int] | None:
    """libc's ``prctl`` on Linux, else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


class ParentDeathSignal:
    """Linux's parent-death signal: once armed in a process, the kernel sends it ``signum`` when its parent ends.

    Build it in the parent: libc is looked up here, so that ``arm`` is safe in a forked child
    before ``exec`` (``subprocess.Popen``'s ``preexec_fn``). Off Linux ``supported`` is False and
    arming does nothing. The setting survives ``exec`` and is not inherited by children.
    """

    def __init__(self, signum: int = signal.SIGTERM) -> None:
        self.signum = int(signum)
        self._prctl = _libc_prctl()

    @property
    def supported(self) -> bool:
        return self._prctl is not None

    def arm(self, parent_pid: int) -> bool:
        """Ask for the signal; False when ``parent_pid`` is no longer the parent (it died before we asked)."""
        if self._prctl is not None:
            self._prctl(PR_SET_PDEATHSIG, self.signum, 0, 0, 0)
        return os.getppid() == parent_pid
