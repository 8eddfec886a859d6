"""GPipe: every forward of the step first, then every backward (one chunk per rank)."""

from __future__ import annotations

from ppctl.parallel.placement import looped_placement

from .base import BACKWARD, FORWARD, Action, Schedule, ScheduleSpec, at_least_one_microbatch, single_chunk_only


def gpipe(pp: int, vpp: int, num_microbatches: int) -> Schedule:
    """Build GPipe for ``pp`` ranks: rank r runs F of every microbatch, then BW of every microbatch.

    Backwards run in microbatch order (0 first), as the loss of microbatch 0 is the
    first one ready on the last rank. Every rank keeps all ``num_microbatches``
    activations alive at the turn.
    """
    single_chunk_only("gpipe", vpp)
    microbatches = range(num_microbatches)
    actions = tuple(
        tuple(Action(FORWARD, pp_rank, mb) for mb in microbatches)
        + tuple(Action(BACKWARD, pp_rank, mb) for mb in microbatches)
        for pp_rank in range(pp)
    )
    return Schedule("gpipe", pp, 1, num_microbatches, looped_placement(pp, 1), actions)


GPIPE_SPEC = ScheduleSpec(
    name="gpipe",
    multi_chunk=False,
    splits_backward=False,
    description="all forwards, then all backwards; simple, but every rank holds all microbatches' activations",
    microbatch_error=at_least_one_microbatch,
    generate=gpipe,
)
