"""Two looped schedules as torch.distributed.pipelining defines them: breadth-first, and interleaved zero bubble.

Both place ``vpp`` chunks per rank in a loop (rank r holds stages r, r + pp, ...).

``looped_bfs`` (Lamy-Poirier, "Breadth-First Pipeline Parallelism", arXiv 2211.05953):
every microbatch through a rank's first chunk before any goes through its second, and
so on; then the backwards, last chunk first, each chunk's microbatches in reverse
order (the last forward's loss is the first one ready). GPipe's shape on every chunk:
the fewest switches between chunks (so the most room to overlap the data-parallel
gradient reduction of a finished chunk), at GPipe's activation memory.

``interleaved_zb`` (the ZB-1P schedule of Qi et al., "Zero Bubble Pipeline
Parallelism", as torch's ``ScheduleInterleavedZeroBubble``): interleaved 1F1B with the
backward split into B and W. The microbatches go through the chunks in rounds of
``m / max(1, m // pp)``; rank r runs ``(vpp - 1) * round + pp - 1 - r`` warm-up forwards
(one hop per rank, not interleaved 1F1B's two: B alone is what the previous rank waits
for), then pairs of one forward and one B, the first r pairs without a W and each later
one followed by the oldest pending W; the remaining Ws close the step.
"""

from __future__ import annotations

from typing import Callable, Optional

from ppctl.parallel.placement import looped_placement

from .base import (BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, Action, Schedule, ScheduleError,
                   ScheduleSpec, at_least_one_microbatch)


def looped_bfs(pp: int, vpp: int, num_microbatches: int) -> Schedule:
    """Build breadth-first looped: per rank, all forwards chunk by chunk, then all backwards from the last chunk."""
    error = at_least_one_microbatch(pp, vpp, num_microbatches)
    if error is not None:
        raise ScheduleError(f"schedule looped_bfs: {error}")
    microbatches = range(num_microbatches)
    actions = []
    for pp_rank in range(pp):
        stages = [chunk * pp + pp_rank for chunk in range(vpp)]
        forwards = [Action(FORWARD, stage, mb) for stage in stages for mb in microbatches]
        backwards = [Action(BACKWARD, stage, mb) for stage in reversed(stages) for mb in reversed(microbatches)]
        actions.append(tuple(forwards + backwards))
    return Schedule("looped_bfs", pp, vpp, num_microbatches, looped_placement(pp, vpp), tuple(actions))


def rounds_error(pp: int, vpp: int, num_microbatches: int) -> Optional[str]:
    """interleaved_zb's rule: the microbatches split into ``max(1, m // pp)`` equal rounds."""
    error = at_least_one_microbatch(pp, vpp, num_microbatches)
    if error is not None:
        return error
    rounds = max(1, num_microbatches // pp)
    if num_microbatches % rounds:
        return (f"num_microbatches={num_microbatches} must split into max(1, m // pp) = {rounds} equal rounds "
                f"(a multiple of {rounds})")
    return None


def interleaved_zb(pp: int, vpp: int, num_microbatches: int) -> Schedule:
    """Build interleaved zero bubble (ZB-1P) for ``pp`` ranks and ``vpp`` looped chunks per rank."""
    error = rounds_error(pp, vpp, num_microbatches)
    if error is not None:
        raise ScheduleError(f"schedule interleaved_zb: {error}")
    per_round = num_microbatches // max(1, num_microbatches // pp)
    actions = tuple(_zb_rank_actions(pp_rank, pp, vpp, num_microbatches, per_round) for pp_rank in range(pp))
    return Schedule("interleaved_zb", pp, vpp, num_microbatches, looped_placement(pp, vpp), actions)


def _zb_rank_actions(pp_rank: int, pp: int, vpp: int, num_microbatches: int, per_round: int) -> tuple[Action, ...]:
    """One rank's order: warm-up forwards, forward-and-B pairs (a W after each past the first ``pp_rank``), Ws."""
    total = vpp * num_microbatches
    warmup = min((vpp - 1) * per_round + pp - 1 - pp_rank, total)

    def forward_stage(op: int) -> int:
        return (op // per_round) % vpp * pp + pp_rank

    def backward_stage(op: int) -> int:
        return (vpp - 1 - (op - warmup) // per_round % vpp) * pp + pp_rank

    forward, backward = _next_microbatch(FORWARD), _next_microbatch(BACKWARD_INPUT)
    weight = _next_microbatch(BACKWARD_WEIGHT)
    actions = [forward(forward_stage(op)) for op in range(warmup)]
    pending: list[int] = []  # the stages of the Bs whose W is still due, oldest first
    for op in range(warmup, total + warmup):
        if op < total:
            actions.append(forward(forward_stage(op)))
        actions.append(backward(backward_stage(op)))
        pending.append(backward_stage(op))
        if op - warmup >= pp_rank:
            actions.append(weight(pending.pop(0)))
    return tuple(actions + [weight(stage) for stage in pending])


def _next_microbatch(kind: str) -> Callable[[int], Action]:
    """An action maker for ``kind`` that gives each stage its microbatches in order, 0 first."""
    counts: dict[int, int] = {}

    def make(stage: int) -> Action:
        microbatch = counts.get(stage, 0)
        counts[stage] = microbatch + 1
        return Action(kind, stage, microbatch)
    return make


LOOPED_BFS_SPEC = ScheduleSpec(
    name="looped_bfs",
    multi_chunk=True,
    splits_backward=False,
    description="breadth-first looped: all microbatches through each chunk in turn; GPipe's memory, fewest switches",
    microbatch_error=at_least_one_microbatch,
    generate=looped_bfs,
)

INTERLEAVED_ZB_SPEC = ScheduleSpec(
    name="interleaved_zb",
    multi_chunk=True,
    splits_backward=True,
    description="interleaved zero bubble (ZB-1P): interleaved 1F1B with split backwards, Ws filling the bubble",
    microbatch_error=rounds_error,
    generate=interleaved_zb,
)
