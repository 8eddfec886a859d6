"""Simulate a schedule against a cost model: timelines, makespan, bubble, memory; replay a plan.

The replay engine and its two transports (buffered, NCCL-like rendezvous) live in
``ppctl.pipeline.replay``. This module times a bare schedule with it (``simulate``)
and compiles a communication plan into a replay program, each step as the runtime
runs it (``replay`` with a plan: what the checker needs).

Cost model (``ppctl.pipeline.replay``): ``Costs.F`` (``B``, ``W``, ``FB``) is the time of
one microbatch through the layers it meets on a rank (all of the rank's layers, or its
layers of one model copy when it holds several); a chunk's action takes that divided by
``Schedule.chunks_per_copy``; an unsplit backward ``BW`` takes ``B + W``; the two halves of
an overlapped pair share ``FB``. Peak activations are counted in the same unit: a
chunk-level activation in flight counts ``1 / chunks_per_copy``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import repeat
from operator import add, attrgetter, itemgetter
from typing import Optional, Sequence

from .comm import Column, CommPlan, NumberedPlan, number_plan
from .replay import Costs, Program, Replay, Step, action_durations, compile_schedule, gc_paused, run, time_pairs
from .schedules.base import BACKWARD, BACKWARD_WEIGHT, FORWARD, Action, Schedule, ScheduleError

__all__ = ["Costs", "RankTimeline", "Replay", "SimResult", "TimedAction", "parse_costs", "peak_activations",
           "replay", "simulate"]


def parse_costs(text: str) -> Costs:
    """Parse ``"F=1,B=2,W=1,FB=2.5,comm=0.1"`` (any subset, any order) into ``Costs``; ValueError if malformed."""
    values: dict[str, float] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or key not in Costs.__dataclass_fields__:
            raise ValueError(f"cost {item!r} in {text!r} must be KEY=NUMBER with KEY one of F, B, W, FB, comm")
        try:
            values[key] = float(value)
        except ValueError:
            raise ValueError(f"cost {key}={value.strip()!r} in {text!r} is not a number") from None
        if values[key] < 0:
            raise ValueError(f"cost {key}={values[key]} in {text!r} must not be negative")
    return Costs(**values)


@dataclass
class TimedAction:
    """One action with its start and end time (simulated, or measured by a real run).

    ``pair`` numbers the rank's overlapped forward-backward pairs: both halves of one
    pair carry its number; None for an action outside a pair.
    """

    kind: str
    stage: int
    microbatch: int
    start: float
    end: float
    pair: Optional[int] = None


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
    rank holds ``copies / pp`` of the model's parameters.
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

    def idle_times(self) -> list[float]:
        """Per rank, the makespan less the rank's compute time: its bubble (what DualPipe's table calls one)."""
        return [self.makespan - sum(action.end - action.start for action in timeline.actions)
                for timeline in self.ranks]

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
    """One rank of ``SimResult.to_json``; an action in an overlapped pair also has its ``pair`` number."""
    actions = []
    for a in timeline.actions:
        action = {"kind": a.kind, "stage": a.stage, "microbatch": a.microbatch, "start": a.start, "end": a.end}
        if a.pair is not None:
            action["pair"] = a.pair
        actions.append(action)
    return {"rank": timeline.rank, "peak_activations": timeline.peak_activations, "actions": actions}


# --- the simulator ------------------------------------------------------------------------

@gc_paused
def simulate(schedule: Schedule, costs: Costs = Costs()) -> SimResult:
    """Replay ``schedule`` against ``costs``; raises ``ScheduleError`` if it deadlocks.

    The bubble ratio is (makespan - the busiest rank's compute) / that compute.
    """
    program = compile_schedule(schedule, costs)
    outcome = run(program, costs.comm)
    if outcome.deadlocked:
        raise ScheduleError(f"{schedule.name}: {outcome.deadlock_message()}")
    ranks = [RankTimeline(pp_rank, _timed_actions(schedule, pp_rank, outcome),
                          peak_activations(rank_actions, schedule.chunks_per_copy))
             for pp_rank, rank_actions in enumerate(schedule.actions)]
    makespan = max((ends[-1] for ends in outcome.ends if ends), default=0.0)
    busiest = max(sum(map(itemgetter(1), rank_steps)) for rank_steps in program.steps)  # (inputs, duration, ...)
    bubble_ratio = (makespan - busiest) / busiest if busiest > 0 else 0.0
    return SimResult(schedule.name, schedule.pp, schedule.chunks_per_rank, schedule.num_microbatches,
                     costs, ranks, makespan, bubble_ratio, schedule.placement.copies)


def _timed_actions(schedule: Schedule, pp_rank: int, outcome: Replay) -> list[TimedAction]:
    """``pp_rank``'s actions with their replayed times, each half of an overlapped pair with the pair's number."""
    timed = [TimedAction(action.kind, action.stage, action.microbatch, start, end)
             for action, start, end in zip(schedule.actions[pp_rank], outcome.starts[pp_rank], outcome.ends[pp_rank])]
    for number, index in enumerate(schedule.pair_starts(pp_rank)):
        timed[index].pair = timed[index + 1].pair = number
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


# --- replaying a plan -----------------------------------------------------------------------

@gc_paused
def replay(schedule: Schedule, plan: Optional[CommPlan] = None, costs: Costs = Costs(),
           rendezvous: bool = False) -> Replay:
    """Run every rank's actions against ``costs`` (see ``ppctl.pipeline.replay`` for the two transports).

    With ``plan`` the replay follows the communication plan step by step, receives
    posted as the runtime posts them (what the checker needs); without it, the
    schedule's actions with their inputs and outputs from stage adjacency, buffered
    (what the simulator and the planner need, and faster).
    """
    if plan is None:
        if rendezvous:
            raise ValueError("a rendezvous replay needs the communication plan")
        program = compile_schedule(schedule, costs)
    else:
        program = compile_plan(schedule, number_plan(plan, schedule), costs)
    return run(program, costs.comm, rendezvous)


def compile_plan(schedule: Schedule, plan: NumberedPlan, costs: Costs = Costs()) -> Program:
    """Each step as the runtime runs it: post missing waits, wait, compute, send and prefetch."""
    if plan.local_outputs is None:
        raise ValueError("a replay needs the plan numbered with its schedule (its local hand-overs)")
    durations = action_durations(schedule.chunks_per_copy, costs)
    initial = [plan.initial_receives(pp_rank) for pp_rank in range(plan.num_ranks)]
    steps = [_compiled_steps(plan, pp_rank, initial[pp_rank], durations) for pp_rank in range(plan.num_ranks)]
    time_pairs(schedule, steps, costs, as_one=False)  # the runtime's steps, only their times
    return Program(plan.actions, steps, initial, plan.messages)


def _compiled_steps(plan: NumberedPlan, pp_rank: int, initial: tuple[int, ...],
                    durations: dict[str, float]) -> list[Step]:
    """One rank's plan steps compiled, given the receives it posts before them."""
    waits, prefetch = plan.waits[pp_rank], plan.prefetch[pp_rank]
    if not _posts_once_ahead(initial, waits, prefetch):
        return _compiled_steps_posting(plan, pp_rank, set(initial), durations)
    # Nothing to post before a wait, no receive posted twice: each step as the plan lists it.
    inputs = map(add, waits, plan.local_inputs[pp_rank])
    step_durations = map(durations.__getitem__, map(attrgetter("kind"), plan.actions[pp_rank]))
    return list(zip(inputs, step_durations, plan.local_outputs[pp_rank], plan.sends[pp_rank],
                    repeat(()), prefetch))


def _posts_once_ahead(initial: tuple[int, ...], waits: Column, prefetch: Column) -> bool:
    """Whether a rank posts each receive once, and each wait's receive before the step that waits.

    Receives posted initially count as posted at step -1; a prefetch of step i at step i.
    """
    posted_at = dict.fromkeys(initial, -1)
    prefetched = [(number, index) for index, numbers in enumerate(prefetch) for number in numbers]
    posted_at.update(prefetched)
    if len(posted_at) != len(initial) + len(prefetched):
        return False
    never = len(waits)
    return all(posted_at.get(number, never) < index for index, numbers in enumerate(waits) for number in numbers)


def _compiled_steps_posting(plan: NumberedPlan, pp_rank: int, posted: set[int],
                            durations: dict[str, float]) -> list[Step]:
    """One rank's plan steps compiled; ``posted`` holds the receives the rank posted before them."""
    compiled = []
    for action, waits, local_inputs, sends, prefetch, local_output in zip(
            plan.actions[pp_rank], plan.waits[pp_rank], plan.local_inputs[pp_rank], plan.sends[pp_rank],
            plan.prefetch[pp_rank], plan.local_outputs[pp_rank]):
        post_first = ()
        if waits:
            post_first = tuple([number for number in waits if number not in posted])
            posted.update(post_first)
        if prefetch:
            prefetch = tuple([number for number in prefetch if number not in posted])
            posted.update(prefetch)
        compiled.append((waits + local_inputs, durations[action.kind], local_output, sends, post_first, prefetch))
    return compiled
