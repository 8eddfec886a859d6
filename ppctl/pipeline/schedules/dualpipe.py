"""DualPipe and DualPipeV (DeepSeek-V3): two streams of microbatches crossing, forwards overlapped with backwards.

Both schedules give each rank two chunks, its *phases*: phase 0 is the chunk whose
microbatches reach the rank first, phase 1 the other. Every rank runs the same eight
phases of work, their lengths set by how far the rank sits from the turning point
(``n`` ranks on the way, this rank ``r`` of them, ``far = n - r - 1``, ``M`` microbatches
per phase):

1. ``2 far`` forwards of phase 0 (filling the pipeline from this end);
2. ``r + 1`` times: a forward of phase 0, then one of phase 1;
3. ``far`` times: a zero-bubble backward of phase 1 (B, its W queued), that W at once,
   a forward of phase 1;
4. the steady part, ``M - 2n + r + 1`` times: a forward of phase 0 overlapped with a
   whole backward of phase 1, then a forward of phase 1 overlapped with a whole
   backward of phase 0 (the rank at the turning point runs its very first pair as
   two plain actions: DualPipe does not overlap those, to shorten the bubble);
5. ``far`` times: a whole backward of phase 1, then a forward of phase 1 overlapped
   with a whole backward of phase 0;
6. ``r + 1`` times: a backward of phase 1, then one of phase 0; the second half of
   these ``2(r + 1)`` backwards are zero-bubble (B now, W queued);
7. ``far`` times: a queued W, then a zero-bubble backward of phase 0;
8. ``r + 1`` queued Ws.

Queued Ws run oldest first, as DualPipe's weight-gradient store pops them.

``dualpipev``: one model copy on the V placement (rank r holds stages r and 2pp-1-r,
a microbatch goes down the V and back up). ``n = pp``, phase 0 is stage r, phase 1
stage 2pp-1-r, and both phases see all ``m`` microbatches.

``dualpipe``: two model copies on the same V placement read as two pipelines, copy 0
(stages 0..pp-1, model stage s on rank s, fed at rank 0) and copy 1 (stages
pp..2pp-1, model stage j on rank pp-1-j, fed at rank pp-1). Microbatches 0..m/2-1
flow through copy 0, m/2..m-1 through copy 1. Each half of the ranks runs the
phases above as a DualPipeV of ``n = pp/2`` ranks: rank r is rank ``min(r, pp-1-r)``
of it, its phase 0 the copy fed from its own end, and each phase sees ``m/2``
microbatches.
"""

from __future__ import annotations

from collections import deque
from typing import Optional

from ppctl.parallel.placement import Placement, v_placement

from .base import (BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, V_PLACEMENT_NAME, Action, Schedule,
                   ScheduleError, ScheduleSpec, two_chunks_only, v_placement_of_spec)

# One computation of a rank's phase before its microbatch is numbered: (kind, phase); a W has no phase
# (it runs the oldest queued weight gradient). A cell of the order is one op, or two overlapped ones.
_Op = tuple[str, Optional[int]]
_Cell = tuple[_Op, ...]


def _f(phase: int) -> _Op:
    return (FORWARD, phase)


def _whole(phase: int) -> _Op:
    return (BACKWARD, phase)


def _zero_bubble(phase: int) -> _Op:
    return (BACKWARD_INPUT, phase)


_W: _Op = (BACKWARD_WEIGHT, None)


# --- the eight phases, shared by both schedules ---------------------------------------------------

def phase_cells(num_ranks: int, rank: int, num_microbatches: int) -> list[_Cell]:
    """One rank's order as cells of ops, for rank ``rank`` of ``num_ranks`` and ``num_microbatches`` per phase.

    ``num_ranks`` and ``num_microbatches`` are those of the V (DualPipeV's pp and m;
    half of DualPipe's); ``num_microbatches >= 2 * num_ranks`` (the steady part needs
    one round on every rank).
    """
    far = num_ranks - rank - 1
    cells: list[_Cell] = [(_f(0),)] * (2 * far)
    cells += [(_f(0),), (_f(1),)] * (rank + 1)
    cells += [(_zero_bubble(1),), (_W,), (_f(1),)] * far
    cells += _steady_cells(num_microbatches - 2 * num_ranks + rank + 1, at_turn=far == 0)
    cells += [(_whole(1),), (_f(1), _whole(0))] * far
    cells += _draining_backwards(rank)
    cells += [(_W,), (_zero_bubble(0),)] * far
    cells += [(_W,)] * (rank + 1)
    return cells


def _steady_cells(rounds: int, at_turn: bool) -> list[_Cell]:
    """Phase 4: each round a phase-0 forward with a phase-1 backward, then the reverse, overlapped.

    The rank at the turning point runs its first forward and backward as two plain
    actions, as DualPipe does (every other rank waits on the turning point, and the
    output it passes on then leaves before its backward rather than after a pair).
    """
    cells: list[_Cell] = []
    for round_index in range(rounds):
        if round_index == 0 and at_turn:
            cells += [(_f(0),), (_whole(1),)]
        else:
            cells.append((_f(0), _whole(1)))
        cells.append((_f(1), _whole(0)))
    return cells


def _draining_backwards(rank: int) -> list[_Cell]:
    """Phase 6: ``rank + 1`` rounds of a phase-1 then a phase-0 backward; the later half of them zero-bubble."""
    phases = [1, 0] * (rank + 1)
    whole = len(phases) // 2
    return [((BACKWARD if index < whole else BACKWARD_INPUT, phase),) for index, phase in enumerate(phases)]


# --- numbering the ops: stages, microbatches, Ws ----------------------------------------------------

def number_cells(cells: list[_Cell], stages: tuple[int, int], first_microbatches: tuple[int, int]
                 ) -> tuple[tuple[Action, ...], tuple[int, ...]]:
    """The rank's actions and the indices starting its overlapped pairs.

    Phase p runs on ``stages[p]``; its forwards and its backwards each take the
    microbatches from ``first_microbatches[p]`` on, in order. A W runs the weight
    gradient of the oldest zero-bubble B not yet followed by its W.
    """
    next_forward, next_backward = list(first_microbatches), list(first_microbatches)
    queued: deque[Action] = deque()
    actions: list[Action] = []
    pair_starts: list[int] = []
    for cell in cells:
        if len(cell) == 2:
            pair_starts.append(len(actions))
        for kind, phase in cell:
            if kind == BACKWARD_WEIGHT:
                input_gradient = queued.popleft()
                actions.append(Action(BACKWARD_WEIGHT, input_gradient.stage, input_gradient.microbatch))
                continue
            counter = next_forward if kind == FORWARD else next_backward
            action = Action(kind, stages[phase], counter[phase])
            counter[phase] += 1
            actions.append(action)
            if kind == BACKWARD_INPUT:
                queued.append(action)
    return tuple(actions), tuple(pair_starts)


# --- the two schedules ----------------------------------------------------------------------------

def dualpipev(pp: int, vpp: int, num_microbatches: int) -> Schedule:
    """Build DualPipeV: the eight phases on the V placement (stages r and 2pp-1-r on rank r), one copy."""
    _refuse("dualpipev", vpp, dualpipev_microbatch_error(pp, vpp, num_microbatches))
    ranks = [number_cells(phase_cells(pp, pp_rank, num_microbatches), (pp_rank, 2 * pp - 1 - pp_rank), (0, 0))
             for pp_rank in range(pp)]
    return Schedule("dualpipev", pp, 2, num_microbatches, v_placement(pp), tuple(a for a, _ in ranks),
                    overlapped=tuple(pairs for _, pairs in ranks))


def dualpipe_placement(pp: int, chunks_per_rank: int) -> Placement:
    """DualPipe's placement in the registry's ``(pp, chunks_per_rank)`` form: the V read as two model copies.

    Rank r holds model stage r of copy 0 and model stage ``pp - 1 - r`` of copy 1 (always 2 chunks).
    """
    return v_placement(pp, copies=2)


def dualpipe(pp: int, vpp: int, num_microbatches: int) -> Schedule:
    """Build DualPipe: two copies fed from both ends, each half of the ranks running a DualPipeV of pp/2."""
    _refuse("dualpipe", vpp, dualpipe_microbatch_error(pp, vpp, num_microbatches))
    half_ranks, half_microbatches = pp // 2, num_microbatches // 2
    ranks = []
    for pp_rank in range(pp):
        copy_0_stage, copy_1_stage = pp_rank, 2 * pp - 1 - pp_rank  # model stages r and pp-1-r
        in_second_half = pp_rank >= half_ranks  # its own end feeds copy 1
        stages = (copy_1_stage, copy_0_stage) if in_second_half else (copy_0_stage, copy_1_stage)
        first_microbatches = (half_microbatches, 0) if in_second_half else (0, half_microbatches)
        cells = phase_cells(half_ranks, min(pp_rank, pp - 1 - pp_rank), half_microbatches)
        ranks.append(number_cells(cells, stages, first_microbatches))
    return Schedule("dualpipe", pp, 2, num_microbatches, dualpipe_placement(pp, 2), tuple(a for a, _ in ranks),
                    overlapped=tuple(pairs for _, pairs in ranks))


def _refuse(name: str, vpp: int, error: Optional[str]) -> None:
    """Raise ``ScheduleError`` (one line) for a vpp other than 2 or a refused microbatch count."""
    two_chunks_only(name, vpp)
    if error is not None:
        raise ScheduleError(f"schedule {name}: {error}")


def dualpipev_microbatch_error(pp: int, vpp: int, num_microbatches: int) -> Optional[str]:
    """DualPipeV's rule: at least 2*pp microbatches (every rank's steady part runs at least once)."""
    if num_microbatches < 2 * pp:
        return (f"num_microbatches={num_microbatches} must be at least 2*pp = {2 * pp} "
                f"(every rank needs one steady round)")
    return None


def dualpipe_microbatch_error(pp: int, vpp: int, num_microbatches: int) -> Optional[str]:
    """DualPipe's rule: an even pp, and an even count of at least 2*pp microbatches (half from each end)."""
    if pp % 2:
        return f"pp={pp} must be even (rank r and rank pp-1-r hold the two ends of the two copies)"
    if num_microbatches < 2 * pp or num_microbatches % 2:
        return (f"num_microbatches={num_microbatches} must be even and at least 2*pp = {2 * pp} "
                f"(half of them enter at each end)")
    return None


DUALPIPEV_SPEC = ScheduleSpec(
    name="dualpipev",
    multi_chunk=True,
    splits_backward=True,
    description="DualPipeV: DualPipe cut in half onto a V, forwards overlapped with backwards, some B/W split",
    microbatch_error=dualpipev_microbatch_error,
    generate=dualpipev,
    placement=v_placement_of_spec,
    chunks_per_rank=2,
    placement_name=V_PLACEMENT_NAME,
)

DUALPIPE_SPEC = ScheduleSpec(
    name="dualpipe",
    multi_chunk=True,
    splits_backward=True,
    description="DualPipe: two model copies fed from both ends, forwards overlapped with backwards, some B/W split",
    microbatch_error=dualpipe_microbatch_error,
    generate=dualpipe,
    placement=dualpipe_placement,
    chunks_per_rank=2,
    placement_name="two copies: rank r holds model stage r of copy 0 and model stage pp-1-r of copy 1",
)
