"""Replay a schedule's communication plan against a cost model: timelines, makespan, bubble, memory.

One replay engine serves the simulator and the checker's deadlock detection. It
walks every rank's ``ActionStep`` list in order: an action starts once its rank is
free and its inputs are there; its outputs become available to their consumers
(after ``comm`` when they cross ranks). A rank that waits for a message nobody will
produce is stuck; if ranks remain stuck when nothing can move, the schedule deadlocks.

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

Cost model: ``Costs.F`` (``B``, ``W``) is the time of one microbatch through ALL the
layers of a rank; a chunk's action takes that divided by ``chunks_per_rank``; an
unsplit backward ``BW`` takes ``B + W``. Peak activations are counted in the same
unit: a chunk-level activation in flight counts ``1 / chunks_per_rank``.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple, Optional, Sequence

from .comm import ACTIVATION, GRADIENT, ActionStep, CommPlan, Message, initial_receives, output_message
from .schedules.base import BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, Action, Schedule, ScheduleError


@dataclass(frozen=True)
class Costs:
    """Times of one microbatch through all of a rank's layers, and the point-to-point latency."""

    F: float = 1.0
    B: float = 1.0
    W: float = 1.0
    comm: float = 0.0

    def to_json(self) -> dict:
        """The costs as a plain dict (keys F, B, W, comm)."""
        return {"F": self.F, "B": self.B, "W": self.W, "comm": self.comm}


def parse_costs(text: str) -> Costs:
    """Parse ``"F=1,B=2,W=1,comm=0.1"`` (any subset, any order) into ``Costs``; ValueError if malformed."""
    values: dict[str, float] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or key not in Costs.__dataclass_fields__:
            raise ValueError(f"cost {item!r} in {text!r} must be KEY=NUMBER with KEY one of F, B, W, comm")
        try:
            values[key] = float(value)
        except ValueError:
            raise ValueError(f"cost {key}={value.strip()!r} in {text!r} is not a number") from None
        if values[key] < 0:
            raise ValueError(f"cost {key}={values[key]} in {text!r} must not be negative")
    return Costs(**values)


@dataclass
class TimedAction:
    """One action with its start and end time (simulated, or measured by a real run)."""

    kind: str
    stage: int
    microbatch: int
    start: float
    end: float


@dataclass
class RankTimeline:
    """One rank's timed actions, its peak in-flight activations and optional idle intervals.

    ``waits`` are intervals the rank spent waiting for communication (a measured
    run records them; the simulator leaves them empty).
    """

    rank: int
    actions: list[TimedAction]
    peak_activations: float
    waits: list[tuple[float, float]] = field(default_factory=list)


@dataclass
class SimResult:
    """The simulated timeline of one step of a schedule under a cost model."""

    schedule: str
    pp: int
    vpp: int
    num_microbatches: int
    costs: Costs
    ranks: list[RankTimeline]
    makespan: float
    bubble_ratio: float

    def to_json(self) -> dict:
        """The result as plain data (the ``inspect-schedule --json`` contract)."""
        return {
            "schedule": self.schedule,
            "pp": self.pp,
            "vpp": self.vpp,
            "microbatches": self.num_microbatches,
            "costs": self.costs.to_json(),
            "makespan": self.makespan,
            "bubble_ratio": self.bubble_ratio,
            "ranks": [_rank_json(timeline) for timeline in self.ranks],
        }


def _rank_json(timeline: RankTimeline) -> dict:
    actions = [{"kind": a.kind, "stage": a.stage, "microbatch": a.microbatch, "start": a.start, "end": a.end}
               for a in timeline.actions]
    return {"rank": timeline.rank, "peak_activations": timeline.peak_activations, "actions": actions}


# --- the simulator ------------------------------------------------------------------------

def simulate(schedule: Schedule, costs: Costs = Costs()) -> SimResult:
    """Replay ``schedule`` against ``costs``; raises ``ScheduleError`` if it deadlocks."""
    outcome = replay(schedule, costs=costs)
    if outcome.deadlocked:
        raise ScheduleError(f"{schedule.name}: {outcome.deadlock_message()}")
    ranks = []
    for pp_rank, rank_actions in enumerate(schedule.actions):
        timed = [TimedAction(action.kind, action.stage, action.microbatch, start, end)
                 for action, start, end in zip(rank_actions, outcome.starts[pp_rank], outcome.ends[pp_rank])]
        ranks.append(RankTimeline(pp_rank, timed, peak_activations(rank_actions, schedule.chunks_per_rank)))
    makespan = max((ends[-1] for ends in outcome.ends if ends), default=0.0)
    durations = _durations(schedule.chunks_per_rank, costs)
    busiest = max(sum(durations[action.kind] for action in rank_actions) for rank_actions in schedule.actions)
    bubble_ratio = (makespan - busiest) / busiest if busiest > 0 else 0.0
    return SimResult(schedule.name, schedule.pp, schedule.chunks_per_rank, schedule.num_microbatches,
                     costs, ranks, makespan, bubble_ratio)


def _durations(chunks_per_rank: int, costs: Costs) -> dict[str, float]:
    return {
        FORWARD: costs.F / chunks_per_rank,
        BACKWARD_INPUT: costs.B / chunks_per_rank,
        BACKWARD_WEIGHT: costs.W / chunks_per_rank,
        BACKWARD: (costs.B + costs.W) / chunks_per_rank,
    }


def peak_activations(rank_actions: Sequence[Action], chunks_per_rank: int) -> float:
    """Most chunk activations one rank holds at once (forward done, B/BW not yet), in whole-rank units.

    One microbatch through one chunk counts ``1 / chunks_per_rank``, so the result is
    comparable across schedules: 1.0 is one microbatch through all of the rank's layers.
    """
    in_flight = peak = 0
    for action in rank_actions:
        if action.kind == FORWARD:
            in_flight += 1
            peak = max(peak, in_flight)
        elif action.kind in (BACKWARD, BACKWARD_INPUT):
            in_flight -= 1
    return peak / chunks_per_rank


# --- the replay engine -------------------------------------------------------------------

@dataclass
class Replay:
    """What a replay reached: per-rank start and end times of the actions run, and where it stuck."""

    starts: list[list[float]]  # per rank, in plan order, for the actions that ran
    ends: list[list[float]]
    stuck: list[tuple[int, Action, Message]]  # (rank, its next action, the message it waits for)
    stalled_batches: list[str]  # rendezvous only: each rank's p2p batch that never completed

    @property
    def deadlocked(self) -> bool:
        """True when some rank never finished its actions or its communication."""
        return bool(self.stuck or self.stalled_batches)

    def deadlock_message(self) -> str:
        """One line naming each stuck rank's next action and what it waits for."""
        parts = [f"rank {rank} stuck at {action} waiting for {message}" for rank, action, message in self.stuck]
        return "deadlock: " + "; ".join(parts + self.stalled_batches)


def replay(schedule: Schedule, plan: Optional[CommPlan] = None, costs: Costs = Costs(),
           rendezvous: bool = False) -> Replay:
    """Run every rank's actions against ``costs``; see the module docstring for the two transports.

    With ``plan`` the replay follows the communication plan step by step, receives
    posted as the runtime posts them (what the checker needs); without it, the
    schedule's actions with their inputs and outputs from stage adjacency, buffered
    (what the simulator and the planner need, and faster).
    """
    if plan is None:
        if rendezvous:
            raise ValueError("a rendezvous replay needs the communication plan")
        program = _compile_schedule(schedule, costs)
    else:
        program = _compile_plan(schedule, plan, costs)
    transport = _RendezvousTransport(program, costs.comm) if rendezvous else _BufferedTransport(costs.comm)
    engine = _Engine(program, transport)
    engine.run()
    return Replay(engine.starts, engine.ends, engine.stuck(), transport.stalled())


class _Step(NamedTuple):
    """One action compiled for replay; messages are numbers."""

    inputs: tuple[int, ...]
    duration: float
    local_output: int  # -1 when the action hands nothing to its own rank
    sends: tuple[int, ...]
    post_first: tuple[int, ...]  # waits not posted yet: the runtime posts them before waiting
    prefetch: tuple[int, ...]


@dataclass
class _Program:
    """A plan or schedule compiled for replay."""

    actions: list[Sequence[Action]]
    steps: list[list[_Step]]
    initial: list[tuple[int, ...]]  # receives each rank posts before its first action
    messages: list  # number -> Message, or a (src stage, dst stage, microbatch, step) key
    placement: tuple[int, ...]

    def message(self, number: int) -> Message:
        """The message numbered ``number``."""
        key = self.messages[number]
        if isinstance(key, Message):
            return key
        src_stage, dst_stage, microbatch, step = key
        return Message(ACTIVATION if dst_stage > src_stage else GRADIENT, src_stage, dst_stage, microbatch,
                       self.placement[src_stage], self.placement[dst_stage], step)


class _Numbering(dict):
    """Gives each distinct message (or message key) the next number."""

    def __init__(self) -> None:
        super().__init__()
        self.keys: list = []

    def number(self, key) -> int:
        """The number of ``key``, assigned on first sight."""
        number = self.get(key)
        if number is None:
            number = self[key] = len(self.keys)
            self.keys.append(key)
        return number

    def numbers(self, keys: Sequence) -> tuple[int, ...]:
        """The numbers of ``keys``, in order."""
        if not keys:  # the usual cases, kept cheap
            return ()
        if len(keys) == 1:
            return (self.number(keys[0]),)
        return tuple([self.number(key) for key in keys])


def _compile_schedule(schedule: Schedule, costs: Costs) -> _Program:
    """Inputs and outputs of each action from stage adjacency; no receives to post (buffered replay)."""
    numbering = _Numbering()
    durations = _durations(schedule.chunks_per_rank, costs)
    steps = [[_schedule_step(schedule.placement, action, durations[action.kind], numbering)
              for action in rank_actions] for rank_actions in schedule.actions]
    return _Program(list(schedule.actions), steps, [() for _ in steps], numbering.keys, schedule.placement)


_OUTPUT_DIRECTION = {FORWARD: 1, BACKWARD: -1, BACKWARD_INPUT: -1}  # where an action's output goes


def _schedule_step(placement: tuple[int, ...], action: Action, duration: float, numbering: _Numbering) -> _Step:
    stage, direction = action.stage, _OUTPUT_DIRECTION.get(action.kind)
    if direction is None:
        return _Step((), duration, -1, (), (), ())
    source, target = stage - direction, stage + direction
    inputs = ()
    if 0 <= source < len(placement):
        inputs = (numbering.number((source, stage, action.microbatch, action.step)),)
    local_output, sends = -1, ()
    if 0 <= target < len(placement):
        number = numbering.number((stage, target, action.microbatch, action.step))
        local_output, sends = (number, ()) if placement[target] == placement[stage] else (-1, (number,))
    return _Step(inputs, duration, local_output, sends, (), ())


def _hands_over_locally(placement: tuple[int, ...], action: Action) -> bool:
    """Whether ``action``'s output goes to a stage on the same rank."""
    direction = _OUTPUT_DIRECTION.get(action.kind)
    target = action.stage + direction if direction is not None else -1
    return 0 <= target < len(placement) and placement[target] == placement[action.stage]


def _compile_plan(schedule: Schedule, plan: CommPlan, costs: Costs) -> _Program:
    """Each step as the runtime runs it: post missing waits, wait, compute, send and prefetch."""
    numbering = _Numbering()
    durations = _durations(schedule.chunks_per_rank, costs)
    initial = [numbering.numbers(initial_receives(plan, pp_rank)) for pp_rank in range(len(plan))]
    steps = []
    for pp_rank, rank_steps in enumerate(plan):
        posted = set(initial[pp_rank])
        steps.append([_plan_step(schedule, step, durations[step.action.kind], numbering, posted)
                      for step in rank_steps])
    actions = [[step.action for step in rank_steps] for rank_steps in plan]
    return _Program(actions, steps, initial, numbering.keys, schedule.placement)


def _plan_step(schedule: Schedule, step: ActionStep, duration: float, numbering: _Numbering,
               posted: set[int]) -> _Step:
    waits, post_first, prefetch = numbering.numbers(step.waits), (), ()
    if waits:
        post_first = tuple([number for number in waits if number not in posted])
        posted.update(post_first)
    if step.prefetch:
        prefetch = tuple([number for number in numbering.numbers(step.prefetch) if number not in posted])
        posted.update(prefetch)
    local_output = -1
    if _hands_over_locally(schedule.placement, step.action):
        local_output = numbering.number(output_message(schedule, step.action))
    return _Step(waits + numbering.numbers(step.local_inputs), duration, local_output,
                 numbering.numbers(step.sends), post_first, prefetch)


class _Engine:
    """Event-driven replay: a rank runs until it needs a message not yet there, then sleeps on it."""

    def __init__(self, program: _Program, transport):
        self.program, self.transport = program, transport
        pp = len(program.steps)
        self.available: list[Optional[float]] = [None] * len(program.messages)  # time usable by consumer
        self.sleeping: dict[int, int] = {}  # message id -> the rank waiting for it
        self.starts: list[list[float]] = [[] for _ in range(pp)]
        self.ends: list[list[float]] = [[] for _ in range(pp)]
        self.ready: deque[int] = deque()

    def run(self) -> None:
        """Post the initial receives, then advance ranks until none can move."""
        for pp_rank, receives in enumerate(self.program.initial):
            self._arrive(self.transport.post(pp_rank, (), receives, 0.0))
        self.ready.extend(range(len(self.program.steps)))
        while self.ready:
            self._advance(self.ready.popleft())

    def _advance(self, pp_rank: int) -> None:
        steps, starts, ends = self.program.steps[pp_rank], self.starts[pp_rank], self.ends[pp_rank]
        available = self.available
        free_at = ends[-1] if ends else 0.0
        for index in range(len(ends), len(steps)):
            inputs, duration, local_output, sends, post_first, prefetch = steps[index]
            if post_first:
                self._arrive(self.transport.post(pp_rank, (), post_first, free_at))
            start = free_at
            for number in inputs:
                arrived = available[number]
                if arrived is None:
                    self.sleeping[number] = pp_rank
                    return
                if arrived > start:
                    start = arrived
            free_at = start + duration
            starts.append(start)
            ends.append(free_at)
            if local_output >= 0:
                self._arrive([(local_output, free_at)])
            if sends or prefetch:
                self._arrive(self.transport.post(pp_rank, sends, prefetch, free_at))

    def _arrive(self, arrivals: list[tuple[int, float]]) -> None:
        for number, time in arrivals:
            self.available[number] = time
            waiter = self.sleeping.pop(number, None)
            if waiter is not None:
                self.ready.append(waiter)

    def stuck(self) -> list[tuple[int, Action, Message]]:
        """Ranks that did not finish, with their next action and the message they sleep on."""
        waiting_for = {rank: self.program.message(number) for number, rank in self.sleeping.items()}
        actions = self.program.actions
        return [(pp_rank, actions[pp_rank][len(ends)], waiting_for[pp_rank])
                for pp_rank, ends in enumerate(self.ends) if len(ends) < len(actions[pp_rank])]


class _BufferedTransport:
    """Sends complete on their own; a message is there ``comm`` after it was sent."""

    def __init__(self, comm: float):
        self.comm = comm

    def post(self, pp_rank: int, sends: tuple[int, ...], receives: tuple[int, ...],
             time: float) -> list[tuple[int, float]]:
        """Issue one batch; returns the message ids that became available, with their times."""
        return [(number, time + self.comm) for number in sends]

    def stalled(self) -> list[str]:
        """Buffered sends never stall."""
        return []


class _Batch:
    """One rank's point-to-point operations issued together."""

    __slots__ = ("pp_rank", "sends", "receives", "posted_at", "remaining", "started_at", "done_at")

    def __init__(self, pp_rank: int, sends: tuple[int, ...], receives: tuple[int, ...], posted_at: float):
        self.pp_rank, self.sends, self.receives, self.posted_at = pp_rank, sends, receives, posted_at
        self.remaining = len(sends) + len(receives)
        self.started_at: Optional[float] = None
        self.done_at = posted_at


class _RendezvousTransport:
    """NCCL-like: per rank, batches run one after another; a message moves when both sides' batches run."""

    def __init__(self, program: _Program, comm: float):
        self.program, self.comm = program, comm
        pp = len(program.steps)
        self.streams: list[list[_Batch]] = [[] for _ in range(pp)]
        self.head = [0] * pp  # index of each rank's first batch not completed
        self.send_batch: dict[int, _Batch] = {}
        self.receive_batch: dict[int, _Batch] = {}

    def post(self, pp_rank: int, sends: tuple[int, ...], receives: tuple[int, ...],
             time: float) -> list[tuple[int, float]]:
        """Issue one batch; returns the received message ids whose batches completed, with their times."""
        if not sends and not receives:
            return []
        batch = _Batch(pp_rank, sends, receives, time)
        self.send_batch.update((number, batch) for number in sends)
        self.receive_batch.update((number, batch) for number in receives)
        stream = self.streams[pp_rank]
        stream.append(batch)
        if len(stream) - 1 != self.head[pp_rank]:
            return []
        return self._start(batch, time)

    def _start(self, first: _Batch, time: float) -> list[tuple[int, float]]:
        arrivals: list[tuple[int, float]] = []
        to_start = deque([(first, time)])
        while to_start:
            batch, started_at = to_start.popleft()
            batch.started_at = started_at
            for number in batch.sends:
                self._try_move(self.receive_batch.get(number), batch, to_start, arrivals)
            for number in batch.receives:
                self._try_move(batch, self.send_batch.get(number), to_start, arrivals)
        return arrivals

    def _try_move(self, receiving: Optional[_Batch], sending: Optional[_Batch],
                  to_start: deque, arrivals: list) -> None:
        if receiving is None or sending is None or receiving.started_at is None or sending.started_at is None:
            return
        moved_at = max(receiving.started_at, sending.started_at) + self.comm
        for batch in (sending, receiving):
            batch.remaining -= 1
            batch.done_at = max(batch.done_at, moved_at)
            if batch.remaining == 0:
                self._complete(batch, to_start, arrivals)

    def _complete(self, batch: _Batch, to_start: deque, arrivals: list) -> None:
        arrivals.extend((number, batch.done_at) for number in batch.receives)
        self.head[batch.pp_rank] += 1
        stream = self.streams[batch.pp_rank]
        if self.head[batch.pp_rank] < len(stream):
            following = stream[self.head[batch.pp_rank]]
            to_start.append((following, max(following.posted_at, batch.done_at)))

    def stalled(self) -> list[str]:
        """Each rank's first batch that never completed, with the operations it is stuck on."""
        lines = []
        for pp_rank, stream in enumerate(self.streams):
            if self.head[pp_rank] < len(stream):
                batch = stream[self.head[pp_rank]]
                pending = [f"send {self.program.message(n)}" for n in batch.sends if self._pending(n)]
                pending += [f"recv {self.program.message(n)}" for n in batch.receives if self._pending(n)]
                lines.append(f"rank {pp_rank} p2p stream blocked on " + ", ".join(pending))
        return lines

    def _pending(self, number: int) -> bool:
        sending, receiving = self.send_batch.get(number), self.receive_batch.get(number)
        return sending is None or receiving is None or sending.started_at is None or receiving.started_at is None
