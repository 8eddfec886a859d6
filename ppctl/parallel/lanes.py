"""Two communication lanes per group, so an overlapped pair's halves each keep one order of collectives.

DualPipe's overlapped pairs and the weight fills (``ppctl.pipeline.overlap``) run a forward's and a backward's
compute interleaved, one piece at a time, and the order of the pieces depends on when exchanges arrive. A group
that both halves talk to (the expert-parallel group, the TP group, the ranks that split a microbatch's tokens)
therefore gets a second communicator over the same ranks: the forward's collectives go through the first, every
collective inside a backward (a recomputed forward too) through the second (``current_lane``). Each communicator's
sequence of collectives is then the program's order on every rank, whatever the interleave does. Every collective is
posted asynchronously and finished through the pacer: inside a pair the half hands the turn to the other one while
its collective travels (``PairInterleave.exchanged``), so no half ever blocks on other ranks holding the turn.

One ``Lanes`` per worker says all of it (which communicator is each group's backward lane, and the pacer), wired in
one place (``ppctl.parallel.groups.lanes_of``) and shared by the group objects a chunk's layers receive.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol

import torch

FORWARD_LANE, BACKWARD_LANE = 0, 1


def current_lane() -> int:
    """``BACKWARD_LANE`` inside a backward (a recomputed forward too), else ``FORWARD_LANE``."""
    return BACKWARD_LANE if torch._C._current_graph_task_id() != -1 else FORWARD_LANE


class Pacer(Protocol):
    """What a posted collective is finished through while pairs run interleaved
    (``ppctl.pipeline.interleave.PairInterleave``)."""

    def exchanged(self, work) -> None:
        """Wait for ``work``, letting the other half of a pair compute meanwhile (outside a pair: just wait)."""


@dataclass(frozen=True)
class Lanes:
    """How one worker's groups communicate: ``backward`` pairs a group's communicator (its forward lane) with its
    backward lane's, for the groups that have one (the others use one communicator for both lanes; pairs, not a
    mapping proxy, so that a model holding its groups can still be deep-copied); ``pacer``: the overlap's, while
    pairs run interleaved, else None (every collective a plain blocking call)."""

    backward: tuple[tuple[object, object], ...] = ()
    pacer: Optional[Pacer] = None

    def communicator(self, group, lane: int | None = None):
        """The communicator of ``group``'s ``lane`` (the current one when None)."""
        lane = current_lane() if lane is None else lane
        if lane == BACKWARD_LANE:
            return next((backward for forward, backward in self.backward if forward == group), group)
        return group

    def finish(self, work) -> None:
        """Wait for a posted collective: through the pacer (the other half of a pair computes meanwhile) when there
        is one, else plainly."""
        if self.pacer is not None:
            self.pacer.exchanged(work)
        else:
            work.wait()

    def post(self, group, collective, *tensors, **options) -> None:
        """Run ``collective(*tensors, group=..., **options)`` on the current lane's communicator of ``group``: without
        a pacer as a plain blocking call, else posted asynchronously and finished through it."""
        communicator = self.communicator(group)
        if self.pacer is None:
            collective(*tensors, group=communicator, **options)
            return
        self.finish(collective(*tensors, group=communicator, async_op=True, **options))


ONE_LANE = Lanes()  # a group alone (one rank, or a test's): one communicator, no pacer


class OnLanes:
    """What a group object (TP, CP, a ``TokenSplit``) with ``group`` and ``lanes`` fields runs its collectives
    through."""

    def post(self, collective, *tensors, **options) -> None:
        """``collective`` on this group, through its ``lanes`` (``Lanes.post``)."""
        self.lanes.post(self.group, collective, *tensors, **options)
