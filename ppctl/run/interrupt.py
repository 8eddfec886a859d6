"""Stopping on a signal, and not outliving the process that started us.

``StopRequest`` is what a training worker installs once its process groups exist: SIGTERM
or SIGINT then only asks for a stop (the trainer finishes its step, every rank agrees, a
checkpoint is saved); a second one ends the worker at once (the copies of one SIGTERM that
arrive together, as in a Slurm job, are one stop). ``ParentDeathSignal`` is
Linux's parent-death signal (``prctl(PR_SET_PDEATHSIG)``): the kernel signals a process
when its parent ends, so that nothing of a job outlives ``ppctl`` even when ``ppctl`` is
killed. ``BeforeStartSignals`` is ppctl's own handler until the launch installs its own: one per
process, built by its entry point and handed to the commands, it raises ``Interruption`` in ppctl
alone (never in a process forked meanwhile), and ``RaiseSwallowedAgain`` raises that again where
Python swallowed it (a signal that came while a ``__del__`` ran). No module-level state; nothing
here imports torch: the launcher uses this module too.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
import time
from typing import Callable, Iterator

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
BEFORE_START_SIGNALS = (signal.SIGINT, signal.SIGTERM)
BEFORE_ANY_WORKER = "before any worker started"  # what the line of ``BeforeStartSignals`` says by default
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
        self._superseded: set[int] = set()  # pending ones raised by ``take_pending``: their signal, if sent, ignored
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

    def take_pending(self) -> int | None:
        """A signal whose ``Interruption`` was swallowed and not yet raised again (its line said), now to be raised by
        the caller: whatever the main thread ran into meanwhile (the swallowed exit can leave the code it cut short
        half done, and the next error is a consequence) gives way to it. Its signal, if already on its way, is
        ignored once (``superseded``)."""
        if not self._said:
            return None
        signum = self._said.pop()
        self._superseded.add(signum)
        return signum

    def superseded(self, signum: int) -> bool:
        """Whether ``signum`` is the signal sent again for an interruption ``take_pending`` raised already (forgotten
        once asked): the exit is under way."""
        if signum not in self._superseded:
            return False
        self._superseded.discard(signum)
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
            if signum in self._superseded:  # raised by ``take_pending`` meanwhile: nothing left to send
                self._superseded.discard(signum)
            elif signal.getsignal(signum) is handler:
                signal.pthread_kill(main_thread.ident, signum)
        finally:
            sys.setswitchinterval(self._switch_interval)


def swallowing_hook() -> RaiseSwallowedAgain | None:
    """The ``RaiseSwallowedAgain`` installed as ``sys.unraisablehook``, None when there is none."""
    return sys.unraisablehook if isinstance(sys.unraisablehook, RaiseSwallowedAgain) else None


def raise_swallowed_interruption() -> None:
    """Raise the ``Interruption`` Python swallowed and that was not raised again yet (its line already said), if
    there is one: called where a command ends, well or with its own error, so that the signal decides the exit."""
    hook = swallowing_hook()
    signum = None if hook is None else hook.take_pending()
    if signum is not None:
        raise Interruption(signum) from None


class BeforeStartSignals:
    """SIGINT and SIGTERM while ppctl composes, validates or prepares data: one line, exit 128 + the signal.

    The process's entry point builds one and ``install``s it (the object itself is the handler) until the
    launch installs its own; a command says what it is doing meanwhile with ``saying``. A process forked
    meanwhile (the tokenising processes of ``datasets``, which their pool ends with SIGTERM) gets the
    default action back, in a process group of its own (``_detach_forked_child``).
    """

    def __init__(self) -> None:
        self.installer_pid: int | None = None  # the process that installed the handlers
        self.doing: str | None = None  # what the line says ppctl was doing (None: ``BEFORE_ANY_WORKER``)
        self._parent_death: ParentDeathSignal | None = None  # what a process forked meanwhile arms
        self._fork_hook_registered = False  # ``os.register_at_fork`` cannot undo a hook: registered once

    def install(self) -> BeforeStartSignals:
        """Handle SIGINT and SIGTERM in this process from now on (and detach the processes it forks)."""
        if not self._fork_hook_registered:
            os.register_at_fork(after_in_child=self._detach_forked_child)
            self._fork_hook_registered = True
        self.installer_pid, self._parent_death = os.getpid(), ParentDeathSignal(signal.SIGTERM)
        if not isinstance(sys.unraisablehook, RaiseSwallowedAgain):  # a signal while a __del__ runs: see its docstring
            sys.unraisablehook = RaiseSwallowedAgain(sys.unraisablehook)
        for signum in BEFORE_START_SIGNALS:
            signal.signal(signum, self)
        return self

    def __call__(self, signum: int, frame) -> None:
        """The handler: the line (once), then ``Interruption``.

        Only in the process that installed it: in a child that still runs it (a signal that came
        between its fork and ``_detach_forked_child``), the signal takes its default action. Where
        Python swallows the exit (the signal came while a ``__del__`` ran), ``RaiseSwallowedAgain``,
        installed beside it, signals again: the line is said once.
        """
        if self.installer_pid is not None and os.getpid() != self.installer_pid:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        hook = swallowing_hook()
        if hook is not None and hook.superseded(signum):
            return
        said = hook is not None and hook.said(signum)
        if hook is not None and hook.running_in(frame):  # raised in the hook, the exit would be swallowed again
            hook.signal_later(signum, said)
            return
        if not said:
            doing = self.doing or BEFORE_ANY_WORKER
            sys.stderr.write(f"error: interrupted by {signal.Signals(signum).name} {doing}\n")
            sys.stderr.flush()
        raise Interruption(signum)

    def _detach_forked_child(self) -> None:
        """In a process forked before the launch: the default action for each signal this object still
        handles, a process group of its own, and SIGTERM when ppctl ends.

        A Python handler there would print a false "interrupted" line, and can miss the signal
        altogether (one that comes just before the child blocks on a lock runs no Python code). In
        ppctl's process group, a terminal's Ctrl-C (or ``kill -- -PGID``) would kill a pool process
        waiting for work while it holds the pool's lock, and ppctl, ending the pool, would wait for that
        lock for ever; outside it, the signal reaches ppctl alone, which ends the pool with SIGTERM. The
        parent-death signal keeps what the terminal's hang-up no longer reaches from outliving ppctl.
        """
        forked_before_start = False
        for signum in BEFORE_START_SIGNALS:
            if signal.getsignal(signum) is self:
                signal.signal(signum, signal.SIG_DFL)
                forked_before_start = True
        if not forked_before_start:
            return
        os.setpgid(0, 0)
        if self._parent_death is not None and not self._parent_death.arm(self.installer_pid):
            os.kill(os.getpid(), signal.SIGTERM)  # ppctl ended before the signal was armed

    @contextlib.contextmanager
    def saying(self, doing: str) -> Iterator[None]:
        """Within the block, the line says ``doing`` (``while tokenising ...``) instead of ``before any worker
        started``; the block's own clean-up runs as its ``SystemExit`` unwinds it."""
        outer, self.doing = self.doing, doing
        try:
            yield
        except BaseException:
            raise_swallowed_interruption()
            raise
        else:
            raise_swallowed_interruption()
        finally:
            self.doing = outer
