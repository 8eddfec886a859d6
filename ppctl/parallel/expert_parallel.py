"""Expert parallelism: an MoE layer's routed rows sent to the ranks that hold their experts, and back.

An ``EPGroup`` is one rank's expert-parallel group (the layout's ``ep`` groups): ``size`` ranks of one pipeline
stage, EP rank r holding experts ``[r * E / size, (r + 1) * E / size)`` of every MoE layer. A microbatch's routed
rows arrive sorted by global expert (``ppctl.model.moe.dispatch``). ``ExpertExchange.plan`` first exchanges the row
counts per expert (one small all-to-all), then ``dispatch`` sends each rank the rows of its experts (an all-to-all
with uneven splits) and regroups what arrived, source-major, into one block per local expert (sources in rank
order within it), which the grouped experts run; ``combine`` undoes the regrouping and sends each row back to its
token's rank, in the order it left. Every exchange is an autograd function whose backward is the reverse exchange,
so the rows' gradients travel back through the same ranks, and the experts' weight gradients stay local (a
pipeline W computes them with no communication). Every rank of the group calls the exchanges in the same order:
its members are data-parallel peers running the same pipeline program.

Two communicators over the same ranks (the group's two lanes, ``ppctl.parallel.lanes``): the forward's exchanges use
``group``, the backward's (a recomputed forward inside a backward included) its backward lane's. Each one's sequence
of exchanges is then the same on every rank, so an overlapped pair (DualPipe's F&B, ``ppctl.pipeline.overlap``) can
run its forward and its backward interleaved: each exchange is posted, the other half computes, then it is waited
through the lanes' pacer.

A ``TokenSplit`` is the other group an MoE layer talks to: the ranks that hold one microbatch's tokens between
them (the TP ranks under sequence parallelism, times the CP ranks: the layout's ``tp_cp`` group), an equal share
each. The router's statistics of a microbatch (its load per expert, its token count) are summed over it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from ppctl.parallel.lanes import BACKWARD_LANE, ONE_LANE, Lanes, OnLanes, current_lane


@dataclass(frozen=True)
class TokenSplit(OnLanes):
    """The ranks that hold one microbatch's tokens between them, an equal share each (module docstring): a
    ``torch.distributed`` ProcessGroup (None for one rank), ``size`` ranks, this rank's index ``rank``; ``lanes``:
    the worker's (``ppctl.parallel.lanes``), which its collectives go through."""

    group: object | None = None
    size: int = 1
    rank: int = 0
    lanes: Lanes = field(default=ONE_LANE, compare=False, repr=False)

    def total(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` summed over the split's ranks (a new tensor, no graph; itself for one rank)."""
        if self.size == 1:
            return tensor
        summed = tensor.detach().clone()
        self.post(dist.all_reduce, summed)
        return summed


@dataclass(frozen=True)
class EPGroup:
    """The expert-parallel group of one rank: a ``torch.distributed`` ProcessGroup (None when ``size`` is 1),
    ``size`` ranks, this rank's index ``rank``; ``on_exchange(start, end, lane)``: told the ``perf_counter`` span
    of each exchange (a tracer's), or None; ``lanes``: the worker's (``ppctl.parallel.lanes``: the backward's
    exchanges on a second communicator of the same ranks, each posted exchange finished through the pacer). The ranks
    that split each microbatch's tokens are a group of their own (``TokenSplit``, held beside this one in
    ``ppctl.parallel.groups.RankGroups``)."""

    group: object | None
    size: int
    rank: int
    on_exchange: Optional[Callable[[float, float, int], None]] = field(default=None, compare=False, repr=False)
    lanes: Lanes = field(default=ONE_LANE, compare=False, repr=False)

    def __post_init__(self):
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"EPGroup: rank must be in [0, size) and size >= 1, got rank={self.rank} size={self.size}")

    @staticmethod
    def single() -> "EPGroup":
        """The trivial group (ep=1): this rank holds every expert and exchanges nothing."""
        return EPGroup(group=None, size=1, rank=0)

    def lane_group(self, lane: int):
        """The communicator of ``lane`` (``FORWARD_LANE`` or ``BACKWARD_LANE``)."""
        return self.lanes.communicator(self.group, lane)

    def local_experts(self, num_experts: int) -> range:
        """The global ids of the experts this rank holds (``num_experts`` divisible by ``size``)."""
        if num_experts % self.size:
            raise ValueError(f"{num_experts} experts do not split evenly over ep={self.size}")
        per_rank = num_experts // self.size
        return range(self.rank * per_rank, (self.rank + 1) * per_rank)


class _AllToAll(torch.autograd.Function):
    """Rows ``[sum(send), ...]`` sent in blocks of ``send[j]`` rows to rank j of ``ep``; returns the
    ``recv[j]`` rows from each rank j, in rank order. The backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx, rows, send, recv, ep):
        ctx.send, ctx.recv, ctx.ep = send, recv, ep
        return all_to_all_rows(rows, send, recv, ep, current_lane())

    @staticmethod
    def backward(ctx, grad):
        return all_to_all_rows(grad, ctx.recv, ctx.send, ctx.ep, BACKWARD_LANE), None, None, None


def all_to_all_rows(rows: torch.Tensor, send: Sequence[int], recv: Sequence[int], ep: EPGroup,
                    lane: int) -> torch.Tensor:
    """``rows``' blocks of ``send[j]`` rows to rank j of ``ep``; the ``recv[j]`` rows from each rank j (no graph),
    through ``lane``'s communicator."""
    received = rows.new_empty((sum(recv), *rows.shape[1:]))
    started = time.perf_counter()
    work = dist.all_to_all_single(received, rows.contiguous(), list(recv), list(send), group=ep.lane_group(lane),
                                  async_op=True)
    ep.lanes.finish(work)  # in an overlapped pair the other half computes while this one travels
    if ep.on_exchange is not None:
        ep.on_exchange(started, time.perf_counter(), lane)
    return received


@dataclass(frozen=True)
class ExpertExchange:
    """How one microbatch's routed rows travel (``plan``): ``send[j]`` rows to EP rank j, ``recv[j]`` from it;
    ``local_counts[l]``: the rows local expert l receives from every rank together; ``regroup``: for each row of
    the regrouped (expert-major) order, its index in the arrival (source-major) order."""

    group: EPGroup
    send: tuple[int, ...]
    recv: tuple[int, ...]
    local_counts: tuple[int, ...]
    regroup: torch.Tensor

    @staticmethod
    def plan(counts: Sequence[int], group: EPGroup, device) -> "ExpertExchange":
        """The exchange of rows sorted by global expert, ``counts[e]`` of them for expert e (every expert, in order)."""
        per_rank = len(counts) // group.size
        mine = torch.tensor(list(counts), dtype=torch.int64, device=device)
        theirs = all_to_all_rows(mine, [per_rank] * group.size, [per_rank] * group.size, group, current_lane())
        arriving = theirs.view(group.size, per_rank).cpu()  # [source, local expert]: one sync for every size
        send = tuple(sum(counts[rank * per_rank:(rank + 1) * per_rank]) for rank in range(group.size))
        recv = tuple(int(total) for total in arriving.sum(dim=1))
        return ExpertExchange(group, send, recv, tuple(int(total) for total in arriving.sum(dim=0)),
                              expert_major_order(arriving).to(device))

    def dispatch(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows sorted by global expert -> this rank's experts' rows, one block per local expert."""
        arrived = _AllToAll.apply(rows, self.send, self.recv, self.group)
        return arrived[self.regroup]

    def combine(self, expert_rows: torch.Tensor) -> torch.Tensor:
        """The experts' output rows (``dispatch``'s order) -> each row back on its token's rank, in its sent order."""
        arrival_order = torch.empty_like(self.regroup)
        arrival_order[self.regroup] = torch.arange(self.regroup.numel(), device=self.regroup.device)
        return _AllToAll.apply(expert_rows[arrival_order], self.recv, self.send, self.group)


def expert_major_order(arriving: torch.Tensor) -> torch.Tensor:
    """For rows that arrived source-major, ``arriving[s, l]`` of them from source s for local expert l: the arrival
    index of each row of the expert-major order (local expert, then source, then arrival order)."""
    sources, experts = arriving.shape
    expert_of_row = torch.arange(experts).repeat(sources).repeat_interleave(arriving.flatten())
    return torch.argsort(expert_of_row, stable=True)  # arrival order (source, then row) kept within an expert
