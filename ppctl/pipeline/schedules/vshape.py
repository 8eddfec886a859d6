"""V-shape schedules with controllable memory (Qi et al., "Pipeline Parallelism with Controllable Memory").

Every rank holds two chunks in a V (rank r: stage r as chunk 0, stage 2pp-1-r as chunk 1),
the backward split into B and W. The three schedules differ only in how many chunk
activations a rank may hold, and so in how long each activation may live:

- ``zbv`` (V-ZB): 2pp chunk activations (pp microbatches, 1F1B's peak), no bubble
  beyond the fill at F=B=W;
- ``v_half``: (pp+2)//2 microbatches, the paper's V-Half level (a little over half of 1F1B's);
- ``v_min``: (pp+4)//3 microbatches, the paper's V-Min level (a third of 1F1B's as pp grows).

The construction follows the paper's building blocks. Time runs in slots of one chunk pass
(a microbatch costs each rank six: F, B and W on both chunks). A building block gives each
rank the slots of its six passes of microbatch 0; microbatch k repeats them 6k slots later,
so in the steady state every rank fills each period of six slots. Passes that go down the
ranks (chunk 0's forward, chunk 1's input gradient) move ``down_hop`` slots per rank, those
that come back up (chunk 1's forward, chunk 0's input gradient) ``up_hop`` slots; three turns
join them (forward to forward on the last rank, forward to input gradient at the loss on
rank 0, input gradient to input gradient on the last rank), and each W takes the first slot
of the period left free after its B. The hops and turns set how long each activation lives,
forward to W, and a rank holds about the sum of its two lifespans over six: hops of 1 both
ways give V-Min, down 1 and up 2 V-Half, down 1 and up 5 V-ZB.

Sorting each rank's passes by their block slot gives its order. A unit-time list schedule
then compresses it, which is where the warm-up and cool-down are decided: a free rank runs
the first pass among the next 16 (or 2pp) of its order that is ready and keeps its activations
within the cap; a W runs in its place only while the rank is at the cap with forwards still to
come, otherwise it waits until nothing else is ready, so in the warm-up the forwards run ahead
and in the cool-down the input gradients (the critical path) go first. A small search over the
turns keeps the shortest result; it is cached per size.

Measured at F=B=W with m >= 2pp (``tests/unit/test_vshape.py``, pp 1..8): each schedule takes
3m plus the paper's bubble formula for the peak it reaches (or the fill, (pp-1)/2, where that is
larger), so V-ZB meets the fill bound and the bubble does not grow with m.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from functools import lru_cache
from itertools import islice
from typing import Callable, Optional, Sequence

from ppctl.parallel.placement import v_placement

from .base import (BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, V_PLACEMENT_NAME, Action, Schedule, ScheduleError,
                   ScheduleSpec, at_least_one_microbatch, two_chunks_only, v_placement_of_spec)

PERIOD = 6  # slots per microbatch on a rank: F, B and W on each of its two chunks

# A rank's six passes, by index: (action kind, chunk)
FORWARD_0, FORWARD_1, INPUT_GRAD_1, INPUT_GRAD_0, WEIGHT_GRAD_1, WEIGHT_GRAD_0 = range(6)
PASSES = ((FORWARD, 0), (FORWARD, 1), (BACKWARD_INPUT, 1), (BACKWARD_INPUT, 0), (BACKWARD_WEIGHT, 1),
          (BACKWARD_WEIGHT, 0))
_NEVER = 1 << 60  # end time of a pass not yet placed

Order = tuple[tuple[int, int], ...]  # one rank's (pass, microbatch) in order


@dataclass(frozen=True)
class BuildingBlock:
    """The slot offsets that place one microbatch's passes on every rank (see the module docstring)."""

    down_hop: int  # chunk 0's forward and chunk 1's input gradient, from rank r to r+1
    up_hop: int  # chunk 1's forward and chunk 0's input gradient, from rank r+1 to r
    turn_last: int = 1  # chunk 0's forward to chunk 1's forward, on the last rank
    turn_loss: int = 1  # chunk 1's forward to its input gradient, at the loss on rank 0
    turn_back: int = 1  # chunk 1's input gradient to chunk 0's, on the last rank


# --- the three schedules ------------------------------------------------------------------

def zbv(pp: int, vpp: int, num_microbatches: int) -> Schedule:
    """Build V-ZB: pp microbatches of activations per rank (1F1B's peak), no bubble beyond the fill.

    At F=B=W with at least pp microbatches the step takes 3m + (pp-1)/2 (whole-rank units):
    the last rank's wait for the first microbatch, (pp-1) chunk forwards, is all the idle time.
    """
    return _build("zbv", pp, vpp, num_microbatches)


def v_half(pp: int, vpp: int, num_microbatches: int) -> Schedule:
    """Build V-Half: at most (pp+2)//2 microbatches of activations per rank, about half of 1F1B's bubble."""
    return _build("v_half", pp, vpp, num_microbatches)


def v_min(pp: int, vpp: int, num_microbatches: int) -> Schedule:
    """Build V-Min: at most (pp+4)//3 microbatches of activations per rank, about 2/3 of 1F1B's bubble."""
    return _build("v_min", pp, vpp, num_microbatches)


def activation_cap(name: str, pp: int) -> int:
    """The chunk activations a rank of schedule ``name`` may hold (two make one microbatch).

    The paper's levels: pp microbatches for V-ZB, (pp+2)//2 for V-Half, (pp+4)//3 for V-Min.
    An exhaustive search over building blocks (any hop and turn delays up to a period, pp 3..12)
    found none that holds less than the V-Min level.
    """
    microbatches = {"zbv": pp, "v_half": (pp + 2) // 2, "v_min": (pp + 4) // 3}[name]
    return 2 * microbatches


def _build(name: str, pp: int, vpp: int, num_microbatches: int) -> Schedule:
    """Refuse bad sizes in one line, then the (cached) schedule ``name`` for these sizes."""
    two_chunks_only(name, vpp)
    error = at_least_one_microbatch(pp, vpp, num_microbatches)
    if error is not None:
        raise ScheduleError(f"schedule {name}: {error}")
    return _cached_schedule(name, pp, num_microbatches)


@lru_cache(maxsize=256)
def _cached_schedule(name: str, pp: int, num_microbatches: int) -> Schedule:
    """The schedule ``name`` as ppctl data: the searched orders turned into actions on the V's stages."""
    orders = _searched_orders(name, pp, num_microbatches)
    actions = tuple(tuple(_action(pp, pp_rank, pass_, mb) for pass_, mb in order)
                    for pp_rank, order in enumerate(orders))
    return Schedule(name, pp, 2, num_microbatches, v_placement(pp), actions)


def _action(pp: int, pp_rank: int, pass_: int, mb: int) -> Action:
    """The ppctl action of ``pass_`` for microbatch ``mb`` on ``pp_rank`` (chunk 1 is stage 2pp-1-rank)."""
    kind, chunk = PASSES[pass_]
    return Action(kind, pp_rank if chunk == 0 else 2 * pp - 1 - pp_rank, mb)


# --- the search ------------------------------------------------------------------------------

def candidate_blocks(name: str) -> tuple[BuildingBlock, ...]:
    """The building blocks tried for ``name``.

    Down-going passes always hop one slot; the families are where the best blocks of a wider
    sweep (hops 1..5, turns 1..5, pp 2..8) were found. V-Half also tries V-Min's blocks: for odd
    pp both caps are the same.
    """
    if name == "zbv":
        return (BuildingBlock(down_hop=1, up_hop=5),)
    minimal = tuple(BuildingBlock(1, 1, 1, turn_loss, 1) for turn_loss in (1, 3, 5))
    if name == "v_min":
        return minimal
    return tuple(BuildingBlock(1, 2, 1, turn_loss, turn_back) for turn_loss in range(1, 6)
                 for turn_back in (1, 2)) + minimal


def _window(pp: int) -> int:
    """How many of its next passes a rank looks at when choosing one.

    At least 2pp: in V-ZB's warm-up rank 0 runs 2pp-1 forwards of chunk 0 before its first of
    chunk 1, and with 16 V-ZB misses the fill bound from pp=20 on.
    """
    return max(16, 2 * pp)


def _searched_orders(name: str, pp: int, num_microbatches: int) -> tuple[Order, ...]:
    """The shortest compressed orders among ``name``'s candidates (the lower peak on ties), within its cap.

    If none finishes at the cap (not seen for pp <= 20), the least cap above it that works;
    ``ScheduleError`` if none finishes even at 2pp chunk activations.
    """
    for cap in range(activation_cap(name, pp), 2 * pp + 1):
        best: Optional[tuple[int, int, tuple[Order, ...]]] = None
        for block in candidate_blocks(name):
            times = block_times(pp, block)
            if times is None:
                continue
            orders = rank_orders(times, num_microbatches)
            result = _Compression(pp, num_microbatches, orders, cap, _window(pp)).run()
            if result is not None and (best is None or result[:2] < best[:2]):
                best = result
        if best is not None:
            return best[2]
    raise ScheduleError(f"schedule {name}: no V order found for pp={pp}, num_microbatches={num_microbatches}")


def block_times(pp: int, block: BuildingBlock) -> Optional[list[list[int]]]:
    """Each rank's slot for each of its six passes of microbatch 0, or None if two share a slot of the period."""
    last = pp - 1
    times = [[0] * len(PASSES) for _ in range(pp)]
    for pp_rank in range(pp):
        times[pp_rank][FORWARD_0] = pp_rank * block.down_hop
    for pp_rank in range(pp):
        times[pp_rank][FORWARD_1] = times[last][FORWARD_0] + block.turn_last + (last - pp_rank) * block.up_hop
    for pp_rank in range(pp):
        times[pp_rank][INPUT_GRAD_1] = times[0][FORWARD_1] + block.turn_loss + pp_rank * block.down_hop
    for pp_rank in range(pp):
        times[pp_rank][INPUT_GRAD_0] = times[last][INPUT_GRAD_1] + block.turn_back + (last - pp_rank) * block.up_hop
    for rank_times in times:
        if not _place_weight_grads(rank_times):
            return None
    return times


def _place_weight_grads(rank_times: list[int]) -> bool:
    """Put each W in the first slot of the period left free after its B; False if F/B passes collide."""
    taken = {slot % PERIOD for slot in rank_times[:WEIGHT_GRAD_1]}
    if len(taken) < WEIGHT_GRAD_1:
        return False
    for input_grad, weight_grad in ((INPUT_GRAD_1, WEIGHT_GRAD_1), (INPUT_GRAD_0, WEIGHT_GRAD_0)):
        delay = next(d for d in range(1, PERIOD) if (rank_times[input_grad] + d) % PERIOD not in taken)
        rank_times[weight_grad] = rank_times[input_grad] + delay
        taken.add(rank_times[weight_grad] % PERIOD)
    return True


def rank_orders(times: Sequence[Sequence[int]], num_microbatches: int) -> list[Order]:
    """Each rank's passes of every microbatch sorted by block slot (microbatch k runs PERIOD * k later)."""
    orders = []
    for rank_times in times:
        slots = sorted((slot + PERIOD * mb, pass_, mb) for pass_, slot in enumerate(rank_times)
                       for mb in range(num_microbatches))
        orders.append(tuple((pass_, mb) for _, pass_, mb in slots))
    return orders


# --- the compression: a unit-time list schedule guided by the orders ---------------------------

class _Compression:
    """Run the orders at one slot per pass, each rank choosing within a look-ahead window (module docstring).

    ``run`` returns (makespan in slots, peak chunk activations, the orders as run), or None if the ranks stall.
    """

    def __init__(self, pp: int, num_microbatches: int, orders: list[Order], cap: int, window: int):
        self.pp, self.cap, self.window = pp, cap, window
        ends = [[[_NEVER] * num_microbatches for _ in range(pp)] for _ in range(WEIGHT_GRAD_1)]
        # per rank, its order as (0 forward / 1 input gradient / 2 W, microbatch, the end lists its inputs wait on)
        self.entries = [[(_pass_class(pass_), mb, dependencies[pass_]) for pass_, mb in order]
                        for order, dependencies in zip(orders, _dependencies(ends, pp))]
        self.ends, self.orders = ends, orders
        # per rank, its passes not yet placed, in order; a deque: a rank takes them near the front (within its window)
        self.open = [deque(range(len(order))) for order in orders]
        self.held = [0] * pp  # chunk activations from forward to W
        self.peak = 0
        self.forwards_left = [2 * num_microbatches] * pp
        self.runs: list[list[tuple[int, int]]] = [[] for _ in range(pp)]

    def run(self) -> Optional[tuple[int, int, tuple[Order, ...]]]:
        """Place every pass, slot by slot; a slot where no rank can start anything is a stall (nothing changes).

        Each rank picks and places in turn: a pass placed at ``time`` ends at ``time + 1``, so no
        other rank's pick at ``time`` sees it, as if all ranks picked first.
        """
        remaining, time = sum(map(len, self.orders)), 0
        pick, place, ranks = self._pick, self._place, range(self.pp)
        while remaining:
            placed = 0
            for pp_rank in ranks:
                position = pick(pp_rank, time)
                if position is not None:
                    place(pp_rank, position, time)
                    placed += 1
            if not placed:
                return None
            remaining -= placed
            time += 1
        return time, self.peak, tuple(tuple(run) for run in self.runs)

    def _pick(self, pp_rank: int, time: int) -> Optional[int]:
        """The position in the rank's open passes of the pass it starts at ``time``, or None to idle.

        The first ready pass of the window, a forward only if the activations it adds, with
        those of the forwards it overtakes, stay within the cap; a deferred W only when
        nothing else is ready.
        """
        entries, open_, held, cap = self.entries[pp_rank], self.open[pp_rank], self.held[pp_rank], self.cap
        defer_weights = held < cap or not self.forwards_left[pp_rank]
        overtaken, most_overtaken, deferred = 0, 0, None
        for position, index in enumerate(islice(open_, self.window)):
            pass_class, mb, dependencies = entries[index]
            for ends in dependencies:
                if ends[mb] > time:
                    break
            else:  # ready
                if pass_class == 0:
                    if held + most_overtaken + 1 <= cap:
                        return position
                elif pass_class == 1 or not defer_weights:
                    return position
                elif deferred is None:
                    deferred = position
            # a forward picked past these must leave room for the forwards among them
            if pass_class == 0:
                overtaken += 1
                most_overtaken = max(most_overtaken, overtaken)
            elif pass_class == 2:
                overtaken -= 1
        return deferred

    def _place(self, pp_rank: int, position: int, time: int) -> None:
        """Start the rank's open pass at ``position`` at ``time``: its end, the rank's activations, its run."""
        open_ = self.open[pp_rank]
        pass_, mb = self.orders[pp_rank][open_[position]]
        del open_[position]
        if pass_ < INPUT_GRAD_1:
            self.held[pp_rank] += 1
            self.forwards_left[pp_rank] -= 1
            self.peak = max(self.peak, self.held[pp_rank])
        elif pass_ >= WEIGHT_GRAD_1:
            self.held[pp_rank] -= 1
        if pass_ < WEIGHT_GRAD_1:
            self.ends[pass_][pp_rank][mb] = time + 1
        self.runs[pp_rank].append((pass_, mb))


def _pass_class(pass_: int) -> int:
    """0 for a forward, 1 for an input gradient, 2 for a W (what ``_Compression._pick`` tells apart)."""
    return 0 if pass_ < INPUT_GRAD_1 else 1 if pass_ < WEIGHT_GRAD_1 else 2


def _dependencies(ends: list[list[list[int]]], pp: int) -> list[list[tuple[list[int], ...]]]:
    """Per rank and pass, the end lists (by microbatch) of the passes its inputs come from (the V's dependencies):
    a pass is ready at ``time`` once each of them holds an end no later than ``time``."""
    last, per_rank = pp - 1, []
    for pp_rank in range(pp):
        forward_0 = (ends[FORWARD_0][pp_rank - 1],) if pp_rank > 0 else ()
        forward_1 = ends[FORWARD_0][pp_rank] if pp_rank == last else ends[FORWARD_1][pp_rank + 1]
        input_grad_1 = (ends[FORWARD_1][pp_rank],) + ((ends[INPUT_GRAD_1][pp_rank - 1],) if pp_rank > 0 else ())
        following = ends[INPUT_GRAD_1][pp_rank] if pp_rank == last else ends[INPUT_GRAD_0][pp_rank + 1]
        per_rank.append([forward_0, (forward_1,), input_grad_1, (ends[FORWARD_0][pp_rank], following),
                         (ends[INPUT_GRAD_1][pp_rank],), (ends[INPUT_GRAD_0][pp_rank],)])  # a W: its B
    return per_rank


# --- the registry entries ----------------------------------------------------------------------

def _v_spec(name: str, generate: Callable[[int, int, int], Schedule], description: str) -> ScheduleSpec:
    """A registry entry for a V schedule: two chunks per rank in a V, the backward split into B and W."""
    return ScheduleSpec(name=name, multi_chunk=True, splits_backward=True, description=description,
                        microbatch_error=at_least_one_microbatch, generate=generate, placement=v_placement_of_spec,
                        chunks_per_rank=2, placement_name=V_PLACEMENT_NAME)


ZBV_SPEC = _v_spec("zbv", zbv,
                             "zero-bubble V (V-ZB): two chunks per rank in a V, B/W split, 1F1B's peak activations")
V_HALF_SPEC = _v_spec("v_half", v_half,
                      "V-Half: a V with B/W split, (pp+2)//2 microbatches of activations, about half 1F1B's bubble")
V_MIN_SPEC = _v_spec("v_min", v_min,
                     "V-Min: a V with B/W split, (pp+4)//3 microbatches of activations, about 2/3 of 1F1B's bubble")
