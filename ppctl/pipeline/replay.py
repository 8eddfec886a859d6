"""The replay engine: run every rank's steps against a cost model, with buffered or NCCL-like sends.

One engine serves the lowering (a unit-cost replay decides where receives go), the
simulator (timelines) and the checker (deadlock detection). It runs a ``TimedProgram``:
a lowered program (``ppctl.pipeline.program``) with each step's duration, its messages
numbers.

``StepGraph`` gives the buffered replay's times without the engine: one walk of the steps in
an order found once per program, for the planner, which times a program at many costs.

An action starts once its rank is free and its inputs are there; its outputs become
available to their consumers (after ``comm`` when they cross ranks). A rank that waits
for a message nobody will produce is stuck; if ranks remain stuck when nothing can
move, the schedule deadlocks.

Two transports decide when a remote message is there:

- buffered (the simulator's): a send completes on its own; the message arrives
  ``comm`` after its producer finished;
- rendezvous (NCCL-like, for the checker): each rank issues its point-to-point
  batches (one per step: the sends plus the prefetched receives) on one stream, in
  order; a batch starts once the previous one on that rank completed, a message
  moves once the batches holding its send and its receive have both started, a batch
  completes once all its messages moved, and a receive is usable once its batch
  completed. A send whose receive is never posted therefore blocks every later
  batch of its rank, as it would on NCCL.

Cost model: ``Costs.F`` (``B``, ``W``) is the time of one microbatch through all the
layers it meets on a rank: all of the rank's layers, or with several model copies
(DualPipe) the rank's layers of one copy. A chunk's action takes that divided by
``Schedule.chunks_per_copy`` (the rank's chunks of one copy); an unsplit backward ``BW``
takes ``B + W``. ``Costs.FB`` is the time of an overlapped pair of a forward and a whole
backward, in the same unit. Left None, a pair's halves are two plain actions, as the
runtime runs them today (back to back, no overlap gain). Set, a pair's two steps split
its time in proportion (``pair_durations``), and the simulator runs each pair as one
overlapped action (``TimedProgram.of``): it starts once both halves' inputs are in, and
both halves' messages leave at its end, as DualPipe runs it.
"""

from __future__ import annotations

import gc
from collections import deque
from dataclasses import dataclass
from functools import wraps
from typing import Any, Callable, Optional, Sequence, TypeVar

from .interleave import BACKWARD_HALF, FORWARD_HALF
from .schedules.base import BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, Action, Schedule


_Result = TypeVar("_Result")


def gc_paused(function: Callable[..., _Result]) -> Callable[..., _Result]:
    """``function`` run with the cyclic garbage collector paused (and resumed after, if it ran before).

    Planning, checking and replaying a large schedule build a few hundred thousand
    small tuples and lists, and no reference cycle: collections would only walk them
    over and over (about a sixth of the time at pp=64 with 512 microbatches).
    """
    @wraps(function)
    def paused(*args, **kwargs) -> _Result:
        if not gc.isenabled():
            return function(*args, **kwargs)
        gc.disable()
        try:
            return function(*args, **kwargs)
        finally:
            gc.enable()
    return paused


@dataclass(frozen=True)
class Costs:
    """Times of one microbatch through a rank's layers (of one model copy), and the point-to-point latency.

    ``FB`` is the time of one overlapped pair of a forward and a whole backward
    (DualPipe's F&B) in the same unit; None: no overlap, the halves run as two plain
    actions (F, then B + W), as the runtime runs them.

    ``A2A`` is the expert-parallel all-to-all time of one microbatch through the rank's layers
    (dispatch and combine of every MoE layer): a forward and an input-gradient backward (B, BW) each
    wait that long on top of their compute (F, B), a W not at all. An overlapped pair then runs its
    halves interleaved (``parallel.overlap_ep_comm``, ``ppctl.pipeline.interleave``): each half's
    compute is cut by its ``A2A_SPLIT`` exchanges per chunk (2 per MoE layer: dispatch and combine)
    into equal pieces, the pieces alternate, and each exchange travels while the other half's next
    piece computes (``interleaved_pair_time``); so without ``FB`` the all-to-all shows only where it
    exceeds the other half's compute. A weight fill's W computes in its backward's exchange waits
    (``_time_fills``): it takes only what exceeds them.
    """

    F: float = 1.0
    B: float = 1.0
    W: float = 1.0
    comm: float = 0.0
    FB: Optional[float] = None
    A2A: float = 0.0
    A2A_SPLIT: float = 1  # a whole number: the exchanges that cut each half of a pair, per chunk

    def to_json(self) -> dict:
        """The costs as a plain dict (keys F, B, W, comm; FB when it is set; A2A and A2A_SPLIT when not zero)."""
        costs = {"F": self.F, "B": self.B, "W": self.W, "comm": self.comm}
        if self.FB is not None:
            costs["FB"] = self.FB
        if self.A2A:
            costs["A2A"], costs["A2A_SPLIT"] = self.A2A, int(self.A2A_SPLIT)
        return costs

    @property
    def times_pairs(self) -> bool:
        """Whether an overlapped pair runs differently from its two halves in turn (``FB`` or ``A2A`` given)."""
        return self.FB is not None or self.A2A > 0


def action_durations(chunks_per_copy: int, costs: Costs) -> dict[str, float]:
    """Action kind -> the time one chunk-level action of that kind takes (``chunks_per_copy``: see the docstring)."""
    return {
        FORWARD: (costs.F + costs.A2A) / chunks_per_copy,
        BACKWARD_INPUT: (costs.B + costs.A2A) / chunks_per_copy,
        BACKWARD_WEIGHT: costs.W / chunks_per_copy,
        BACKWARD: (costs.B + costs.W + costs.A2A) / chunks_per_copy,
    }


def pair_durations(chunks_per_copy: int, costs: Costs, backward_kind: str) -> tuple[float, float]:
    """The durations of an overlapped pair's forward and its backward (``BW``, or ``B``), in that order.

    Both halves are scaled by one factor, so the two steps keep their proportions and
    sum to the pair's time: ``FB`` for a forward with a whole backward; with a B,
    ``FB - W``, the pair less the weight gradient that runs later on its own (a rank's
    total compute then does not depend on whether the paired backward is split).
    With ``FB`` None the halves keep their own times, or with an ``A2A`` cost share the
    interleaved pair's (``interleaved_pair_time``, ``Costs``).
    """
    durations = action_durations(chunks_per_copy, costs)
    forward, backward = durations[FORWARD], durations[backward_kind]
    if costs.FB is None and costs.A2A and forward + backward > 0:
        exchange = costs.A2A / chunks_per_copy
        pair = interleaved_pair_time(forward - exchange, backward - exchange, exchange, int(costs.A2A_SPLIT))
        return forward * pair / (forward + backward), backward * pair / (forward + backward)
    if costs.FB is None or forward + backward == 0:
        return forward, backward
    pair = costs.FB - (costs.W if backward_kind == BACKWARD_INPUT else 0.0)
    scale = max(pair, 0.0) / chunks_per_copy / (forward + backward)
    return forward * scale, backward * scale


def interleaved_pair_time(forward: float, backward: float, exchange: float, splits: int) -> float:
    """How long an overlapped pair runs interleaved (``ppctl.pipeline.interleave``): each half computes ``forward``
    (``backward``) in ``splits + 1`` equal pieces, each piece but the last followed by an exchange of
    ``exchange / splits``; one piece at a time, the next being the one whose half's exchange arrived first (the
    other half's on a tie: the halves alternate, as ``split_order``), the forward's first piece first."""
    pieces = {FORWARD_HALF: forward / (splits + 1), BACKWARD_HALF: backward / (splits + 1)}
    left = {FORWARD_HALF: splits + 1, BACKWARD_HALF: splits + 1}
    arrives = {FORWARD_HALF: 0.0, BACKWARD_HALF: 0.0}
    now, last = 0.0, BACKWARD_HALF
    while left[FORWARD_HALF] or left[BACKWARD_HALF]:
        half = min((half for half in left if left[half]), key=lambda half: (max(arrives[half], now), half == last))
        now = max(now, arrives[half]) + pieces[half]
        left[half] -= 1
        arrives[half], last = now + exchange / splits, half
    return now


@dataclass
class Replay:
    """What a replay reached: per-rank start and end times of the actions run, and where it stuck."""

    starts: list[list[float]]  # per rank, in program order, for the actions that ran
    ends: list[list[float]]
    stuck: list[tuple[int, Action, Any]]  # (rank, its next action, the message it waits for)
    stalled_batches: list[str]  # rendezvous only: each rank's p2p batch that never completed

    @property
    def deadlocked(self) -> bool:
        """True when some rank never finished its actions or its communication."""
        return bool(self.stuck or self.stalled_batches)

    def deadlock_message(self) -> str:
        """One line naming each stuck rank's next action and what it waits for."""
        parts = [f"rank {rank} stuck at {action} waiting for {message}" for rank, action, message in self.stuck]
        return "deadlock: " + "; ".join(parts + self.stalled_batches)


# One step as the engine runs it, a plain tuple (unpacked in the hot loop):
# (inputs, duration, local_output, sends, receives); messages are numbers, local_output None if none.
EngineStep = tuple[tuple[int, ...], float, Optional[int], tuple[int, ...], tuple[int, ...]]


@dataclass
class TimedProgram:
    """A program against a cost model: per rank, its actions and their engine steps, its initial receives."""

    actions: Sequence[Sequence[Action]]
    steps: list[list[EngineStep]]
    initial: Sequence[tuple[int, ...]]
    messages: Sequence  # message number -> message (only named in deadlock lines)

    @classmethod
    def of(cls, schedule: Schedule, messages: Sequence, initial: Sequence[tuple[int, ...]], columns: Sequence,
           costs: Costs = Costs(), pairs_as_one: bool = False) -> "TimedProgram":
        """Per rank, ``columns`` (inputs, local outputs, sends, receives) zipped with each action's duration.

        With ``costs.FB`` set, the two steps of each overlapped pair share its time
        (``pair_durations``); ``pairs_as_one`` also runs each pair as one overlapped action,
        as DualPipe does: it starts once the inputs of both halves are in, and the
        messages both halves send leave at its end. (Hand-overs on the rank need no moving:
        their consumers run on the same rank, so after the pair anyway.)
        """
        durations = action_durations(schedule.chunks_per_copy, costs)
        steps = []
        for rank_actions, (inputs, local_outputs, sends, receives) in zip(schedule.actions, columns):
            kinds = [action.kind for action in rank_actions]
            steps.append(list(zip(inputs, map(durations.__getitem__, kinds), local_outputs, sends, receives)))
        if costs.times_pairs:
            for pp_rank, rank_steps in enumerate(steps):
                _time_pairs(schedule, pp_rank, rank_steps, costs, pairs_as_one)
        if costs.A2A:
            for pp_rank, rank_steps in enumerate(steps):
                _time_fills(schedule, pp_rank, rank_steps, durations[BACKWARD_WEIGHT],
                            costs.A2A / schedule.chunks_per_copy)
        return cls(schedule.actions, steps, initial, messages)


def _time_pairs(schedule: Schedule, pp_rank: int, steps: list[EngineStep], costs: Costs, as_one: bool) -> None:
    """Give the two steps of each of ``pp_rank``'s overlapped pairs their share of its time (``TimedProgram.of``)."""
    for index in schedule.pair_starts(pp_rank):
        forward_time, backward_time = pair_durations(schedule.chunks_per_copy, costs,
                                                     schedule.actions[pp_rank][index + 1].kind)
        f_inputs, _, f_output, f_sends, f_receives = steps[index]
        b_inputs, _, b_output, b_sends, b_receives = steps[index + 1]
        if as_one:
            f_inputs, b_inputs, f_sends, b_sends = f_inputs + b_inputs, (), (), f_sends + b_sends
        steps[index] = (f_inputs, forward_time, f_output, f_sends, f_receives)
        steps[index + 1] = (b_inputs, backward_time, b_output, b_sends, b_receives)


def _time_fills(schedule: Schedule, pp_rank: int, steps: list[EngineStep], weight: float, exchange: float) -> None:
    """Each of ``pp_rank``'s weight fills (``Schedule.with_weight_fills``): the W computes while its backward waits
    for its exchanges (``exchange`` per chunk), so the backward keeps its time and the W takes what is left of its
    own (``weight``) beyond them."""
    for index in schedule.fill_starts(pp_rank):
        inputs, _, output, sends, receives = steps[index + 1]
        steps[index + 1] = (inputs, max(weight - exchange, 0.0), output, sends, receives)


@dataclass(frozen=True)
class StepGraph:
    """A program's steps as a dependency graph, for buffered sends at costs without overlapped pairs (no ``FB``).

    Each step waits for the step before it on its rank and for the step that made its input,
    which arrives ``comm`` later when it crosses ranks. Walked once in an order that puts every
    step after those two (``order``), it gives each step's end with the engine's arithmetic, so
    the same times as ``run_timed``: no ranks to wake, and the order is found once per program
    while the planner times it at many costs. The other columns are per step in ``order``'s order.
    """

    order: tuple[int, ...]  # every step's number (rank by rank, in program order), each after what it waits for
    previous: tuple[int, ...]  # the step before it on its rank; ``len(order)`` (a zero end) for a rank's first
    producer: tuple[int, ...]  # the step that made its input; ``len(order)`` where it takes none
    remote: tuple[int, ...]  # 1 where that input comes from another rank, else 0
    kinds: tuple[str, ...]
    rank_kinds: tuple[tuple[str, ...], ...]  # per rank, its steps' kinds in program order
    last: tuple[int, ...]  # per rank, its last step's number (``len(order)`` for a rank without one)

    @classmethod
    def of(cls, actions: Sequence[Sequence[Action]], columns: Sequence, num_messages: int) -> Optional["StepGraph"]:
        """The graph of per-rank ``actions`` with ``columns`` (inputs, local outputs, sends) per rank, messages
        numbered below ``num_messages``; None where a step takes several inputs (overlapped pairs run as one) or
        the steps deadlock (``run_timed`` names it)."""
        inputs: list[Optional[int]] = []
        made_by, remote = [-1] * num_messages, bytearray(num_messages)  # message -> its step; 1: between ranks
        for rank_inputs, local_outputs, sends in columns:
            for step, (numbers, local_output, sent) in enumerate(zip(rank_inputs, local_outputs, sends), len(inputs)):
                if len(numbers) > 1:
                    return None
                inputs.append(numbers[0] if numbers else None)
                if local_output is not None:
                    made_by[local_output] = step
                for number in sent:
                    made_by[number], remote[number] = step, 1
        rank_kinds = tuple(tuple(action.kind for action in rank_actions) for rank_actions in actions)
        return _walked(inputs, made_by, remote, rank_kinds)

    def finish_times(self, durations: dict[str, float], comm: float) -> list[float]:
        """Each rank's end of its last step (0.0 without one), with step kind -> ``durations`` and messages between
        ranks arriving ``comm`` after their step ends."""
        ends = self._ends(durations, comm)
        return [ends[step] for step in self.last]

    def rank_ends(self, durations: dict[str, float], comm: float) -> list[list[float]]:
        """Per rank, the end of each of its steps in program order: the ``ends`` of ``run_timed``'s ``Replay`` (the
        same floats), which ``lower``'s unit-cost replay reads."""
        ends, first, per_rank = self._ends(durations, comm), 0, []
        for kinds in self.rank_kinds:  # steps are numbered rank by rank
            per_rank.append(ends[first:first + len(kinds)])
            first += len(kinds)
        return per_rank

    def _ends(self, durations: dict[str, float], comm: float) -> list[float]:
        """Every step's end, by step number, and a last 0.0: the end of "none"."""
        ends = [0.0] * (len(self.order) + 1)
        delays = (0.0, comm)  # x + 0.0 is x: a hand-over on the rank arrives as its step ends, as in the engine
        for step, previous, producer, delay, duration in zip(self.order, self.previous, self.producer,
                                                             map(delays.__getitem__, self.remote),
                                                             map(durations.__getitem__, self.kinds)):
            start, arrived = ends[previous], ends[producer] + delay
            ends[step] = (arrived if arrived > start else start) + duration
        return ends


def _walked(inputs: list[Optional[int]], made_by: list[int], remote: bytearray,
            rank_kinds: tuple[tuple[str, ...], ...]) -> Optional[StepGraph]:
    """The ``StepGraph`` of steps numbered rank by rank, found by the engine's walk without times (a rank runs until
    a step's input is not made yet, then waits for its maker); None where some step is never reached."""
    kinds = [kind for rank_kind in rank_kinds for kind in rank_kind]
    none = len(inputs)
    done = bytearray(none + 1)
    done[none] = 1  # the maker of "no input"
    ranges, first = [], 0
    for rank_kind in rank_kinds:
        ranges.append(range(first, first + len(rank_kind)))
        first += len(rank_kind)
    makers = [none if number is None else made_by[number] for number in inputs]  # -1: never made
    waiting: dict[int, int] = {}  # step -> the rank that waits for it
    positions, ready = [steps.start for steps in ranges], deque(range(len(ranges)))
    order, previous = [], []
    while ready:
        pp_rank = ready.popleft()
        steps = ranges[pp_rank]
        position = steps.stop
        for step in range(positions[pp_rank], position):
            maker = makers[step]
            if maker < 0 or not done[maker]:
                waiting[maker] = pp_rank
                position = step
                break
            done[step] = 1
            order.append(step)
            previous.append(none if step == steps.start else step - 1)
            if step in waiting:
                ready.append(waiting.pop(step))
        positions[pp_rank] = position
    if len(order) < none:
        return None
    return StepGraph(tuple(order), tuple(previous), tuple(makers[step] for step in order),
                     tuple(0 if inputs[step] is None else remote[inputs[step]] for step in order),
                     tuple(kinds[step] for step in order), rank_kinds,
                     tuple(steps[-1] if steps else none for steps in ranges))


def run_timed(program: TimedProgram, comm: float = 0.0, rendezvous: bool = False) -> Replay:
    """Replay ``program`` with point-to-point latency ``comm``; see the module docstring for the transports."""
    engine = (_RendezvousEngine if rendezvous else _BufferedEngine)(program, comm)
    engine.run()
    return Replay(engine.starts, engine.ends, engine.stuck(), engine.stalled())


class _Engine:
    """Event-driven replay: a rank runs until it needs a message not yet there, then sleeps on it.

    A subclass is the transport: its ``_post`` issues one batch of sends and receives
    and delivers each message once its consumer can use it: ``available[number]`` gets
    the time, and the rank sleeping on it (if any) is ready again. That delivery is
    written out where it happens, on the hot paths, rather than called.
    """

    def __init__(self, program: TimedProgram, comm: float):
        self.program, self.comm = program, comm
        pp = len(program.steps)
        self.available: list[Optional[float]] = [None] * len(program.messages)  # time usable by consumer
        self.sleeping: dict[int, int] = {}  # message id -> the rank waiting for it
        self.starts: list[list[float]] = [[] for _ in range(pp)]
        self.ends: list[list[float]] = [[] for _ in range(pp)]
        self.ready: deque[int] = deque()

    def run(self) -> None:
        """Post the initial receives, then advance ranks until none can move."""
        for pp_rank, receives in enumerate(self.program.initial):
            self._post(pp_rank, (), receives, 0.0)
        self.ready.extend(range(len(self.program.steps)))
        self._advance_ready_ranks()

    def _advance_ready_ranks(self) -> None:
        """Run each ready rank's next actions until one needs a message not yet there; until none is ready.

        One loop for all ranks (not a call per rank): ranks wait and wake about once per action.
        """
        all_steps, all_starts, all_ends = self.program.steps, self.starts, self.ends
        available, sleeping, ready, post = self.available, self.sleeping, self.ready, self._post
        while ready:
            pp_rank = ready.popleft()
            steps, starts, ends = all_steps[pp_rank], all_starts[pp_rank], all_ends[pp_rank]
            free_at = ends[-1] if ends else 0.0
            for index in range(len(ends), len(steps)):
                inputs, duration, local_output, sends, receives = steps[index]
                start, missing = free_at, None
                for number in inputs:
                    arrived = available[number]
                    if arrived is None:
                        missing = number
                        break
                    if arrived > start:
                        start = arrived
                if missing is not None:
                    sleeping[missing] = pp_rank
                    break
                free_at = start + duration
                starts.append(start)
                ends.append(free_at)
                if local_output is not None:
                    available[local_output] = free_at  # delivered
                    if local_output in sleeping:
                        ready.append(sleeping.pop(local_output))
                if sends or receives:
                    post(pp_rank, sends, receives, free_at)

    def _post(self, pp_rank: int, sends: tuple[int, ...], receives: tuple[int, ...], time: float) -> None:
        """Issue one batch of point-to-point operations of ``pp_rank`` at ``time``."""
        raise NotImplementedError

    def stuck(self) -> list[tuple[int, Action, Any]]:
        """Ranks that did not finish, with their next action and the message they sleep on."""
        waiting_for = {rank: self.program.messages[number] for number, rank in self.sleeping.items()}
        actions = self.program.actions
        return [(pp_rank, actions[pp_rank][len(ends)], waiting_for[pp_rank])
                for pp_rank, ends in enumerate(self.ends) if len(ends) < len(actions[pp_rank])]

    def stalled(self) -> list[str]:
        """Each rank's point-to-point batch that never completed (none, unless sends can block)."""
        return []


class _BufferedEngine(_Engine):
    """Sends complete on their own; a message is there ``comm`` after it was sent."""

    def _post(self, pp_rank: int, sends: tuple[int, ...], receives: tuple[int, ...], time: float) -> None:
        """Deliver each sent message ``comm`` later; receives need no posting."""
        arrives_at = time + self.comm
        available, sleeping = self.available, self.sleeping
        for number in sends:
            available[number] = arrives_at  # delivered
            if number in sleeping:
                self.ready.append(sleeping.pop(number))


# A batch of one rank's point-to-point operations issued together, a list (built and updated
# often): [remaining operations, done at, started at (None: not yet), rank, posted at, sends, receives].
_REMAINING, _DONE_AT, _STARTED_AT, _RANK, _POSTED_AT, _SENDS, _RECEIVES = range(7)


class _RendezvousEngine(_Engine):
    """NCCL-like: per rank, batches run one after another; a message moves when both sides' batches run."""

    def __init__(self, program: TimedProgram, comm: float):
        super().__init__(program, comm)
        pp = len(program.steps)
        self.streams: list[list[list]] = [[] for _ in range(pp)]  # per rank, its batches in order
        self.head = [0] * pp  # index of each rank's first batch not completed
        self.send_batch: list[Optional[list]] = [None] * len(program.messages)  # message -> its batches
        self.receive_batch: list[Optional[list]] = [None] * len(program.messages)

    def _post(self, pp_rank: int, sends: tuple[int, ...], receives: tuple[int, ...], time: float) -> None:
        """Queue one batch on ``pp_rank``'s stream; start it if the stream is idle."""
        if not sends and not receives:
            return
        batch = [len(sends) + len(receives), time, None, pp_rank, time, sends, receives]
        send_batch, receive_batch = self.send_batch, self.receive_batch
        for number in sends:
            send_batch[number] = batch
        for number in receives:
            receive_batch[number] = batch
        stream = self.streams[pp_rank]
        stream.append(batch)
        if len(stream) - 1 == self.head[pp_rank]:
            self._start(batch, time)

    def _start(self, first: list, time: float) -> None:
        """Start ``first`` and every batch that can start in consequence, in FIFO order.

        A started batch moves every message whose other side has started: its sends
        first, then its receives, each in order.
        """
        to_start = [(first, time)]
        send_batch, receive_batch, move = self.send_batch, self.receive_batch, self._move
        for batch, started_at in to_start:  # grows while it is walked
            batch[_STARTED_AT] = started_at
            for number in batch[_SENDS]:
                receiving = receive_batch[number]
                if receiving is not None and receiving[_STARTED_AT] is not None:
                    move(batch, receiving, to_start)
            for number in batch[_RECEIVES]:
                sending = send_batch[number]
                if sending is not None and sending[_STARTED_AT] is not None:
                    move(sending, batch, to_start)

    def _move(self, sending: list, receiving: list, to_start: list) -> None:
        """One message moves, both batches having started; a batch whose last message moved completes."""
        moved_at = max(receiving[_STARTED_AT], sending[_STARTED_AT]) + self.comm
        for batch in (sending, receiving):
            batch[_REMAINING] -= 1
            if moved_at > batch[_DONE_AT]:
                batch[_DONE_AT] = moved_at
            if batch[_REMAINING] == 0:
                self._complete(batch, to_start)

    def _complete(self, batch: list, to_start: list) -> None:
        """Deliver a completed batch's receives and queue the next batch of its rank."""
        done_at = batch[_DONE_AT]
        available, sleeping = self.available, self.sleeping
        for number in batch[_RECEIVES]:
            available[number] = done_at  # delivered
            if number in sleeping:
                self.ready.append(sleeping.pop(number))
        pp_rank = batch[_RANK]
        head = self.head[pp_rank] = self.head[pp_rank] + 1
        stream = self.streams[pp_rank]
        if head < len(stream):
            following = stream[head]
            to_start.append((following, max(following[_POSTED_AT], done_at)))

    def stalled(self) -> list[str]:
        """Each rank's first batch that never completed, with the operations it is stuck on."""
        lines = []
        messages = self.program.messages
        for pp_rank, stream in enumerate(self.streams):
            if self.head[pp_rank] < len(stream):
                batch = stream[self.head[pp_rank]]
                pending = [f"send {messages[n]}" for n in batch[_SENDS] if self._pending(n)]
                pending += [f"recv {messages[n]}" for n in batch[_RECEIVES] if self._pending(n)]
                lines.append(f"rank {pp_rank} p2p stream blocked on " + ", ".join(pending))
        return lines

    def _pending(self, number: int) -> bool:
        """Whether message ``number`` has not moved (a side not posted, or not started)."""
        sending, receiving = self.send_batch[number], self.receive_batch[number]
        return sending is None or receiving is None or sending[_STARTED_AT] is None or receiving[_STARTED_AT] is None
