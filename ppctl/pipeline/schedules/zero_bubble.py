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

The V schedules (ZB-V, V-Half, V-Min) are built from building blocks in ``vshape``.
"""

from __future__ import annotations

from collections import deque

from ppctl.parallel.placement import looped_placement

from .base import (BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, Action, Schedule, ScheduleError, ScheduleSpec,
                   at_least_one_microbatch, single_chunk_only)


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
