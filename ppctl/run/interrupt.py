"""Stopping on a signal, and not outliving the process that started us.

``StopRequest`` is what a training worker installs once its process groups exist: SIGTERM
or SIGINT then only asks for a stop (the trainer finishes its step, every rank agrees, a
checkpoint is saved); a second one ends the worker at once (the copies of one SIGTERM that
arrive together, as in a Slurm job, are one stop). ``ParentDeathSignal`` is
Linux's parent-death signal (``prctl(PR_SET_PDEATHSIG)``): the kernel signals a process
when its parent ends, so that nothing of a job outlives ``ppctl`` even when ``ppctl`` is
killed. ``Interruption`` is what ppctl's handler raises before any worker starts, and
``RaiseSwallowedAgain`` raises it again where Python swallowed it (a signal that came while a
``__del__`` ran). Nothing here imports torch: the launcher uses this module too.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
from typing import Callable

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
# The threads' turns (``sys.setswitchinterval``; Python's default is 5 ms) while ``RaiseSwallowedAgain`` waits to
# send a signal again.
SIGNAL_AGAIN_SWITCH_INTERVAL_S = 1e-6


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


class Interruption(SystemExit):
    """What a signal's handler raises to end ``ppctl`` before any worker starts: exit status 128 + ``signum``."""

    def __init__(self, signum: int) -> None:
        super().__init__(128 + signum)
        self.signum = int(signum)


class RaiseSwallowedAgain:
    """``sys.unraisablehook`` that has an ``Interruption`` Python swallowed raised again, where it can end the program.

    A handler's exception is raised in whatever code the main thread runs when the signal comes. Where
    that code's exceptions reach no caller (a ``__del__``, a weakref callback, an ``os.register_at_fork``
    hook), Python prints "Exception ignored in ..." with a traceback and goes on: ``ppctl`` would say it
    was interrupted, print a traceback, then run to the end and exit 0. Instead, this hook has a thread
    send the signal to the main thread again as soon as the main thread has left the hook (whose own
    exceptions would be swallowed too); ``said(signum)`` then tells the handler that its line is already
    said. Every other unraisable exception goes to ``previous``, the hook this one replaced.
    """

    def __init__(self, previous: Callable[..., object]) -> None:
        self.previous = previous
        self._said: set[int] = set()  # signals sent again whose line the handler already said
        self._switch_interval = sys.getswitchinterval()

    def __call__(self, unraisable) -> None:
        if not isinstance(unraisable.exc_value, Interruption):
            self.previous(unraisable)
            return
        self.signal_later(unraisable.exc_value.signum, said=True)

    def signal_later(self, signum: int, said: bool) -> None:
        """Send ``signum`` to the main thread once it has left this hook (``said``: its line was said)."""
        if said:
            self._said.add(signum)
        # Meanwhile the threads take turns every few microseconds: the main thread, running on, gets no further
        # than the next few lines (not to the end of the command, which a 5 ms turn can reach).
        sys.setswitchinterval(SIGNAL_AGAIN_SWITCH_INTERVAL_S)
        threading.Thread(target=self._signal_main_thread, args=(signum, signal.getsignal(signum)),
                         name="ppctl-signal-again", daemon=True).start()

    def said(self, signum: int) -> bool:
        """Whether ``signum`` came from ``signal_later`` after its line was said (forgotten once asked)."""
        if signum not in self._said:
            return False
        self._said.discard(signum)
        return True

    @staticmethod
    def running_in(frame) -> bool:
        """Whether ``frame`` is this hook's or one it called: a handler's exception raised there is swallowed."""
        while frame is not None:
            if frame.f_code in (RaiseSwallowedAgain.__call__.__code__, RaiseSwallowedAgain.signal_later.__code__):
                return True
            frame = frame.f_back
        return False

    def _signal_main_thread(self, signum: int, handler) -> None:
        """Send ``signum`` to the main thread once it is out of this hook, if ``handler`` still takes it.

        A signal, not ``_thread.interrupt_main``: a main thread blocked in a system call (a sleep, a wait for
        the pool) runs the handler at once, not when the call returns. Another handler since (the launch's
        own, or the default action, which would kill) gets nothing: the interruption was not meant for it.
        """
        main_thread = threading.main_thread()
        try:
            while self.running_in(sys._current_frames().get(main_thread.ident)):
                time.sleep(0)
            if signal.getsignal(signum) is handler:
                signal.pthread_kill(main_thread.ident, signum)
        finally:
            sys.setswitchinterval(self._switch_interval)
