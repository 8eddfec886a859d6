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
from .list_schedule import UnitListSchedule


def hanayo(pp: int, vpp: int, num_microbatches: int) -> Schedule:
    """Build Hanayo with ``vpp // 2`` waves (``vpp`` even: two chunks per rank per wave)."""
    error = waves_error(pp, vpp, num_microbatches)
    if error is not None:
        raise ScheduleError(f"schedule hanayo: {error}")
    placement = wave_placement(pp, vpp // 2)
    orders = _WaveListSchedule(placement, pp, num_microbatches).run(2 * placement.num_stages * num_microbatches)
    return Schedule("hanayo", pp, vpp, num_microbatches, placement, tuple(tuple(order) for order in orders))


def activation_cap(pp: int, waves: int) -> int:
    """Microbatches (through all of a rank's layers) a rank may hold: interleaved 1F1B's peak at 2W chunks."""
    return math.ceil(pp * (2 - 1 / (2 * waves)))


class _WaveListSchedule(UnitListSchedule):
    """The Hanayo policy of the module docstring on the unit-cost list schedule."""

    name = "hanayo"
    durations = {FORWARD: 1, BACKWARD: 2}  # F = B = W: a whole backward takes two forwards

    def __init__(self, placement: Placement, pp: int, num_microbatches: int):
        super().__init__(placement, pp, num_microbatches)
        self.chunks = self.num_stages // pp
        self.cap = activation_cap(pp, self.chunks // 2) * self.chunks  # in chunk activations
        self.held = [0] * pp  # chunk activations from F until BW
        self.owed = [0] * pp  # chunk forwards reserved when their microbatch entered, not run yet

    def _entering(self, pp_rank: int, stage: int) -> bool:
        """Whether a forward of ``stage`` brings a new microbatch to ``pp_rank`` (its first chunk)."""
        return stage == self.placement.stages_of(pp_rank)[0]

    def _fits(self, pp_rank: int, stage: int) -> bool:
        """A microbatch already on this rank goes on; a new one enters only if all its chunks here fit."""
        return not self._entering(pp_rank, stage) or self.held[pp_rank] + self.owed[pp_rank] + self.chunks <= self.cap

    def pick(self, pp_rank: int, time: int) -> Optional[Action]:
        """The deepest ready forward that fits, else the highest ready backward (oldest on ties), else nothing."""
        stages = self.placement.stages_of(pp_rank)
        forwards = [stage for stage in stages if self.forward_ready(stage, time) and self._fits(pp_rank, stage)]
        if forwards:
            return Action(FORWARD, max(forwards), self.next_forward[max(forwards)])
        backwards = [stage for stage in stages if self.backward_ready(stage, time)]
        if backwards:
            stage = min(backwards, key=lambda s: (-s, self.next_backward[s]))
            return Action(BACKWARD, stage, self.next_backward[stage])
        return None

    def after(self, pp_rank: int, action: Action) -> None:
        """Activations held and reserved once ``action`` is placed."""
        if action.kind == FORWARD:
            self.held[pp_rank] += 1
            self.owed[pp_rank] += self.chunks - 1 if self._entering(pp_rank, action.stage) else -1
        else:
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
    chunks_per_wave=2,
)
