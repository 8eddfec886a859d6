"""StopRequest: the first SIGTERM/SIGINT asks for a stop, a second one ends the worker; handlers restored after."""

import os
import signal

import pytest

from ppctl.run.interrupt import ParentDeathSignal, StopRequest


def deliver(signum: int) -> None:
    """Send ``signum`` to this process and let its Python handler run (it runs between bytecodes)."""
    os.kill(os.getpid(), signum)
    for _ in range(1000):
        pass


@pytest.mark.timeout(10)
@pytest.mark.parametrize("first, second", [(signal.SIGTERM, signal.SIGINT), (signal.SIGINT, signal.SIGTERM)])
def test_first_signal_requests_a_stop_second_interrupts(first, second):
    before = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT)}
    with StopRequest() as stop:
        assert (stop.requested, stop.signal_name) == (False, None)
        deliver(first)
        assert (stop.requested, stop.signal_name) == (True, first.name)
        with pytest.raises(KeyboardInterrupt, match=f"{second.name} after {first.name}"):
            deliver(second)
        assert stop.signal_name == first.name  # the first signal stays the reason
    assert {signum: signal.getsignal(signum) for signum in before} == before


@pytest.mark.timeout(10)
def test_copies_of_one_sigterm_are_one_stop_and_a_later_one_interrupts():
    now = [100.0]
    with StopRequest(clock=lambda: now[0]) as stop:
        deliver(signal.SIGTERM)
        now[0] += 1.0
        deliver(signal.SIGTERM)  # Slurm's copy, or torchrun's: the same stop
        assert (stop.requested, stop.signal_name) == (True, "SIGTERM")
        now[0] += 10.0
        with pytest.raises(KeyboardInterrupt, match="SIGTERM after SIGTERM"):
            deliver(signal.SIGTERM)


@pytest.mark.timeout(10)
def test_parent_death_signal_arms_and_sees_the_parent():
    death = ParentDeathSignal(signal.SIGTERM)
    assert death.arm(os.getppid())
    assert not death.arm(os.getppid() + 1_000_000)  # "the parent changed": it died before we asked
    if death.supported:  # Linux: PR_GET_PDEATHSIG reads it back; disarm so that pytest is not signalled later
        import ctypes

        value = ctypes.c_int()
        libc = ctypes.CDLL(None)
        assert libc.prctl(2, ctypes.byref(value), 0, 0, 0) == 0 and value.value == signal.SIGTERM
        libc.prctl(1, 0, 0, 0, 0)
