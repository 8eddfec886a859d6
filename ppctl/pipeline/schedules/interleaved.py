"""Interleaved 1F1B (Megatron's virtual pipeline): ``vpp`` chunks per rank, looped placement.

Rank r holds stages r, r + pp, r + 2*pp, ... Microbatches go through the chunks in
groups of ``pp``: on every rank the forwards run microbatches 0..pp-1 on chunk 0,
then the same microbatches on chunk 1, ..., then the next group; the backwards go
through the same groups from the last chunk down to chunk 0. Smaller steps through
more stages shrink the bubble by a factor ``vpp``, at the price of more messages.

Any number of microbatches works. When it is not a multiple of ``pp`` the groups
are made a little longer than ``pp`` (``num_microbatches // pp`` groups of near-equal
size), never shorter: a group shorter than ``pp`` after a full one can deadlock, since
chunk c + 1 of its first microbatch would be due before chunk c's output has gone
around the ring of ranks. With fewer than ``pp`` microbatches there is one group.
The checker proves the schedule over sweeps of (pp, vpp, num_microbatches).
"""

from __future__ import annotations

from ppctl.parallel.placement import looped_placement

from .base import BACKWARD, FORWARD, Action, Schedule, ScheduleError, ScheduleSpec, at_least_one_microbatch


def interleaved_1f1b(pp: int, vpp: int, num_microbatches: int) -> Schedule:
    """Build interleaved 1F1B for ``pp`` ranks and ``vpp`` chunks per rank.

    Rank r runs ``min(2*(pp - r - 1) + (vpp - 1)*group, vpp*num_microbatches)`` warm-up
    forwards (Megatron's count; ``group`` is the first group's size, ``pp`` when
    ``num_microbatches`` is a multiple of it), then alternates one forward and one
    backward, then runs the remaining backwards. With ``vpp=1`` the warm-up is 1F1B's
    ``pp - r - 1``, so the schedule is exactly 1F1B.
    """
    error = at_least_one_microbatch(pp, vpp, num_microbatches)
    if error is not None:
        raise ScheduleError(f"schedule interleaved_1f1b: {error}")
    groups = microbatch_groups(pp, num_microbatches)
    forward_order = _chunk_microbatch_order(groups, vpp, reverse_chunks=False)
    backward_order = _chunk_microbatch_order(groups, vpp, reverse_chunks=True)
    num_warmups = [_num_warmup(pp_rank, pp, vpp, len(groups[0])) for pp_rank in range(pp)]
    actions = tuple(
        _rank_actions(pp_rank, pp, num_warmups[pp_rank], forward_order, backward_order) for pp_rank in range(pp)
    )
    return Schedule("interleaved_1f1b", pp, vpp, num_microbatches, looped_placement(pp, vpp), actions)


def microbatch_groups(pp: int, num_microbatches: int) -> list[range]:
    """Consecutive microbatch groups that go through the chunks together: each at least pp long.

    ``num_microbatches // pp`` groups of near-equal size (larger ones first); one group
    of all microbatches when there are fewer than ``pp``. A group shorter than ``pp``
    after a full one would need a chunk's output before the pipeline delivers it.
    """
    if num_microbatches <= pp:
        return [range(num_microbatches)]
    count = num_microbatches // pp
    base, extra = divmod(num_microbatches, count)
    groups, start = [], 0
    for index in range(count):
        size = base + (1 if index < extra else 0)
        groups.append(range(start, start + size))
        start += size
    return groups


def _chunk_microbatch_order(groups: list[range], vpp: int, reverse_chunks: bool) -> list[tuple[int, int]]:
    """(chunk, microbatch) pairs in the order a rank runs them: each group through every chunk."""
    chunks = range(vpp - 1, -1, -1) if reverse_chunks else range(vpp)
    return [(chunk, mb) for group in groups for chunk in chunks for mb in group]


def _rank_actions(pp_rank: int, pp: int, num_warmup: int, forward_order: list[tuple[int, int]],
                  backward_order: list[tuple[int, int]]) -> tuple[Action, ...]:
    forwards = [Action(FORWARD, chunk * pp + pp_rank, mb) for chunk, mb in forward_order]
    backwards = [Action(BACKWARD, chunk * pp + pp_rank, mb) for chunk, mb in backward_order]
    num_warmup = min(num_warmup, len(forwards))
    num_steady = len(forwards) - num_warmup
    actions = forwards[:num_warmup]
    for i in range(num_steady):
        actions += [forwards[num_warmup + i], backwards[i]]
    return tuple(actions + backwards[num_steady:])


def _num_warmup(pp_rank: int, pp: int, vpp: int, group_size: int) -> int:
    if vpp == 1:  # plain 1F1B: ranks further down need fewer forwards before their first backward
        return pp - pp_rank - 1
    # The first backward on rank r (last chunk, microbatch 0) comes back after the first
    # group went through chunks 0..vpp-2 and microbatch 0 made the trip down and back up.
    return 2 * (pp - pp_rank - 1) + (vpp - 1) * group_size


INTERLEAVED_SPEC = ScheduleSpec(
    name="interleaved_1f1b",
    multi_chunk=True,
    splits_backward=False,
    description="Megatron's interleaved 1F1B: vpp chunks per rank (looped), bubble shrunk by vpp",
    microbatch_error=at_least_one_microbatch,
    generate=interleaved_1f1b,
)
