"""Zero-bubble schedules (Qi et al., "Zero Bubble Pipeline Parallelism"): the backward split into B and W.

B computes the input gradient only, so it is what the previous stage waits for; W
computes the weight gradients, which nothing downstream needs before the optimizer
step. Deferring W lets a rank pass gradients on sooner and fill its idle time with Ws.

``zb_h1``: the paper's memory-efficient handcrafted schedule. 1F1B's order with each
backward split; rank r keeps its last r Ws pending during the steady phase (so the
forward/B rhythm is never held up by a W) and runs them in the cool-down, where 1F1B
idles. Counting a microbatch's activations until its W, every rank holds at most pp
microbatches, the peak of 1F1B's rank 0. Bubble (pp-1)(F+B-W) against 1F1B's
(pp-1)(F+B+W).

``zbv``: two chunks per rank in a V (rank r holds stages r and 2pp-1-r), so a
microbatch's first and last stages sit on rank 0. The order comes from a greedy
list schedule under unit costs, as the paper's own V schedules are built: each rank,
when free, runs a ready B first (the critical path), else a ready forward if its
activation budget (pp microbatches through both chunks, 1F1B's peak) allows, else a
pending W. It is not the paper's hand-placed ZB-V figure step for step; docs/schedules.md
gives its simulated bubble next to the published one.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from ppctl.parallel.placement import looped_placement, v_placement

from .base import (BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, V_PLACEMENT_NAME, Action, Schedule, ScheduleError,
                   ScheduleSpec, at_least_one_microbatch, single_chunk_only, two_chunks_only, v_placement_of_spec)
from .list_schedule import UnitListSchedule


# --- ZB-H1 -----------------------------------------------------------------------------------

def zb_h1(pp: int, vpp: int, num_microbatches: int) -> Schedule:
    """Build ZB-H1: 1F1B with split backwards, rank r deferring r Ws to fill its cool-down.

    Rank r runs ``min(pp - r - 1, m)`` warm-up forwards (as 1F1B), then pairs of one
    forward and one B, each followed by the W of the microbatch r places back, then the
    remaining Bs each followed by one W, then the Ws still pending.
    """
    single_chunk_only("zb_h1", vpp)
    _refuse_bad_count("zb_h1", pp, vpp, num_microbatches)
    actions = tuple(_zb_h1_rank(pp_rank, pp, num_microbatches) for pp_rank in range(pp))
    return Schedule("zb_h1", pp, 1, num_microbatches, looped_placement(pp, 1), actions)


def _zb_h1_rank(pp_rank: int, pp: int, num_microbatches: int) -> tuple[Action, ...]:
    """One rank's ZB-H1 actions: warm-up, steady F/B with Ws ``pp_rank`` behind, cool-down B/W, drain."""
    num_warmup = min(pp - pp_rank - 1, num_microbatches)
    actions = [Action(FORWARD, pp_rank, mb) for mb in range(num_warmup)]
    pending: deque[int] = deque()  # microbatches whose B ran and whose W has not
    for mb in range(num_microbatches - num_warmup):  # steady: Ws lag pp_rank microbatches behind the Bs
        actions += [Action(FORWARD, pp_rank, num_warmup + mb), Action(BACKWARD_INPUT, pp_rank, mb)]
        pending.append(mb)
        if len(pending) > pp_rank:
            actions.append(Action(BACKWARD_WEIGHT, pp_rank, pending.popleft()))
    for mb in range(num_microbatches - num_warmup, num_microbatches):  # cool-down: a W in each wait for a B
        actions.append(Action(BACKWARD_INPUT, pp_rank, mb))
        pending.append(mb)
        actions.append(Action(BACKWARD_WEIGHT, pp_rank, pending.popleft()))
    actions += [Action(BACKWARD_WEIGHT, pp_rank, mb) for mb in pending]
    return tuple(actions)


# --- ZB-V ------------------------------------------------------------------------------------

def zbv(pp: int, vpp: int, num_microbatches: int) -> Schedule:
    """Build the zero-bubble V schedule: chunks r and 2pp-1-r on rank r, greedy B > F > W order.

    The order is that of a unit-cost list schedule (every chunk action takes one time
    unit, messages are free); each rank's activation budget is 2*pp chunk activations
    (pp whole microbatches), counted from F to W; a new microbatch enters chunk 0 only
    while the chunk-1 activations owed to those already started still fit. Raises
    ``ScheduleError`` if the list schedule ever stalls (the tests sweep pp 1..8).
    """
    two_chunks_only("zbv", vpp)
    _refuse_bad_count("zbv", pp, vpp, num_microbatches)
    orders = _VListSchedule(pp, num_microbatches).run(3 * 2 * pp * num_microbatches)
    return Schedule("zbv", pp, 2, num_microbatches, v_placement(pp), tuple(tuple(order) for order in orders))


@dataclass
class _RankState:
    """What one rank of the list schedule holds: activations, reserved room, Ws to run."""

    first_stage: int  # chunk 0: stage r
    last_stage: int  # chunk 1: stage 2pp-1-r
    held: int = 0  # chunk activations from F until W
    owed: int = 0  # microbatches past chunk 0 here whose chunk-1 forward is still to come
    pending_weights: deque = field(default_factory=deque)


class _VListSchedule(UnitListSchedule):
    """The zbv policy on the unit-cost list schedule: B first, then F within the budget, then W."""

    name = "zbv"
    durations = {FORWARD: 1, BACKWARD_INPUT: 1, BACKWARD_WEIGHT: 1}

    def __init__(self, pp: int, num_microbatches: int):
        super().__init__(v_placement(pp), pp, num_microbatches)
        self.budget = 2 * pp  # chunk activations per rank: pp microbatches through both chunks
        self.ranks = [_RankState(r, 2 * pp - 1 - r) for r in range(pp)]

    def pick(self, pp_rank: int, time: int):
        """B first (oldest microbatch, last chunk on ties), then F within budget (last chunk first), then W."""
        state = self.ranks[pp_rank]
        backwards = [stage for stage in (state.last_stage, state.first_stage) if self.backward_ready(stage, time)]
        if backwards:
            stage = min(backwards, key=lambda s: self.next_backward[s])
            return Action(BACKWARD_INPUT, stage, self.next_backward[stage])
        if self.forward_ready(state.last_stage, time) and state.held + 1 <= self.budget:
            return Action(FORWARD, state.last_stage, self.next_forward[state.last_stage])
        # a new microbatch enters chunk 0 only while the chunk-1 activations owed to those already
        # started still fit: the V's far end can then always run, so Bs and hence Ws keep coming
        if self.forward_ready(state.first_stage, time) and state.held + state.owed + 1 <= self.budget:
            return Action(FORWARD, state.first_stage, self.next_forward[state.first_stage])
        if state.pending_weights:
            stage, mb = state.pending_weights[0]
            return Action(BACKWARD_WEIGHT, stage, mb)
        return None

    def after(self, pp_rank: int, action: Action) -> None:
        """Activations held and owed, and the Ws pending, once ``action`` is placed."""
        state = self.ranks[pp_rank]
        if action.kind == FORWARD:
            state.held += 1
            state.owed += 1 if action.stage == state.first_stage else -1
        elif action.kind == BACKWARD_INPUT:
            state.pending_weights.append((action.stage, action.microbatch))
        else:
            state.pending_weights.popleft()
            state.held -= 1


# --- shared rules and the registry entries -----------------------------------------------------

def _refuse_bad_count(name: str, pp: int, vpp: int, num_microbatches: int) -> None:
    """Raise ``ScheduleError`` (one line) unless the step has at least one microbatch."""
    error = at_least_one_microbatch(pp, vpp, num_microbatches)
    if error is not None:
        raise ScheduleError(f"schedule {name}: {error}")


ZB_H1_SPEC = ScheduleSpec(
    name="zb_h1",
    multi_chunk=False,
    splits_backward=True,
    description="zero-bubble H1: 1F1B with the backward split into B and W, Ws filling the cool-down",
    microbatch_error=at_least_one_microbatch,
    generate=zb_h1,
)

ZBV_SPEC = ScheduleSpec(
    name="zbv",
    multi_chunk=True,
    splits_backward=True,
    description="zero-bubble V: two chunks per rank in a V, B/W split, 1F1B's peak activations",
    microbatch_error=at_least_one_microbatch,
    generate=zbv,
    placement=v_placement_of_spec,
    chunks_per_rank=2,
    placement_name=V_PLACEMENT_NAME,
)
