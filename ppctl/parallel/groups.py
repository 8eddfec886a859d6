"""Real process groups built from the pure layout, checked against it, and the bundle a model chunk receives.

``build_parallel_context`` is called once per worker after ``init_process_group``;
the returned ``ParallelContext`` (layout + this rank's groups) is passed down to
everything that communicates. There is no module-level group state. ``rank_groups_of`` makes from it the one
``RankGroups`` a chunk's layers communicate through (Megatron-Core's ``ProcessGroupCollection``): the TP, CP and EP
groups and the token split, sharing the worker's ``Lanes`` (``lanes_of``: the backward lanes, and the pacer when
overlapped pairs run interleaved), wired there and nowhere else.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field

import torch.distributed as dist

from ppctl.parallel.context_parallel import CPGroup
from ppctl.parallel.expert_parallel import EPGroup, TokenSplit
from ppctl.parallel.lanes import Lanes, Pacer
from ppctl.parallel.layout import ParallelLayout
from ppctl.parallel.tensor_parallel import TPGroup

# The backward lane's second communicator of each group an MoE layer talks to (``ppctl.parallel.lanes``), made
# with expert parallelism: "<group>_backward".
BACKWARD_LANE_GROUPS = ("ep", "tp", "cp", "tp_cp")


def backward_lane(name: str) -> str:
    """The name of group ``name``'s backward-lane communicator (``BACKWARD_LANE_GROUPS``)."""
    return f"{name}_backward"


@dataclass
class ParallelContext:
    """This rank's place in the layout and the process groups that contain it."""

    layout: ParallelLayout
    rank: int
    coords: dict[str, int]
    groups: dict[str, object] = field(repr=False)        # name -> ProcessGroup containing this rank (or None)
    group_ranks: dict[str, list[int]] = field(repr=False)  # name -> global ranks of that group ([] if none)
    mesh: object | None = field(default=None, repr=False)  # DeviceMesh over the dimensions, slowest first
    device: str = "cpu"

    def size(self, name: str) -> int:
        """Number of ranks in this rank's group ``name`` (0 when it is in none, e.g. ``embedding`` mid-pipeline)."""
        return len(self.group_ranks[name])

    def index(self, name: str) -> int:
        """This rank's position within its group ``name``."""
        return self.group_ranks[name].index(self.rank)

    @property
    def pp_rank(self) -> int:
        """Pipeline rank (0 = first stage)."""
        return self.coords["pp"]

    def pp_peer(self, pp_rank: int) -> int:
        """Global rank of the pipeline rank ``pp_rank`` in this rank's pipeline group."""
        return self.group_ranks["pp"][pp_rank]


@dataclass(frozen=True)
class RankGroups:
    """The rank groups one model chunk's layers communicate in (Megatron-Core's ``ProcessGroupCollection``).

    ``tp``: the tensor-parallel group (its sequence parallelism with it); ``cp``: the context-parallel group
    attention reaches the rest of the sequence through; ``ep``: the expert-parallel group MoE layers split their
    experts over; ``token_split``: the ranks that hold one microbatch's tokens between them (the layout's ``tp_cp``),
    over which the router's statistics are summed. Built once per worker by ``rank_groups_of``; ``single()`` for
    one process.
    """

    tp: TPGroup = TPGroup.single()
    cp: CPGroup = CPGroup.single()
    ep: EPGroup = EPGroup.single()
    token_split: TokenSplit = TokenSplit()

    @staticmethod
    def single() -> "RankGroups":
        """The groups of one process (tp = cp = ep = 1): every collective is a no-op."""
        return RankGroups()


def rank_groups_of(context: ParallelContext, *, sequence_parallel: bool = False, cp_comm: str = "allgather",
                   on_exchange=None, pacer: Pacer | None = None) -> RankGroups:
    """The ``RankGroups`` of this rank's chunks, from its layout and process groups (the one place they are made).

    ``sequence_parallel`` and ``cp_comm``: the config's ``parallel.*``; ``on_exchange(start, end, lane)``: told the
    span of each expert-parallel all-to-all (a tracer's), or None; ``pacer``: the expert-exchange overlap's
    (``ppctl.pipeline.overlap``) where overlapped pairs run interleaved, else None. Every member shares the lanes
    ``lanes_of`` wires.
    """
    lanes = lanes_of(context, pacer)
    return RankGroups(tp=_tp_group(context, sequence_parallel, lanes), cp=_cp_group(context, cp_comm, lanes),
                      ep=_ep_group(context, on_exchange, lanes), token_split=_token_split(context, lanes))


def lanes_of(context: ParallelContext, pacer: Pacer | None) -> Lanes:
    """This worker's lanes (``ppctl.parallel.lanes``): with ep > 1 the experts' exchanges have a backward lane of
    their own; with a ``pacer`` (overlapped pairs interleaved) the TP, CP and token-split groups too, and every
    collective is finished through it. Without one the rest runs in the program's order on one communicator."""
    names = BACKWARD_LANE_GROUPS if pacer is not None else ("ep",)
    backward = tuple((context.groups[name], context.groups[backward_lane(name)]) for name in names
                     if backward_lane(name) in context.groups)
    return Lanes(backward, pacer)


def _tp_group(context: ParallelContext, sequence_parallel: bool, lanes: Lanes) -> TPGroup:
    """The TP group object the model layers use."""
    if context.size("tp") == 1:
        return TPGroup.single()
    return TPGroup(context.groups["tp"], context.size("tp"), context.index("tp"), sequence_parallel, lanes)


def _cp_group(context: ParallelContext, comm: str, lanes: Lanes) -> CPGroup:
    """The CP group object attention uses, with its communication mode."""
    if context.size("cp") == 1:
        return CPGroup.single()
    return CPGroup(context.groups["cp"], context.size("cp"), context.index("cp"),
                   tuple(context.group_ranks["cp"]), comm, lanes)


def _ep_group(context: ParallelContext, on_exchange, lanes: Lanes) -> EPGroup:
    """The expert-parallel group object the MoE layers use."""
    if context.layout.ep == 1:
        return EPGroup.single()
    return EPGroup(context.groups["ep"], context.size("ep"), context.index("ep"), on_exchange, lanes)


def _token_split(context: ParallelContext, lanes: Lanes) -> TokenSplit:
    """The split of each microbatch's tokens over ``tp_cp`` (validation asks for sequence parallelism with TP and
    experts)."""
    if context.size("tp_cp") <= 1:
        return TokenSplit()
    return TokenSplit(context.groups["tp_cp"], context.size("tp_cp"), context.index("tp_cp"), lanes)


def build_parallel_context(layout: ParallelLayout, timeout_s: float, device: str = "cpu") -> ParallelContext:
    """Create every group of every kind (all ranks take part in each creation, in the same order).

    Every group gets the timeout (DeviceMesh's own sub-groups would get torch's 30-minute
    default), and the DeviceMesh over the four dimensions is assembled from these groups.
    """
    rank = dist.get_rank()
    if dist.get_world_size() != layout.world_size:
        raise RuntimeError(
            f"the job has {dist.get_world_size()} workers but the layout needs {layout.world_size}"
        )
    timeout = datetime.timedelta(seconds=timeout_s)
    groups, group_ranks = {}, {}
    for name in layout.group_names:
        group_ranks[name] = layout.group_of(name, rank)
        if name in ("replica", "expert_replica") and layout.placement.copies == 1:
            # one model copy: the replicas are dp x cp (the experts' edp); no second group
            groups[name] = groups["dp_cp" if name == "replica" else "edp"]
            continue
        groups[name] = _new_groups(layout.groups(name), rank, timeout)
    if layout.ep > 1:  # a second communicator of each group the experts talk to: the backward's (lanes.py)
        for name in BACKWARD_LANE_GROUPS:
            if name == "ep" or len(group_ranks[name]) > 1:
                group_ranks[backward_lane(name)] = group_ranks[name]
                groups[backward_lane(name)] = _new_groups(layout.groups(name), rank, timeout)
    context = ParallelContext(layout, rank, layout.coords(rank), groups, group_ranks,
                              _device_mesh(layout, groups, device), device)
    verify_group_membership(context)
    return context


def _device_mesh(layout: ParallelLayout, groups: dict, device: str):
    """A DeviceMesh named by dimension (slowest first) over the groups just built, for DTensor users."""
    import torch
    from torch.distributed.device_mesh import DeviceMesh

    slowest_first = tuple(reversed(layout.dims))
    shape = tuple(getattr(layout, dim) for dim in slowest_first)
    mesh = torch.arange(layout.world_size).reshape(shape)
    return DeviceMesh.from_group([groups[dim] for dim in slowest_first], device, mesh, mesh_dim_names=slowest_first)


def _new_groups(all_groups: list[list[int]], rank: int, timeout: datetime.timedelta):
    """Create every group of one kind (collective over the world); return the one holding ``rank``."""
    mine = None
    for ranks in all_groups:
        group = dist.new_group(ranks=ranks, timeout=timeout)
        if rank in ranks:
            mine = group
    return mine


def verify_group_membership(context: ParallelContext) -> None:
    """Raise if any real group's membership differs from what the layout says."""
    for name, group in context.groups.items():
        if group is None and not context.group_ranks[name]:
            continue  # not a member of any group of this kind
        actual = dist.get_process_group_ranks(group)
        expected = context.group_ranks[name]
        if list(actual) != list(expected):
            raise RuntimeError(f"group {name} of rank {context.rank} has ranks {actual}, layout says {expected}")


def warm_up_communicators(context: ParallelContext) -> None:
    """One collective on each of this rank's groups, in ``group_names`` order on every rank, then one batched
    exchange with each pipeline neighbour.

    NCCL creates a communicator lazily at its first use; done here, before step 0, every one
    is created in the same order everywhere, rather than by whichever operation of the first
    step comes first on each rank (two ranks creating different communicators first would
    wait for each other). Under gloo it costs a few small messages.
    """
    import torch

    done = set()
    lanes = [backward_lane(name) for name in BACKWARD_LANE_GROUPS if backward_lane(name) in context.groups]
    for name in (*context.layout.group_names, *lanes):
        group = context.groups[name]
        if group is None or id(group) in done or context.size(name) <= 1:
            continue
        done.add(id(group))
        dist.all_reduce(torch.zeros(1, device=context.device), group=group)
    neighbours = [pp_rank for pp_rank in (context.pp_rank - 1, context.pp_rank + 1) if 0 <= pp_rank < context.layout.pp]
    operations = []
    for pp_rank in neighbours:
        peer = context.pp_peer(pp_rank)
        operations += [dist.P2POp(dist.isend, torch.zeros(1, device=context.device), peer),
                       dist.P2POp(dist.irecv, torch.empty(1, device=context.device), peer)]
    if operations:
        for work in dist.batch_isend_irecv(operations):
            work.wait()
