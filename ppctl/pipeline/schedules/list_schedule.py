"""Unit-cost list schedules: the engine under the orders that are found by simulation (Hanayo).

Time advances one unit at a time; every rank that is free picks its next action from the
state at that moment (a subclass's ``pick``), which then runs for its duration in units.
Messages are free. A microbatch visits the stages of the placement in index order (one
model copy): a stage's forward needs the previous stage's forward of the same microbatch,
and its backward (``B`` or ``BW``) its own forward and the next stage's backward. Each
stage runs its forwards, and its backwards, in microbatch order. The checker proves the
resulting order against the program's messages; this engine only decides it.
"""

from __future__ import annotations

from typing import Optional

from ppctl.parallel.placement import Placement

from .base import BACKWARD, BACKWARD_INPUT, FORWARD, Action, ScheduleError


class UnitListSchedule:
    """The shared state and loop of a list schedule; ``pick`` (and ``after``) are the subclass's policy."""

    name = "list"
    durations: dict[str, int] = {}  # action kind -> units; every kind a subclass picks

    def __init__(self, placement: Placement, pp: int, num_microbatches: int):
        self.placement, self.pp, self.num_microbatches = placement, pp, num_microbatches
        self.num_stages = placement.num_stages
        self.forward_end: list[list[Optional[int]]] = [[None] * num_microbatches for _ in range(self.num_stages)]
        self.backward_end: list[list[Optional[int]]] = [[None] * num_microbatches for _ in range(self.num_stages)]
        self.next_forward = [0] * self.num_stages
        self.next_backward = [0] * self.num_stages
        self.free_at = [0] * pp
        self.orders: list[list[Action]] = [[] for _ in range(pp)]
        order = range(self.num_stages)
        self.previous_stage = dict(zip(order[1:], order))
        self.next_stage = dict(zip(order, order[1:]))

    def run(self, total_actions: int) -> list[list[Action]]:
        """Run until ``total_actions`` are placed; each rank's order. ``ScheduleError`` if nothing can move."""
        remaining, time = total_actions, 0
        while remaining:
            chosen = [(rank, self.pick(rank, time)) for rank in range(self.pp) if self.free_at[rank] <= time]
            chosen = [(rank, action) for rank, action in chosen if action is not None]
            if not chosen and all(free_at <= time for free_at in self.free_at):
                raise ScheduleError(f"{self.name}: the list schedule stalled at time {time} (pp={self.pp}, "
                                    f"stages={self.num_stages}, num_microbatches={self.num_microbatches})")
            for rank, action in chosen:
                self._record(rank, action, time)
            remaining -= len(chosen)
            time += 1
        return self.orders

    def pick(self, pp_rank: int, time: int) -> Optional[Action]:
        """The action ``pp_rank`` starts at ``time``, or None to idle."""
        raise NotImplementedError

    def after(self, pp_rank: int, action: Action) -> None:
        """The subclass's bookkeeping once ``action`` is placed (activations held, pending work)."""

    def forward_ready(self, stage: int, time: int) -> bool:
        """Whether ``stage``'s next forward has its input by ``time``."""
        mb, previous = self.next_forward[stage], self.previous_stage.get(stage)
        if mb >= self.num_microbatches:
            return False
        return previous is None or self._done_by(self.forward_end, previous, mb, time)

    def backward_ready(self, stage: int, time: int) -> bool:
        """Whether ``stage``'s next backward has its forward done and the next stage's gradient by ``time``."""
        mb, following = self.next_backward[stage], self.next_stage.get(stage)
        if mb >= self.num_microbatches or not self._done_by(self.forward_end, stage, mb, time):
            return False
        return following is None or self._done_by(self.backward_end, following, mb, time)

    @staticmethod
    def _done_by(ends: list[list[Optional[int]]], stage: int, mb: int, time: int) -> bool:
        return ends[stage][mb] is not None and ends[stage][mb] <= time

    def _record(self, pp_rank: int, action: Action, time: int) -> None:
        """Place ``action`` on ``pp_rank`` from ``time``: its order, its rank's next free time, the end tables."""
        end = time + self.durations[action.kind]
        self.free_at[pp_rank] = end
        self.orders[pp_rank].append(action)
        if action.kind == FORWARD:
            self.forward_end[action.stage][action.microbatch] = end
            self.next_forward[action.stage] += 1
        elif action.kind in (BACKWARD, BACKWARD_INPUT):
            self.backward_end[action.stage][action.microbatch] = end
            self.next_backward[action.stage] += 1
        self.after(pp_rank, action)
