"""An overlapped pair's two halves run one at a time, switching at each posted exchange (DeepSeek-V3's split).

DualPipe pairs a forward of one microbatch with a backward of another so that one's expert all-to-all travels
while the other computes. ``PairInterleave.run`` runs the two halves in two threads, but only one of them computes
at a time (holds the turn): the forward starts; whenever the running half has posted an exchange
(``exchanged``, given the in-flight work), it hands the turn to the other half, which computes up to its own next
exchange, and waits for its own exchange before asking for the turn again. (The backward's inputs may arrive
late: it asks for the turn only once it holds them, and the forward goes on meanwhile.) So each half's compute is cut
at its exchanges into pieces (attention and routing | dispatch | experts | combine, per MoE layer), and the pieces
alternate: F0 B0 F1 B1 ... (``split_order``), each exchange in flight during the other half's next piece.

Why one at a time: no two pieces share the cores (on a CPU worker the two halves at once slowed every exchange),
and each half's exchanges keep one order on each of its two communicators. The order of the pieces can still
depend on when the backward's inputs arrive, so TP and CP collectives inside them are not ordered across ranks:
they keep their order on two lanes and hand the turn over like an exchange (``ppctl.parallel.lanes``). Torch-free:
the work is anything with ``wait()``.

A weight fill (ZB's W beside a backward, ``Schedule.with_weight_fills``) runs on the same turn: the backward is
the first half and the W the second, which exchanges nothing: between its weight-gradient pieces it ``pause``s,
handing the turn back whenever the backward's exchange has arrived. The half that calls ``exchanged`` or ``pause``
is the one holding the turn (only it computes), so a backward run on an autograd device thread is found too.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional, TypeVar

from .schedules.base import ScheduleError

FORWARD_HALF, BACKWARD_HALF = "F", "B"
Result = TypeVar("Result")
# a half's states in ``prove_interleave``'s replay, and the turn when no half holds it
PREPARING, RUNNING, WAITING, ASKING, ENDED = "preparing", "running", "waiting", "asking", "ended"
FREE = None


def split_order(forward_exchanges: int, backward_exchanges: int) -> list[tuple[str, int]]:
    """The pieces of a pair whose forward posts ``forward_exchanges`` exchanges and whose backward posts
    ``backward_exchanges``, in the order ``PairInterleave`` runs them: ``(half, piece index)``; piece k of a half
    ends with its exchange k (the last piece of each half with none)."""
    pieces = {FORWARD_HALF: forward_exchanges + 1, BACKWARD_HALF: backward_exchanges + 1}
    done = {FORWARD_HALF: 0, BACKWARD_HALF: 0}
    order, turn = [], FORWARD_HALF
    while len(order) < sum(pieces.values()):
        order.append((turn, done[turn]))
        done[turn] += 1
        if done[_other(turn)] < pieces[_other(turn)]:
            turn = _other(turn)  # the half just ran up to an exchange (or ended): the other one goes on
    return order


def prove_interleave(forward_exchanges: int, backward_exchanges: int, ranks: int = 2,
                     holds_turn_while_waiting: bool = False, local_backward: bool = False) -> None:
    """Refuse (``ScheduleError``, one line) an interleaved pair that can hang: the turn protocol of
    ``PairInterleave`` on ``ranks`` EP ranks at once, an exchange arriving once every rank posted it, each
    backward asking for the turn at any moment (its inputs may arrive at any time), explored in every order the
    ranks' steps can take. Every reachable state must let some half go on until all have ended.
    ``holds_turn_while_waiting``: the protocol ppctl does not use (a half takes the turn back, then waits for its
    exchange), which hangs; kept to show that the proof finds it. ``local_backward``: the second half's exchanges
    are a weight fill's pauses, which no other rank takes part in (they arrive at once)."""
    exchanges = (forward_exchanges, backward_exchanges)
    start = ((0, (0, 0), (RUNNING, PREPARING)),) * ranks  # per rank: the turn's half, pieces done, states
    hung = _hang_reachable([start], lambda state: _next_states(state, exchanges, holds_turn_while_waiting,
                                                               local_backward), lambda state: state)
    if hung is not None:
        raise ScheduleError(f"an overlapped pair of {forward_exchanges} forward and {backward_exchanges} "
                            f"backward exchanges hangs on {ranks} EP ranks: {_describe(hung)}")


def _hang_reachable(starts: list, following_of: Callable, ranks_of: Callable) -> Optional[tuple]:
    """Explore every state reachable from ``starts`` (``following_of(state)``: the states one step leads to);
    return the ranks' part (``ranks_of``) of one from which nothing can go on while some half has not ended, or
    None."""
    seen, frontier = set(starts), list(starts)
    while frontier:
        state = frontier.pop()
        following = following_of(state)
        if not following and any(half != ENDED for _, _, halves in ranks_of(state) for half in halves):
            return ranks_of(state)
        for next_state in following:
            if next_state not in seen:
                seen.add(next_state)
                frontier.append(next_state)
    return None


# ``prove_interleave_for_every_count``: a half with this many exchanges left, or more, steps alike (a rank is at most
# one piece ahead of another in a half that exchanges, so none of them reaches the last piece within two steps)
_FAR = 3
_FAR_STAND_IN = _FAR + 2  # a concrete count of exchanges that behaves as any count from _FAR on


def prove_interleave_for_every_count(ranks: int = 2, local_backward: bool = False,
                                     holds_turn_while_waiting: bool = False) -> None:
    """``prove_interleave`` for every number of exchanges in each half at once (``ScheduleError`` where some count
    hangs). Abstract states: in a half that exchanges, each rank's pieces less the fewest any rank did, and how many
    exchanges that rank has left, counted up to ``_FAR`` ("``_FAR`` or more"); in a weight fill's W (``local_backward``,
    no rank waits for another), each rank's own count left, up to ``_FAR``. Whether a half can step depends only on
    these (its exchange arrived, it has one more to post), so every hang of some count is a hang here; the abstract
    states over-approximate the reachable ones (from "``_FAR`` or more", one fewer may be either), so a proof here
    holds for every count."""
    local = (False, local_backward)
    starts = [(((0, (0, 0), (RUNNING, PREPARING)),) * ranks, (forward, backward))
              for forward in range(_FAR + 1) for backward in range(_FAR + 1)]
    if local_backward:  # the W's count left is per rank (the same at the start)
        starts = [(tuple((turn, (0, left[1]), halves) for turn, _, halves in state), (left[0], None))
                  for state, left in starts]
    hung = _hang_reachable(starts, lambda state: _abstract_next_states(state, local, holds_turn_while_waiting),
                           lambda state: state[0])
    if hung is not None:
        raise ScheduleError(f"an overlapped pair hangs on {ranks} EP ranks for some count of exchanges: "
                            f"{_describe(hung)}")


def _abstract_next_states(state: tuple, local: tuple[bool, bool], holds: bool) -> list[tuple]:
    """Every abstract state one step of one half of one rank leads to (``prove_interleave_for_every_count``)."""
    ranks_state, left = state
    following = []
    for index, (turn, marks, halves) in enumerate(ranks_state):
        for half in (0, 1):
            exchanges = tuple(_concrete(marks[each] if local[each] else left[each]) for each in (0, 1))
            if local[half]:  # marks[half]: this rank's count left; its pieces done do not matter
                pieces, arrived = tuple(0 if h == half else marks[h] for h in (0, 1)), True
            else:
                pieces, arrived = marks, all(other[1][half] >= marks[half] for other in ranks_state)
            changed = _step(turn, pieces, halves, half, exchanges, holds, arrived)
            if changed is None:
                continue
            new_turn, _, new_halves = changed
            stepped = changed[1][half] > pieces[half]
            for abstract in _abstracted(ranks_state, left, index, half, new_turn, new_halves, stepped, local[half]):
                following.append(abstract)
    return following


def _concrete(left: int) -> int:
    """A concrete count of exchanges for an abstract count left (``_FAR`` meaning "``_FAR`` or more")."""
    return _FAR_STAND_IN if left >= _FAR else left


def _abstracted(ranks_state, left, index: int, half: int, turn, halves, stepped: bool, local: bool) -> list[tuple]:
    """The abstract states after rank ``index``'s half ``half`` stepped to ``turn`` and ``halves`` (``stepped``: it
    computed a piece)."""
    turn_marks = list(ranks_state[index][1])
    if not stepped:
        changed = ranks_state[:index] + ((turn, tuple(turn_marks), halves),) + ranks_state[index + 1:]
        return [(changed, left)]
    if local:  # one fewer left on this rank; from "_FAR or more", either
        options = [turn_marks[half] - 1] if turn_marks[half] < _FAR else [_FAR - 1, _FAR]
        return [(ranks_state[:index] + ((turn, tuple(option if h == half else turn_marks[h] for h in (0, 1)),
                                         halves),) + ranks_state[index + 1:], left) for option in options]
    turn_marks[half] += 1
    changed = ranks_state[:index] + ((turn, tuple(turn_marks), halves),) + ranks_state[index + 1:]
    fewest = min(marks[half] for _, marks, _ in changed)
    if fewest == 0:
        return [(changed, left)]
    shifted = tuple((t, tuple(m - fewest if h == half else m for h, m in enumerate(marks)), hs)
                    for t, marks, hs in changed)
    lefts = [left[half] - fewest] if left[half] < _FAR else [_FAR - fewest, _FAR]
    return [(shifted, tuple(option if h == half else left[h] for h in (0, 1))) for option in lefts]


def _next_states(state: tuple, exchanges: tuple[int, int], holds: bool, local_backward: bool) -> list[tuple]:
    """Every state one step of one half of one rank leads to (``prove_interleave``): halves 0 (forward) and 1."""
    following = []
    for index, (turn, pieces, halves) in enumerate(state):
        for half in (0, 1):
            arrived = (half == 1 and local_backward) or all(other[1][half] >= pieces[half] for other in state)
            changed = _step(turn, pieces, halves, half, exchanges, holds, arrived)
            if changed is not None:
                following.append(state[:index] + (changed,) + state[index + 1:])
    return following


def _step(turn, pieces, halves, half: int, exchanges, holds: bool, arrived: bool):
    """One rank's next state by half ``half``'s step, or None when it cannot move (``arrived``: its last exchange
    was posted on every rank)."""
    other, mine = 1 - half, halves[half]

    def with_half(new_state, new_turn=turn):
        states = list(halves)
        states[half] = new_state
        return new_turn, pieces, tuple(states)

    if mine == PREPARING:  # the backward's inputs arrive at any moment
        return with_half(ASKING)
    if mine == WAITING and arrived and not holds:
        return with_half(ASKING)
    if mine == WAITING and holds and turn in (half, FREE):
        return with_half(RUNNING, half) if arrived else (None if turn == half else with_half(WAITING, half))
    if mine == ASKING and turn is FREE:
        return with_half(RUNNING, half)
    if mine != RUNNING:
        return None
    done = list(pieces)
    done[half] += 1  # the piece computed; then its exchange posted, or the half ends
    posting = done[half] <= exchanges[half]
    states = list(halves)
    states[half] = WAITING if posting else ENDED
    handed = states[other] == ASKING
    if handed:
        states[other] = RUNNING
    kept = holds and posting and not handed
    return (other if handed else half if kept else FREE), tuple(done), tuple(states)


def _describe(state: tuple) -> str:
    return "; ".join(f"rank {index}: " + ", ".join(f"{name} {halves[half]} after {pieces[half]} pieces"
                                                     for half, name in enumerate((FORWARD_HALF, BACKWARD_HALF)))
                     for index, (_, pieces, halves) in enumerate(state))


class PairInterleave:
    """Runs overlapped pairs' halves one at a time (module docstring); one per worker (``ppctl.pipeline.overlap``),
    also the pacer of its lanes, which every collective is finished through (``ppctl.parallel.lanes``).
    ``on_piece(half, start, end)``: told the ``perf_counter`` span of each piece (a tracer's), or None.

    The turn: the forward holds it first; the backward first takes its inputs (``prepare``, which may wait for a
    message, outside the turn), then asks for it. At each exchange, and at its end, a half hands the turn to the
    other one if it asks, else leaves it free; a half waits for its exchange without the turn (holding it there
    could hang: ``prove_interleave``), then asks for it. While the exchanges take longer than the other half's
    pieces, the pieces alternate as ``split_order`` says."""

    def __init__(self, on_piece: Optional[Callable[[str, float, float], None]] = None):
        self._turn_changed = threading.Condition()
        self._turn: Optional[str] = None  # the half that computes, or None: free
        self._asking: set[str] = set()  # halves waiting for the turn
        self._piece_start: dict[str, float] = {}  # per half, when its current piece started
        self._labels = {FORWARD_HALF: FORWARD_HALF, BACKWARD_HALF: BACKWARD_HALF}  # what ``on_piece`` is told
        self._executor: Optional[ThreadPoolExecutor] = None
        self.on_piece = on_piece

    def run(self, forward: Callable[[], Result], backward: Callable[[], Result],
            prepare: Callable[[], None] = lambda: None, labels: tuple[str, str] = (FORWARD_HALF, BACKWARD_HALF)
            ) -> tuple[Result, Result]:
        """``(forward(), backward())``: the forward on this thread, holding the turn first; ``prepare()`` then
        ``backward()`` on the pair thread, the backward's compute taking turns with the forward's. ``labels``: the
        halves' names for ``on_piece`` (a weight fill's are B and W)."""
        if self._executor is None:  # the pair thread: made on first use, ended when the interleave is collected
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ppctl-pair")
        with self._turn_changed:
            self._turn, self._asking = FORWARD_HALF, set()
            self._labels = dict(zip((FORWARD_HALF, BACKWARD_HALF), labels))

        def backward_half():
            prepare()
            return self._run_half(BACKWARD_HALF, backward)

        backward_result = self._executor.submit(backward_half)
        try:
            forward_result = self._run_half(FORWARD_HALF, forward)
        finally:
            result = backward_result.result()
        return forward_result, result

    def exchanged(self, work) -> None:
        """Called by a half right after it posted an exchange (``work``: its in-flight handle): it hands the turn
        to the other half (or leaves it free), waits for the exchange without it, then asks for it again. Outside a
        pair: just wait."""
        half = self._turn
        if half is None:
            work.wait()
            return
        self._end_piece(half)
        with self._turn_changed:
            self._hand_over_turn(half)
        work.wait()
        with self._turn_changed:
            self._take_turn(half)
        self._piece_start[half] = time.perf_counter()

    def pause(self) -> None:
        """Called by a half that exchanges nothing (a weight fill's W) between two of its pieces: when the other
        half asks for the turn (its exchange arrived), hand it over and ask for it again; else go on. Outside a
        pair: nothing."""
        with self._turn_changed:
            half = self._turn
            if half is None or _other(half) not in self._asking:
                return
        self._end_piece(half)
        with self._turn_changed:
            self._hand_over_turn(half)
            self._take_turn(half)
        self._piece_start[half] = time.perf_counter()

    def _run_half(self, half: str, body: Callable[[], Result]) -> Result:
        with self._turn_changed:
            self._take_turn(half)
        self._piece_start[half] = time.perf_counter()
        try:
            return body()
        finally:
            self._end_piece(half)
            with self._turn_changed:
                self._hand_over_turn(half)

    def _take_turn(self, half: str) -> None:
        """Wait (holding the condition) until the turn is ``half``'s or free, and take it."""
        self._asking.add(half)
        self._turn_changed.wait_for(lambda: self._turn in (half, None))
        self._asking.discard(half)
        self._turn = half

    def _hand_over_turn(self, half: str) -> None:
        """``half`` stops computing (holding the condition): the turn goes to the other half if it asks, else is
        free."""
        other = _other(half)
        self._turn = other if other in self._asking else None
        self._turn_changed.notify_all()

    def _end_piece(self, half: str) -> None:
        """A piece ends at each exchange of its half and at its end."""
        if self.on_piece is not None:
            self.on_piece(self._labels[half], self._piece_start[half], time.perf_counter())


def _other(half: str) -> str:
    return BACKWARD_HALF if half == FORWARD_HALF else FORWARD_HALF
