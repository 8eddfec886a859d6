"""Two communication lanes per group, so an overlapped pair's halves each keep one order of collectives.

DualPipe's overlapped pairs and the weight fills (``ppctl.pipeline.interleave``) run a forward's and a backward's
compute interleaved, one piece at a time, and the order of the pieces depends on when exchanges arrive. A group
that both halves talk to (the expert-parallel group, the TP group, the ranks that split a microbatch's tokens)
therefore gets a second communicator over the same ranks: the forward's collectives go through the first, every
collective inside a backward (a recomputed forward too) through the second (``current_lane``). Each communicator's
sequence of collectives is then the program's order on every rank, whatever the interleave does. Every collective is
posted asynchronously and finished through ``finish``: inside a pair the half hands the turn to the other one while
its collective travels (``PairInterleave.exchanged``), so no half ever blocks on other ranks holding the turn.
"""

from __future__ import annotations

import torch

FORWARD_LANE, BACKWARD_LANE = 0, 1


def current_lane() -> int:
    """``BACKWARD_LANE`` inside a backward (a recomputed forward too), else ``FORWARD_LANE``."""
    return BACKWARD_LANE if torch._C._current_graph_task_id() != -1 else FORWARD_LANE


def lane_communicator(group, backward_group, lane: int | None = None):
    """The communicator of ``lane`` (the current one when None): ``backward_group`` for the backward lane when there
    is one, else ``group``."""
    lane = current_lane() if lane is None else lane
    return backward_group if lane == BACKWARD_LANE and backward_group is not None else group


def finish(work, interleave) -> None:
    """Wait for a posted collective: through ``interleave.exchanged`` (the other half of a pair computes meanwhile)
    when there is an interleave, else plainly."""
    if interleave is not None:
        interleave.exchanged(work)
    else:
        work.wait()


class OnTwoLanes:
    """What a group object (TP, CP, a ``TokenSplit``) with ``group``, ``backward_group`` and ``interleave`` fields
    runs its collectives through."""

    def post(self, collective, *tensors, **options) -> None:
        """Run ``collective(*tensors, group=..., **options)`` on the current lane's communicator: without an
        interleave as a plain blocking call, else posted asynchronously and finished through it (``finish``)."""
        communicator = lane_communicator(self.group, self.backward_group)
        if self.interleave is None:
            collective(*tensors, group=communicator, **options)
            return
        finish(collective(*tensors, group=communicator, async_op=True, **options), self.interleave)
