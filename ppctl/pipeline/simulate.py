"""Simulate a schedule against a cost model: timelines, makespan, bubble, memory; replay a plan.

The replay engine and its two transports (buffered, NCCL-like rendezvous) live in
``ppctl.pipeline.replay``. This module times a bare schedule with it (``simulate``)
and compiles a communication plan into a replay program, each step as the runtime
runs it (``replay`` with a plan: what the checker needs).

Cost model: ``Costs.F`` (``B``, ``W``) is the time of one microbatch through ALL the
layers of a rank; a chunk's action takes that divided by ``chunks_per_rank``; an
unsplit backward ``BW`` takes ``B + W``. Peak activations are counted in the same
unit: a chunk-level activation in flight counts ``1 / chunks_per_rank``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import repeat
from operator import add, attrgetter
from typing import Optional, Sequence

from .comm import Column, CommPlan, NumberedPlan, number_plan
from .replay import Costs, Program, Replay, Step, action_durations, compile_schedule, gc_paused, run
from .schedules.base import BACKWARD, BACKWARD_WEIGHT, FORWARD, Action, Schedule, ScheduleError

__all__ = ["Costs", "RankTimeline", "Replay", "SimResult", "TimedAction", "parse_costs", "peak_activations",
           "replay", "simulate"]


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

@gc_paused
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
    durations = action_durations(schedule.chunks_per_rank, costs)
    busiest = max(sum(durations[action.kind] for action in rank_actions) for rank_actions in schedule.actions)
    bubble_ratio = (makespan - busiest) / busiest if busiest > 0 else 0.0
    return SimResult(schedule.name, schedule.pp, schedule.chunks_per_rank, schedule.num_microbatches,
                     costs, ranks, makespan, bubble_ratio)


def peak_activations(rank_actions: Sequence[Action], chunks_per_rank: int) -> float:
    """Most chunk activations one rank holds at once (forward done, BW or W not yet), in whole-rank units.

    One microbatch through one chunk counts ``1 / chunks_per_rank``, so the result is
    comparable across schedules: 1.0 is one microbatch through all of the rank's layers.
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
    return peak / chunks_per_rank


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
    durations = action_durations(schedule.chunks_per_rank, costs)
    initial = [plan.initial_receives(pp_rank) for pp_rank in range(plan.num_ranks)]
    steps = [_compiled_steps(plan, pp_rank, initial[pp_rank], durations) for pp_rank in range(plan.num_ranks)]
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
