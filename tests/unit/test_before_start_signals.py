"""The SIGINT/SIGTERM handler ppctl installs before any worker starts acts in ppctl's own process only.

A process forked meanwhile (``datasets`` tokenises in forked processes, and its pool ends
them with SIGTERM) must die of the signal at once and silently: not print "interrupted by
SIGTERM before any worker started", and not miss the signal while it blocks on a lock.
"""

import multiprocessing
import os
import signal
import sys
import time

import pytest

from ppctl.run.interrupt import BeforeStartSignals

SIGNALS = (signal.SIGINT, signal.SIGTERM)


@pytest.fixture
def before_start_handlers(monkeypatch):
    """A ``BeforeStartSignals`` installed as ``main`` installs it (with an unraisable hook of its own); the handlers
    and the unraisable hook restored after."""
    saved = {signum: signal.getsignal(signum) for signum in SIGNALS}
    monkeypatch.setattr(sys, "unraisablehook", sys.__unraisablehook__)
    signals = BeforeStartSignals().install()
    yield signals
    for signum, handler in saved.items():
        signal.signal(signum, handler)


def sleep_until_ended() -> None:
    time.sleep(30)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("signum", SIGNALS)
def test_a_forked_child_dies_of_the_signal_silently(before_start_handlers, capfd, signum):
    child = multiprocessing.get_context("fork").Process(target=sleep_until_ended)
    child.start()
    time.sleep(0.2)
    os.kill(child.pid, signum)
    child.join(10)
    assert child.exitcode == -signum  # killed by the signal, as its pool expects; not exit 128 + signum
    assert "interrupted" not in capfd.readouterr().err


@pytest.mark.timeout(30)
def test_a_child_still_running_the_handler_takes_the_default_action(before_start_handlers, capfd):
    # A signal that comes between the fork and the reset reaches the handler itself in the child.
    pid = os.fork()
    if pid == 0:  # the child
        try:
            signal.signal(signal.SIGTERM, before_start_handlers)
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
        finally:
            os._exit(3)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM
    assert "interrupted" not in capfd.readouterr().err


def test_in_ppctl_itself_the_handler_still_says_it_in_one_line(before_start_handlers, capsys):
    assert signal.getsignal(signal.SIGTERM) is before_start_handlers
    with pytest.raises(SystemExit) as ended:
        before_start_handlers(signal.SIGTERM, None)
    assert ended.value.code == 143
    assert capsys.readouterr().err == "error: interrupted by SIGTERM before any worker started\n"


def wait_for(condition, timeout_s: float = 10) -> bool:
    """Whether ``condition()`` came true within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return False


@pytest.mark.timeout(30)
def test_a_forked_child_leaves_ppctls_process_group(before_start_handlers):
    # A terminal's Ctrl-C reaches the whole foreground group: a pool process it killed while waiting for work
    # would keep the pool's lock, and ppctl, ending the pool, would wait for that lock for ever.
    child = multiprocessing.get_context("fork").Process(target=sleep_until_ended)
    child.start()
    try:
        assert wait_for(lambda: os.getpgid(child.pid) == child.pid) and os.getpgid(0) != child.pid
    finally:
        child.terminate()
        child.join(10)


def gone(pid: int) -> bool:
    """Whether process ``pid`` has ended (gone, or a zombie waiting to be reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.timeout(30)
@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="the parent-death signal is Linux's")
def test_a_forked_child_ends_with_ppctl(before_start_handlers):
    # Out of ppctl's process group, the hang-up of a closed terminal no longer reaches it: it must not outlive ppctl.
    reader, writer = os.pipe()
    stand_in = os.fork()
    if stand_in == 0:  # ppctl, with a tokenising child of its own, then killed
        try:
            before_start_handlers.install()
            child = multiprocessing.get_context("fork").Process(target=sleep_until_ended)
            child.start()
            os.write(writer, str(child.pid).encode())
        finally:
            os._exit(0)
    os.close(writer)
    child_pid = int(os.read(reader, 32).decode())
    os.waitpid(stand_in, 0)
    assert wait_for(lambda: gone(child_pid))
