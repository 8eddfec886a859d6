"""A replay of a ``StepGraph`` whose ranks share fewer cores than they are: processor sharing.

The simulator gives every rank a device of its own. On a CPU machine with more single-threaded
workers than cores (four gloo workers on two cores), a rank that the schedule lets compute
waits for a core whenever more ranks compute at once than there are cores. This replay keeps
the step graph's order and dependencies (a step starts once the step before it on its rank has
ended and its input has arrived, ``comm`` after its maker ended when it crosses ranks) and
splits each step in two:

- its **compute** (``durations``, seconds on a core of its own), during which the ``active``
  computing processes share the cores equally: each progresses at ``min(1, cores / active)``;
- its **wait** (``waits``: the collectives' and the runtime's time, on no core), which passes
  at the wall clock's pace once the compute is done.

Each pipeline rank stands for ``processes_per_rank`` processes that run alike (its TP, CP and
DP replicas), so ``active`` counts ``processes_per_rank`` for each rank computing. With
``cores`` at least all the processes, the times are the step graph's own (``StepGraph.finish_times``
with ``durations + waits``), up to rounding.

Pure: no torch, no process. The planner uses it for a device calibrated on such a machine
(``Device.cores``).
"""

from __future__ import annotations

from .replay import StepGraph

# A step's compute counts as done when less than this share of a second is left (rounding of the shared rates).
_DONE_S = 1e-12


def shared_finish_times(graph: StepGraph, durations: dict[str, float], waits: dict[str, float], comm: float,
                        cores: int, processes_per_rank: int = 1) -> list[float]:
    """Each rank's end of its last step (0.0 without one) when its steps' compute (``durations`` by kind) shares
    ``cores`` with the other ranks' (see the module docstring); ``waits`` by kind pass after it on no core."""
    replay = _SharedReplay(graph, durations, waits, comm)
    replay.run(cores, processes_per_rank)
    return [replay.ends[step] for step in graph.last]


class _SharedReplay:
    """The state of one processor-sharing replay: each rank's next step and what it is doing."""

    def __init__(self, graph: StepGraph, durations: dict[str, float], waits: dict[str, float], comm: float):
        steps = len(graph.order)
        self.producer, self.remote, self.kind = [0] * steps, [0] * steps, [""] * steps
        for step, producer, remote, kind in zip(graph.order, graph.producer, graph.remote, graph.kinds):
            self.producer[step], self.remote[step], self.kind[step] = producer, remote, kind
        self.durations, self.waits, self.comm = durations, waits, comm
        self.ends: list[float | None] = [None] * steps + [0.0]  # the last: the maker of "no input"
        self.next_step, self.stop = [], []
        first = 0
        for kinds in graph.rank_kinds:  # steps are numbered rank by rank
            self.next_step.append(first)
            first += len(kinds)
            self.stop.append(first)
        self.blocked: dict[int, int] = {}  # a step not ended yet -> the rank whose next step takes its output
        self.starts: dict[int, float] = {}  # rank -> when its next step may start (its input there)
        self.computing: dict[int, float] = {}  # rank -> compute left of its step (seconds on a core of its own)
        self.waiting: dict[int, float] = {}  # rank -> when its step's wait ends

    def run(self, cores: int, processes_per_rank: int) -> None:
        """Replay to the end: from one event (a step starts, its compute or its wait ends) to the next."""
        now = 0.0
        for rank in range(len(self.next_step)):
            self._plan_start(rank, now)
        while self.starts or self.computing or self.waiting:
            self._settle(now)
            rate = min(1.0, cores / (len(self.computing) * processes_per_rank)) if self.computing else 1.0
            step_to = min([*self.starts.values(), *self.waiting.values(),
                           *(now + left / rate for left in self.computing.values())], default=now)
            for rank in self.computing:
                self.computing[rank] -= (step_to - now) * rate
            now = step_to

    def _settle(self, now: float) -> None:
        """Start, move to its wait or end every step whose moment has come (ending one can start others)."""
        for rank in [rank for rank, left in self.computing.items() if left <= _DONE_S]:
            del self.computing[rank]
            self.waiting[rank] = now + self.waits[self.kind[self.next_step[rank]]]
        for rank in [rank for rank, until in self.waiting.items() if until <= now]:
            del self.waiting[rank]
            self._end_step(rank, now)
        for rank in [rank for rank, start in self.starts.items() if start <= now]:
            del self.starts[rank]
            self.computing[rank] = self.durations[self.kind[self.next_step[rank]]]
        if any(left <= _DONE_S for left in self.computing.values()) or \
                any(until <= now for until in self.waiting.values()):
            self._settle(now)  # a step without compute, or without a wait, moves on at once

    def _end_step(self, rank: int, now: float) -> None:
        step = self.next_step[rank]
        self.ends[step] = now
        self.next_step[rank] += 1
        self._plan_start(rank, now)
        reader = self.blocked.pop(step, None)
        if reader is not None:
            self._plan_start(reader, now)

    def _plan_start(self, rank: int, now: float) -> None:
        """When ``rank``'s next step may start, if its input's maker has ended; else wait for that maker."""
        step = self.next_step[rank]
        if step >= self.stop[rank]:
            return
        maker = self.producer[step]
        made = self.ends[maker]
        if made is None:
            self.blocked[maker] = rank
            return
        arrives = made + (self.comm if self.remote[step] else 0.0)
        self.starts[rank] = arrives if arrives > now else now
