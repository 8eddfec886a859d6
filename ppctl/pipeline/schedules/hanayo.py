"""Hanayo's wave-like pipeline (Liu et al., SC'23): one copy of the weights, the stages folded over the ranks in waves.

With ``W`` waves the model is cut into ``S = 2*W*pp`` stages. Stage s runs on rank
``s mod 2pp`` when that is below pp, else on rank ``2pp - 1 - (s mod 2pp)``: the stages
go down the ranks and back up, W times, so each rank holds 2W chunks and both the first
and the last stage sit on rank 0 (``W = 1`` is ZB-V's V). More, smaller stages shrink
the fill and the drain as interleaving does, with no second copy of the weights (unlike
Chimera or DualPipe).

The order is that of a unit-cost list schedule (a chunk's forward takes one unit, its
whole backward two, F = B = W; messages are free). Each rank, whenever it is free:

1. runs a ready forward, the deepest stage first (a microbatch on its way goes on), under
   an activation cap: a new microbatch enters the rank's first chunk only if all 2W chunk
   activations it will need there fit (so every started microbatch can finish its
   forward, and the backwards that free memory keep coming);
2. else a ready backward, the highest stage first (the longest chain of backwards still
   behind it: the critical path), the oldest microbatch on ties;
3. else it idles.

The cap is ``ceil(pp * (2 - 1/(2W)))`` microbatches through all of the rank's layers:
interleaved 1F1B's peak with as many chunks per rank. With 1F1B's pp instead, the
forward-first order starves and the bubble is several times larger (docs/schedules.md).
"""

from __future__ import annotations

import math
from typing import Optional

from ppctl.parallel.placement import Placement, wave_placement

from .base import BACKWARD, FORWARD, Action, Schedule, ScheduleError, ScheduleSpec, at_least_one_microbatch

_DURATION = {FORWARD: 1, BACKWARD: 2}  # F = B = W: a whole backward takes two forwards


def hanayo(pp: int, vpp: int, num_microbatches: int) -> Schedule:
    """Build Hanayo with ``vpp // 2`` waves (``vpp`` even: two chunks per rank per wave)."""
    error = waves_error(pp, vpp, num_microbatches)
    if error is not None:
        raise ScheduleError(f"schedule hanayo: {error}")
    placement = wave_placement(pp, vpp // 2)
    orders = _WaveListSchedule(placement, pp, num_microbatches).run()
    return Schedule("hanayo", pp, vpp, num_microbatches, placement, tuple(tuple(order) for order in orders))


def activation_cap(pp: int, waves: int) -> int:
    """Microbatches (through all of a rank's layers) a rank may hold: interleaved 1F1B's peak at 2W chunks."""
    return math.ceil(pp * (2 - 1 / (2 * waves)))


class _WaveListSchedule:
    """The list schedule of the module docstring; ``run`` returns each rank's action order."""

    def __init__(self, placement: Placement, pp: int, num_microbatches: int):
        self.placement, self.pp, self.num_microbatches = placement, pp, num_microbatches
        self.num_stages = placement.num_stages
        self.chunks = self.num_stages // pp
        self.cap = activation_cap(pp, self.chunks // 2) * self.chunks  # in chunk activations
        self.forward_end: list[list[Optional[int]]] = [[None] * num_microbatches for _ in range(self.num_stages)]
        self.backward_end: list[list[Optional[int]]] = [[None] * num_microbatches for _ in range(self.num_stages)]
        self.next_forward = [0] * self.num_stages
        self.next_backward = [0] * self.num_stages
        self.held = [0] * pp  # chunk activations from F until BW
        self.owed = [0] * pp  # chunk forwards reserved when their microbatch entered, not run yet
        self.free_at = [0] * pp
        self.orders: list[list[Action]] = [[] for _ in range(pp)]
        # a microbatch visits the stages in index order, one model copy (as zbv's list schedule;
        # the checker proves the order against the program's messages)
        order = range(self.num_stages)
        self.previous_stage = dict(zip(order[1:], order))
        self.next_stage = dict(zip(order, order[1:]))

    def run(self) -> list[list[Action]]:
        """Advance time one unit at a time; every free rank picks its next action from the state at that time."""
        remaining, time = 2 * self.num_stages * self.num_microbatches, 0
        while remaining:
            chosen = [(rank, self._pick(rank, time)) for rank in range(self.pp) if self.free_at[rank] <= time]
            chosen = [(rank, action) for rank, action in chosen if action is not None]
            if not chosen and all(free_at <= time for free_at in self.free_at):
                raise ScheduleError(f"hanayo: the list schedule stalled at time {time} (pp={self.pp}, "
                                    f"stages={self.num_stages}, num_microbatches={self.num_microbatches})")
            for rank, action in chosen:
                self._apply(rank, action, time)
            remaining -= len(chosen)
            time += 1
        return self.orders

    def _done_by(self, ends: list[list[Optional[int]]], stage: int, mb: int, time: int) -> bool:
        return ends[stage][mb] is not None and ends[stage][mb] <= time

    def _forward_ready(self, pp_rank: int, stage: int, time: int) -> bool:
        """Its input is in and, for a microbatch entering this rank, all its chunks here fit under the cap."""
        mb, previous = self.next_forward[stage], self.previous_stage.get(stage)
        if mb >= self.num_microbatches or (previous is not None
                                           and not self._done_by(self.forward_end, previous, mb, time)):
            return False
        entering = stage == self.placement.stages_of(pp_rank)[0]
        return not entering or self.held[pp_rank] + self.owed[pp_rank] + self.chunks <= self.cap

    def _backward_ready(self, stage: int, time: int) -> bool:
        """Its forward is done and the gradient from the next stage is in."""
        mb = self.next_backward[stage]
        if mb >= self.num_microbatches or not self._done_by(self.forward_end, stage, mb, time):
            return False
        following = self.next_stage.get(stage)
        return following is None or self._done_by(self.backward_end, following, mb, time)

    def _pick(self, pp_rank: int, time: int) -> Optional[Action]:
        """The deepest ready forward, else the highest ready backward (oldest on ties), else nothing."""
        stages = self.placement.stages_of(pp_rank)
        forwards = [stage for stage in stages if self._forward_ready(pp_rank, stage, time)]
        if forwards:
            return Action(FORWARD, max(forwards), self.next_forward[max(forwards)])
        backwards = [stage for stage in stages if self._backward_ready(stage, time)]
        if backwards:
            stage = min(backwards, key=lambda s: (-s, self.next_backward[s]))
            return Action(BACKWARD, stage, self.next_backward[stage])
        return None

    def _apply(self, pp_rank: int, action: Action, time: int) -> None:
        """Record ``action`` starting at ``time`` on ``pp_rank``: its order, end time, activations."""
        end = time + _DURATION[action.kind]
        self.free_at[pp_rank] = end
        self.orders[pp_rank].append(action)
        if action.kind == FORWARD:
            self.forward_end[action.stage][action.microbatch] = end
            self.next_forward[action.stage] += 1
            self.held[pp_rank] += 1
            entering = action.stage == self.placement.stages_of(pp_rank)[0]
            self.owed[pp_rank] += self.chunks - 1 if entering else -1
        else:
            self.backward_end[action.stage][action.microbatch] = end
            self.next_backward[action.stage] += 1
            self.held[pp_rank] -= 1


def waves_error(pp: int, vpp: int, num_microbatches: int) -> Optional[str]:
    """Hanayo's rule: two chunks per rank per wave, and at least one microbatch."""
    if vpp < 2 or vpp % 2:
        return f"vpp={vpp} must be 2 * parallel.waves (two chunks per rank per wave)"
    return at_least_one_microbatch(pp, vpp, num_microbatches)


def _wave_placement_of_spec(pp: int, chunks_per_rank: int) -> Placement:
    """The wave placement in the registry's ``(pp, chunks_per_rank)`` form: ``chunks_per_rank / 2`` waves."""
    return wave_placement(pp, max(1, chunks_per_rank // 2))


HANAYO_SPEC = ScheduleSpec(
    name="hanayo",
    multi_chunk=True,
    splits_backward=False,
    description="Hanayo's waves: 2*waves*pp stages folded down and up the ranks, one weight copy, bubble cut by waves",
    microbatch_error=waves_error,
    generate=hanayo,
    placement=_wave_placement_of_spec,
    placement_name="waves: stage s on rank s mod 2pp, or 2pp-1-(s mod 2pp) past pp",
)
