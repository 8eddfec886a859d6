"""Simulate a schedule against a cost model: timelines, makespan, bubble, memory.

The simulator times the schedule's lowered program (``ppctl.pipeline.program``) with
the replay engine (``ppctl.pipeline.replay``), sends buffered: a message arrives
``comm`` after its producer finished.

Cost model (``ppctl.pipeline.replay``): ``Costs.F`` (``B``, ``W``, ``FB``) is the time of
one microbatch through the layers it meets on a rank (all of the rank's layers, or its
layers of one model copy when it holds several); a chunk's action takes that divided by
``Schedule.chunks_per_copy``; an unsplit backward ``BW`` takes ``B + W``; the two halves of
an overlapped pair share ``FB``. Peak activations are counted in the same unit: a
chunk-level activation in flight counts ``1 / chunks_per_copy``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, replace
from operator import itemgetter
from typing import Optional, Sequence, Union

from .program import Program, SendsOnly, lower, rank_changes_in_front
from .replay import Costs, Replay, TimedProgram, action_durations, gc_paused, run_timed
from .schedules import stream_of, streams_steps
from .interleave import split_order
from .shared_cores import shared_finish_times
from .schedules.base import BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, Action, FORWARD, Schedule, ScheduleError

__all__ = ["MAX_COST", "Costs", "RankTimeline", "Replay", "SimResult", "TimedAction", "makespan_floor", "parse_costs",
           "peak_activations", "replay", "simulate", "simulate_makespan", "simulate_shared_makespan", "simulate_steps"]


def parse_costs(text: str) -> Costs:
    """Parse ``"F=1,B=2,W=1,FB=2.5,A2A=0.5,A2A_SPLIT=4,comm=0.1"`` (any subset, any order) into ``Costs``; ValueError if
    malformed."""
    return Costs(**parse_cost_values(text))


# The largest time a cost may be given: the sums of a timeline's costs (a million actions) stay finite
MAX_COST = 1e12


def parse_cost_values(text: str) -> dict[str, float]:
    """The costs ``text`` names (``"F=1,comm=0.1"`` -> ``{"F": 1.0, "comm": 0.1}``); ValueError if malformed, or
    if a cost is not a finite number from 0 to ``MAX_COST``."""
    values: dict[str, float] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or key not in Costs.__dataclass_fields__:
            raise ValueError(f"{item!r} is not KEY=NUMBER with KEY one of F, B, W, FB, A2A, A2A_SPLIT, comm")
        try:
            values[key] = float(value)
        except ValueError:
            raise ValueError(f"{key}={value.strip()!r} is not a number") from None
        if not 0 <= values[key] <= MAX_COST:  # NaN fails it too
            raise ValueError(f"{key}={value.strip()} is not a finite number from 0 to {MAX_COST:.0e} (a time; "
                             "the sums of a timeline's times must stay finite)")
        if key == "A2A_SPLIT" and not (values[key] >= 1 and values[key] == int(values[key])):
            raise ValueError(f"A2A_SPLIT={value.strip()} must be a whole number >= 1 (the exchanges per chunk that "
                             "cut each half of an overlapped pair)")
    return values


@dataclass
class TimedAction:
    """One action with its start and end time (simulated, or measured by a real run).

    ``pair`` numbers the rank's overlapped forward-backward pairs: both halves of one
    pair carry its number; None for an action outside a pair. ``fill`` numbers its weight
    fills the same way (``Schedule.with_weight_fills``).
    """

    kind: str
    stage: int
    microbatch: int
    start: float
    end: float
    pair: Optional[int] = None
    fill: Optional[int] = None


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
    """The simulated timeline of one step of a schedule under a cost model.

    ``copies`` is the number of model copies the schedule holds (DualPipe: 2), so each
    rank holds ``copies / pp`` of the model's parameters. ``program`` is the lowered
    program the timeline replays.
    """

    schedule: str
    pp: int
    vpp: int
    num_microbatches: int
    costs: Costs
    ranks: list[RankTimeline]
    makespan: float
    bubble_ratio: float
    copies: int = 1
    program: Optional[Program] = None  # the lowered program simulated (None: a measured timeline)
    steps: int = 1  # consecutive steps shown; step k's microbatches are k*num_microbatches onwards
    weight_versions: int = 1  # weight versions each rank keeps (PipeDream-2BW: 2)

    def pair_split(self) -> list[tuple[str, int]]:
        """With an all-to-all cost and overlapped pairs, the order an interleaved pair runs its halves' pieces
        (``ppctl.pipeline.interleave.split_order`` at ``Costs.A2A_SPLIT`` exchanges each); else empty."""
        if not self.costs.A2A or self.program is None or not self.program.schedule.overlapped:
            return []
        splits = int(self.costs.A2A_SPLIT)
        return split_order(splits, splits)

    def exposed_exchanges(self) -> list[float]:
        """Per rank, the expert all-to-all time (``Costs.A2A``) its actions spend beyond their compute: all of it
        in a plain forward or backward, what the other half's compute does not cover in an overlapped pair."""
        if self.program is None:
            return []  # a measured timeline: its costs are not split
        compute = action_durations(self.program.schedule.chunks_per_copy, replace(self.costs, A2A=0.0, FB=None))
        return [sum(action.end - action.start - compute[action.kind] for action in timeline.actions)
                for timeline in self.ranks]

    def idle_times(self) -> list[float]:
        """Per rank, the makespan less the rank's compute time: its bubble (what DualPipe's table calls one)."""
        return [self.makespan - sum(action.end - action.start for action in timeline.actions)
                for timeline in self.ranks]

    def step_ends(self) -> list[float]:
        """When each step's last action ends, over all ranks."""
        ends = [0.0] * self.steps
        for timeline in self.ranks:
            for action in timeline.actions:
                step = action.microbatch // self.num_microbatches
                ends[step] = max(ends[step], action.end)
        return ends

    def beyond_the_fill(self) -> Optional[tuple[float, float]]:
        """(the fill, the idle time beyond it): the fill is the longest wait of a rank for its first input (the
        forwards of the stages before its first, at the costs' chunk F); beyond it, the makespan less the least
        any order could take, max over ranks of that wait plus the rank's compute. None without a program."""
        if self.program is None:
            return None
        placement = self.program.schedule.placement
        chunk_forward = self.costs.F / self.program.schedule.chunks_per_copy
        waits = [min(placement.model_stage(stage) for stage in placement.stages_of(rank)) * chunk_forward
                 for rank in range(self.pp)]
        least = max(wait + sum(action.end - action.start for action in timeline.actions)
                    for wait, timeline in zip(waits, self.ranks))
        return max(waits), self.makespan - least

    def steady_step(self) -> tuple[float, float]:
        """(time per step, bubble ratio per step) after the first step: what a long run pays per step.

        The bubble is against the busiest rank's compute per step; with one step, the step's own.
        """
        if self.steps == 1:
            return self.makespan, self.bubble_ratio
        ends = self.step_ends()
        step_time = (ends[-1] - ends[0]) / (self.steps - 1)
        compute = max(sum(action.end - action.start for action in timeline.actions)
                      for timeline in self.ranks) / self.steps
        return step_time, (step_time - compute) / compute if compute > 0 else 0.0

    def to_json(self) -> dict:
        """The result as plain data (the ``inspect-schedule --json`` contract)."""
        step_time, step_bubble = self.steady_step()
        split = self.pair_split()
        return {
            "schedule": self.schedule,
            "pp": self.pp,
            "vpp": self.vpp,
            "microbatches": self.num_microbatches,
            "costs": self.costs.to_json(),
            "makespan": self.makespan,
            "bubble_ratio": self.bubble_ratio,
            "steps": self.steps,
            "step_ends": self.step_ends(),
            "steady_step_time": step_time,
            "steady_bubble_ratio": step_bubble,
            "weight_versions": self.weight_versions,
            "ranks": [_rank_json(timeline) for timeline in self.ranks],
            **({"exposed_a2a": self.exposed_exchanges()} if self.costs.A2A else {}),
            **({"pair_split": [list(piece) for piece in split]} if split else {}),
            **({"program": self.program.to_json()} if self.program is not None else {}),
        }


def _rank_json(timeline: RankTimeline) -> dict:
    """One rank of ``SimResult.to_json``; an action in an overlapped pair (a weight fill) also has its ``pair``
    (``fill``) number."""
    actions = []
    for a in timeline.actions:
        action = {"kind": a.kind, "stage": a.stage, "microbatch": a.microbatch, "start": a.start, "end": a.end}
        if a.pair is not None:
            action["pair"] = a.pair
        if a.fill is not None:
            action["fill"] = a.fill
        actions.append(action)
    return {"rank": timeline.rank, "peak_activations": timeline.peak_activations, "actions": actions}


# --- the simulator ------------------------------------------------------------------------

def simulate_steps(schedule: Schedule, steps: int, costs: Costs = Costs()) -> SimResult:
    """``steps`` consecutive steps of ``schedule``: one stream when the schedule streams steps (PipeDream-2BW, two
    weight versions), else its step repeated, each starting when the last ended (a flush and a synchronous optimizer
    step between)."""
    if streams_steps(schedule):
        result = simulate(stream_of(schedule, steps), costs)
        return dataclasses.replace(result, num_microbatches=schedule.num_microbatches, steps=steps, weight_versions=2)
    one = simulate(schedule, costs)
    if steps == 1:
        return one
    shift = [(step * schedule.num_microbatches, step * one.makespan) for step in range(steps)]
    # made directly: ``dataclasses.replace`` took most of the time of a long --steps
    ranks = [RankTimeline(timeline.rank, [TimedAction(action.kind, action.stage, action.microbatch + microbatches,
                                                      action.start + time, action.end + time, action.pair,
                                                      action.fill)
                                          for microbatches, time in shift for action in timeline.actions],
                          timeline.peak_activations)
             for timeline in one.ranks]
    return dataclasses.replace(one, ranks=ranks, makespan=one.makespan * steps, steps=steps)


@gc_paused
def simulate(schedule: Union[Schedule, Program], costs: Costs = Costs()) -> SimResult:
    """Replay the program of ``schedule`` (lowered here unless given) against ``costs``; ScheduleError on deadlock.

    The bubble ratio is (makespan - the busiest rank's compute) / that compute.
    """
    program = schedule if isinstance(schedule, Program) else lower(schedule)
    schedule = program.schedule
    timed = program.timed(costs, pairs_as_one=True)
    outcome = _replayed(schedule, timed, costs)
    ranks = [RankTimeline(pp_rank, _timed_actions(schedule, pp_rank, outcome),
                          peak_activations(rank_actions, schedule.chunks_per_copy))
             for pp_rank, rank_actions in enumerate(schedule.actions)]
    makespan, bubble_ratio = _makespan_and_bubble(timed, outcome)
    return SimResult(schedule.name, schedule.pp, schedule.chunks_per_rank, schedule.num_microbatches,
                     costs, ranks, makespan, bubble_ratio, schedule.placement.copies, program)


@gc_paused
def simulate_makespan(program: Union[Program, SendsOnly], costs: Costs = Costs()) -> tuple[float, float]:
    """(makespan, bubble ratio) of ``simulate``, the timelines left out; ScheduleError on deadlock.

    ``program`` may be the schedule's ``SendsOnly`` (``sends_only``): the replay posts no
    receive, so it times that as it times the lowered program, and the planner skips the
    lowering of the thousands of candidates it only times. Without ``FB`` the replay walks the
    program's ``StepGraph`` (made once per program), the same times at a fraction of the cost.
    """
    graph = program.graph if not costs.times_pairs else None  # a pair's steps share its time: the engine runs it
    if graph is None:
        timed = program.timed(costs, pairs_as_one=True)
        return _makespan_and_bubble(timed, _replayed(program.schedule, timed, costs))
    durations = action_durations(program.schedule.chunks_per_copy, costs)
    return _bubble(max(graph.finish_times(durations, costs.comm), default=0.0), _busiest(graph, durations))


@gc_paused
def simulate_shared_makespan(program: Union[Program, SendsOnly], costs: Costs, waits: Costs, cores: int,
                             processes_per_rank: int = 1) -> tuple[float, float]:
    """(makespan, bubble ratio) of ``simulate_makespan`` where the ranks' processes share ``cores``
    (``ppctl.pipeline.shared_cores``): each step's cost less its ``waits`` (F, B, W: the part on no core) is
    compute that the computing processes share; the bubble against the busiest rank's whole costs. Never below
    ``simulate_makespan`` at the same costs: sharing only slows steps. ScheduleError without a step graph."""
    graph = program.graph if not costs.times_pairs else None
    if graph is None:
        raise ScheduleError(f"{program.schedule.name}: no step graph (a deadlock, or overlapped pairs timed as one) "
                            "to share cores on")
    chunks = program.schedule.chunks_per_copy
    whole, waited = action_durations(chunks, costs), action_durations(chunks, waits)
    computed = {kind: whole[kind] - waited[kind] for kind in whole}
    finish = shared_finish_times(graph, computed, waited, costs.comm, cores, processes_per_rank)
    return _bubble(max(finish, default=0.0), _busiest(graph, whole))


def _busiest(graph, durations: dict[str, float]) -> float:
    """The busiest rank's compute: its steps' durations summed in program order, as the timed steps sum."""
    return max(sum(map(durations.__getitem__, kinds)) for kinds in graph.rank_kinds)


def makespan_floor(placement, microbatches: int, costs: Costs) -> float:
    """A makespan that no schedule of ``microbatches`` on ``placement`` goes below in the simulator (without
    ``FB``), built from no schedule: the planner rules layouts out with it before building theirs.

    Every rank holds ``chunks_per_copy`` stages of each copy and runs each microbatch of the copy through each
    once (an F, and a B with its W or a whole BW), so every rank computes ``microbatches * chunks_per_copy``
    chunk passes. Before its first action, a microbatch has gone through the stages in front of its earliest
    (each a chunk's F; ``comm`` at each change of rank). With one copy, its last B on its earliest stage
    comes after all its F's and B's, and that microbatch's gradient then goes back through those stages.
    """
    pp = max(placement.owners, default=-1) + 1
    chunks = placement.num_stages // placement.copies // max(pp, 1)
    durations = action_durations(chunks, costs)
    forward, backward_input = durations[FORWARD], durations[BACKWARD_INPUT]
    passes = microbatches * chunks
    work = passes * (forward + durations[BACKWARD])
    floor = work
    for pp_rank in range(pp):
        stages, hops = _front_of(placement, pp_rank)
        fill = stages * forward + hops * costs.comm
        floor = max(floor, fill + work)
        if placement.copies == 1:
            floor = max(floor, fill + passes * (forward + backward_input) + stages * backward_input + hops * costs.comm)
    return floor


def _front_of(placement, pp_rank: int) -> tuple[int, int]:
    """(the stages of its copy in front of ``pp_rank``'s earliest stage, the changes of rank between them and
    it): the fewest a microbatch passes, and crosses, before it reaches the rank."""
    per_copy = placement.stages_per_copy
    earliest = min(placement.stages_of(pp_rank), key=lambda stage: stage % per_copy)
    return earliest % per_copy, rank_changes_in_front(placement, earliest)


def _replayed(schedule: Schedule, timed: TimedProgram, costs: Costs) -> Replay:
    """The buffered replay of ``timed`` at ``costs.comm``; ScheduleError naming ``schedule`` on deadlock."""
    outcome = run_timed(timed, costs.comm)
    if outcome.deadlocked:
        raise ScheduleError(f"{schedule.name}: {outcome.deadlock_message()}")
    return outcome


def _makespan_and_bubble(timed: TimedProgram, outcome: Replay) -> tuple[float, float]:
    """The last end over all ranks, and (it - the busiest rank's compute) / that compute."""
    makespan = max((ends[-1] for ends in outcome.ends if ends), default=0.0)
    busiest = max(sum(map(itemgetter(1), rank_steps)) for rank_steps in timed.steps)  # (inputs, duration, ...)
    return _bubble(makespan, busiest)


def _bubble(makespan: float, busiest: float) -> tuple[float, float]:
    """``makespan`` and (it - the busiest rank's compute) / that compute."""
    return makespan, (makespan - busiest) / busiest if busiest > 0 else 0.0


def _timed_actions(schedule: Schedule, pp_rank: int, outcome: Replay) -> list[TimedAction]:
    """``pp_rank``'s actions with their replayed times, each half of an overlapped pair (a weight fill) with its
    number."""
    timed = [TimedAction(action.kind, action.stage, action.microbatch, start, end)
             for action, start, end in zip(schedule.actions[pp_rank], outcome.starts[pp_rank], outcome.ends[pp_rank])]
    for number, index in enumerate(schedule.pair_starts(pp_rank)):
        timed[index].pair = timed[index + 1].pair = number
    for number, index in enumerate(schedule.fill_starts(pp_rank)):
        timed[index].fill = timed[index + 1].fill = number
    return timed


def peak_activations(rank_actions: Sequence[Action], chunks_per_copy: int) -> float:
    """Most chunk activations one rank holds at once (forward done, BW or W not yet), in whole-rank units.

    One microbatch through one chunk counts ``1 / chunks_per_copy``, so the result is
    comparable across schedules: 1.0 is one microbatch through all of the rank's layers
    (of one model copy: a DualPipe chunk counts 1, as each microbatch meets one of a
    rank's two chunks). An overlapped pair counts its forward before its backward frees
    anything: both halves' activations are alive while the pair runs.
    A split backward's activations count until its W: B frees the input-gradient part
    only, while W still needs each layer's input and output gradient (the paper's M_W);
    counting them whole until W is the conservative bound the zero-bubble paper uses
    for its peak (p M_B for ZB-H1, as 1F1B).
    """
    in_flight = peak = 0
    for action in rank_actions:
        if action.kind == FORWARD:
            in_flight += 1
            peak = max(peak, in_flight)
        elif action.kind in (BACKWARD, BACKWARD_WEIGHT):
            in_flight -= 1
    return peak / chunks_per_copy


@gc_paused
def replay(program: Program, costs: Costs = Costs(), rendezvous: bool = False, pairs_as_one: bool = False) -> Replay:
    """Run every rank's steps of ``program`` against ``costs`` (see ``ppctl.pipeline.replay`` for the transports).

    ``pairs_as_one`` runs each overlapped pair as one action, as the simulator does;
    without it, its two steps as the runtime posts them (what the checker replays).
    """
    return run_timed(program.timed(costs, pairs_as_one), costs.comm, rendezvous)
