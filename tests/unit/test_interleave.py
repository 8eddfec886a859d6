"""An overlapped pair's halves interleaved (``ppctl.pipeline.interleave``): one computes at a time, the turn
changes at each posted exchange, and the pieces alternate as ``split_order`` says while the backward is ready;
a backward whose inputs arrive late lets the forward go on alone (no deadlock)."""

import threading
import time

import pytest

from ppctl.pipeline.interleave import (PairInterleave, prove_interleave, prove_interleave_for_every_count,
                                       split_order)
from ppctl.pipeline.schedules.base import ScheduleError


class Posted:
    """A posted exchange: ``wait`` returns once ``delay`` seconds passed since it was posted."""

    def __init__(self, delay: float = 0.0):
        self.done_at = time.perf_counter() + delay

    def wait(self):
        time.sleep(max(0.0, self.done_at - time.perf_counter()))


def test_split_order_alternates_and_finishes_the_longer_half_alone():
    assert split_order(1, 1) == [("F", 0), ("B", 0), ("F", 1), ("B", 1)]
    assert split_order(2, 0) == [("F", 0), ("B", 0), ("F", 1), ("F", 2)]
    assert split_order(0, 2) == [("F", 0), ("B", 0), ("B", 1), ("B", 2)]
    for forward, backward in [(0, 0), (3, 1), (5, 5)]:
        order = split_order(forward, backward)
        assert [index for half, index in order if half == "F"] == list(range(forward + 1))
        assert [index for half, index in order if half == "B"] == list(range(backward + 1))


def half(name: str, exchanges: int, interleave: PairInterleave, log: list, arrival=lambda name, index: Posted()):
    """A half that computes ``exchanges + 1`` pieces, posting after each but the last the exchange
    ``arrival(name, index)``."""
    def body():
        for index in range(exchanges + 1):
            log.append((name, index, "start"))
            time.sleep(0.002)
            log.append((name, index, "end"))
            if index < exchanges:
                interleave.exchanged(arrival(name, index))
        return name
    return body


class Arrives:
    """An exchange that arrives once ``event`` is set."""

    def __init__(self, event: threading.Event):
        self.event = event

    def wait(self):
        assert self.event.wait(10)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("forward, backward", [(1, 1), (3, 2), (0, 2), (4, 0)])
def test_pieces_alternate_one_at_a_time_while_each_exchange_outlasts_the_other_half(forward, backward):
    """Each exchange arrives only once the other half computed its next piece: the pieces alternate as split_order
    says, never two at once, and each half waits for its exchange without the turn."""
    pieces, log = [], []
    interleave = PairInterleave(on_piece=lambda name, start, end: pieces.append((name, start, end)))
    ended = {(name, index): threading.Event() for name, count in (("F", forward), ("B", backward))
             for index in range(count + 1)}
    order = split_order(forward, backward)

    def arrival(name, index):  # arrives when the piece after this one in split_order (the other half's) ended
        position = order.index((name, index))
        following = [piece for piece in order[position + 1:] if piece[0] != name][:1]
        return Arrives(ended[following[0]]) if following else Posted()

    def note_ends(name, start, end):
        pieces.append((name, start, end))
        done = [index for piece_name, index, event in log if piece_name == name and event == "end"]
        ended[(name, done[-1])].set()

    interleave.on_piece = note_ends
    results = interleave.run(half("F", forward, interleave, log, arrival),
                             half("B", backward, interleave, log, arrival))
    assert results == ("F", "B")
    assert [(name, index) for name, index, event in log if event == "start"] == order
    # never two pieces at once: every start is followed by its own end
    assert all(log[i][2] == "start" and log[i + 1] == (*log[i][:2], "end") for i in range(0, len(log), 2))
    assert len(pieces) == forward + backward + 2
    spans = sorted((start, end) for _, start, end in pieces)
    assert all(previous[1] <= following[0] for previous, following in zip(spans, spans[1:]))


@pytest.mark.timeout(30)
def test_a_late_backward_lets_the_forward_run_its_pieces_alone():
    log = []
    interleave = PairInterleave()
    arrived = threading.Event()

    def late_inputs():
        arrived.wait(10)  # the forward ends before the backward's inputs are there

    def forward_body():
        result = half("F", 3, interleave, log)()
        arrived.set()
        return result

    interleave.run(forward_body, half("B", 2, interleave, log), prepare=late_inputs)
    ran = [(name, index) for name, index, event in log if event == "start"]
    assert ran == [("F", 0), ("F", 1), ("F", 2), ("F", 3), ("B", 0), ("B", 1), ("B", 2)]


def test_outside_a_pair_an_exchange_is_just_waited():
    interleave = PairInterleave()
    started = time.perf_counter()
    interleave.exchanged(Posted(0.02))
    assert time.perf_counter() - started >= 0.02


@pytest.mark.timeout(30)
def test_an_error_in_the_forward_still_lets_the_backward_finish():
    log = []
    interleave = PairInterleave()

    def failing():
        interleave.exchanged(Posted())
        raise RuntimeError("forward failed")

    with pytest.raises(RuntimeError, match="forward failed"):
        interleave.run(failing, half("B", 1, interleave, log))
    assert [(name, index) for name, index, event in log if event == "start"] == [("B", 0), ("B", 1)]


@pytest.mark.parametrize("forward, backward, ranks", [(0, 0, 2), (3, 2, 2), (6, 4, 2), (12, 8, 2), (2, 5, 2),
                                                    (3, 2, 3)])
def test_the_turn_protocol_never_hangs_in_any_order_whenever_the_backwards_become_ready(forward, backward, ranks):
    prove_interleave(forward, backward, ranks)


def test_holding_the_turn_while_waiting_for_an_exchange_would_hang():
    """The broken twin (the first design): a half that waits for its exchange holding the turn. A rank whose
    backward is ready at once lets it hold the turn waiting for another rank's backward, whose inputs come late,
    while that rank's forward waits for this rank's forward's next exchange."""
    with pytest.raises(ScheduleError, match="hangs on 2 EP ranks: rank 0"):
        prove_interleave(3, 2, 2, holds_turn_while_waiting=True)


def filler(name: str, pieces: int, interleave: PairInterleave, log: list):
    """A half that exchanges nothing (a weight fill's W): ``pieces`` pieces, pausing between two."""
    def body():
        for index in range(pieces):
            if index:
                interleave.pause()
            log.append((name, index, "start"))
            time.sleep(0.002)
            log.append((name, index, "end"))
        return name
    return body


@pytest.mark.timeout(30)
def test_a_weight_fill_computes_in_the_backwards_exchange_waits_and_yields_when_it_arrives():
    """The backward (2 exchanges, each arriving 15 ms after it is posted) holds the turn first; the W (many short
    pieces) computes while each exchange travels and hands the turn back at its next pause once it arrived; one piece
    at a time; the W's pieces that did not fit finish after the backward."""
    log, pieces = [], []
    interleave = PairInterleave(on_piece=lambda name, start, end: pieces.append((name, start, end)))
    backward = half("B", 2, interleave, log, arrival=lambda name, index: Posted(0.015))
    results = interleave.run(backward, filler("W", 40, interleave, log), labels=("fill B", "fill W"))
    assert results == ("B", "W")
    ran = [name for name, _index, event in log if event == "start"]
    assert ran[0] == "B" and ran.count("B") == 3 and ran.count("W") == 40
    first_b_ends = [position for position, name in enumerate(ran) if name == "B"]
    assert all(ran[position + 1] == "W" for position in first_b_ends[:2]), ran  # each wait filled by the W
    assert ran[first_b_ends[-1] + 1:] == ["W"] * (len(ran) - first_b_ends[-1] - 1)
    assert all(log[i][2] == "start" and log[i + 1] == (*log[i][:2], "end") for i in range(0, len(log), 2))
    assert {name for name, _start, _end in pieces} == {"fill B", "fill W"}
    assert sum(name == "fill B" for name, _start, _end in pieces) == 3


def test_a_pause_outside_a_pair_or_with_no_one_asking_goes_on():
    interleave = PairInterleave()
    interleave.pause()  # outside a pair: nothing
    log = []
    interleave.run(filler("W", 3, interleave, log), lambda: "idle")
    assert [index for _name, index, event in log if event == "start"] == [0, 1, 2]


@pytest.mark.parametrize("backward, pauses, ranks", [(0, 0, 2), (2, 5, 2), (6, 3, 2), (1, 2, 3)])
def test_a_weight_fill_never_hangs_whatever_the_order(backward, pauses, ranks):
    prove_interleave(backward, pauses, ranks, local_backward=True)


@pytest.mark.parametrize("local_backward", [False, True], ids=["pair", "weight fill"])
def test_the_turn_protocol_never_hangs_for_any_count_of_exchanges(local_backward):
    """The abstract proof covers every count at once; the bounded proofs above are instances of it."""
    prove_interleave_for_every_count(2, local_backward)


def test_the_proof_for_every_count_finds_the_hang_of_holding_the_turn():
    with pytest.raises(ScheduleError, match="hangs on 2 EP ranks for some count of exchanges"):
        prove_interleave_for_every_count(2, holds_turn_while_waiting=True)
