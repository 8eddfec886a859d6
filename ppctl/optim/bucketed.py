"""Gradients and fp32 main parameters in flat bucketed buffers, sharded (ZeRO-1) or not.

``BucketedOptimizer(sharded=True)`` is the distributed optimizer (ZeRO-1, as
Megatron-Core's): gradients and optimizer state sharded over the replicas.
``sharded=False`` keeps the same buffers but all-reduces every bucket and steps every
parameter on every rank: the plain path of a half-precision model, which needs fp32 main
parameters and gradients (Megatron's mixed-precision optimizer without sharding).

Layout. Every parameter of a rank's chunks gets a slot in two flat buffers of one
layout: ``grad_data`` (fp32 main gradients) and ``param_data`` (the parameters
themselves: each ``param.data`` becomes a view into it). Parameters are laid out in
roughly the order the backward finishes them (last stage first, last layer first) and
grouped into buckets of about ``bucket_size`` elements, each padded to split evenly over
the D ranks of its reduction group: the ``replica`` group (``dp_cp``, and with DualPipe's two
parameter copies the mirror pp rank too: the same parameters, other microbatches), or for the
experts of an expert-parallel run the ``expert_replica`` group (the ranks holding the same
experts); a bucket holds parameters of one group only. Rank i owns the i-th of the D equal
shards of every bucket (unsharded: D is 1, every rank owns all).

A step.
1. Each parameter's gradient is added into its fp32 slot as autograd accumulates it
   (a post-accumulate hook), then dropped. When a parameter has received all of this
   step's microbatches it is final; when a bucket's parameters are all final, the
   bucket is reduce-scattered (unsharded: all-reduced) over the replicas in place,
   asynchronously, while the backward goes on (``overlap_grad_reduce``; otherwise all
   buckets after the last backward). Buckets are launched in index order, the same on every rank.
2. The copies of a tied word embedding are summed first (the last bucket holds them and
   is reduced only after that sum: summing after the reduce-scatter would add shards of
   different elements, since the first and last stage have different buffers).
3. Each rank then holds the fully reduced gradient of its shards only. fp32 main
   parameters of those shards (pieces of parameters) are stepped by ``torch.optim.AdamW``
   (fused); the norm, clipping and fp16 unscaling use the same shards, each element
   counted once.
4. The updated shards are written into ``param_data`` and, sharded, every bucket is
   all-gathered in place (``overlap_param_gather``: in the background, each bucket
   waited for by a forward pre-hook of the modules that own its parameters).
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field
from typing import Mapping

import torch
import torch.distributed as dist

from ppctl.optim.grads import (AdamWStateful, StateTensors, adam_state, adamw, all_reduce_coalesced,
                              optimizer_state_bytes, reduction_group_name, stage_expert_squares, sum_of_squares,
                              tied_output_copy, tp_replicated, tp_summed)
from ppctl.parallel.tensor_parallel import all_gather_single, reduce_scatter_single

# The context groups a bucket's gradients reduce over (``grads.reduction_group_name`` picks a parameter's): dense
# parameters over the replicas, an expert-parallel run's experts over the ranks holding the same experts.
REDUCTION_GROUPS = ("replica", "expert_replica")


def weakly_bound(method):
    """``method`` called through a weak reference to its object: a no-op once the object is gone.

    A gradient hook lives in autograd's C++ graph node, where Python's garbage collector
    cannot see it: a hook holding the optimizer strongly would make the cycle optimizer ->
    parameters -> hook -> optimizer uncollectable, and every optimizer ever built in a
    process would live on with its buffers and its replica group (three gloo threads each).
    """
    reference = weakref.WeakMethod(method)

    def call_if_alive(*args):
        bound = reference()
        if bound is not None:
            bound(*args)
    return call_if_alive


@dataclass
class Slot:
    """Where one parameter lives in the flat buffers: elements ``[start, end)``, in bucket ``bucket``."""

    name: str
    param: torch.nn.Parameter
    start: int
    end: int
    bucket: int
    sequence_parallel: bool  # acts on this TP rank's tokens only (a TP-replicated parameter under SP)
    microbatches_seen: int = 0


@dataclass(frozen=True)
class ReductionGroup:
    """The ranks a bucket's gradients are summed over: ``group`` (None: this rank alone), and this rank's shard of
    each bucket, ``shard_rank`` of ``num_shards`` (1 unsharded)."""

    group: object | None
    num_shards: int
    shard_rank: int


@dataclass
class Bucket:
    """Buffer elements ``[start, end)`` (padded to a multiple of its group's shards), the parameters in it, and the
    group that reduces them (``ReductionGroup``)."""

    index: int
    start: int
    end: int
    slots: list[Slot]
    reduction: ReductionGroup = ReductionGroup(None, 1, 0)
    pending: int = 0                 # parameters still waiting for a microbatch's gradient this step
    grad_work: object | None = None  # the reduce-scatter in flight
    param_work: object | None = None  # the all-gather in flight
    launched: bool = False

    def shard(self, shard_rank: int | None = None, num_shards: int | None = None) -> tuple[int, int]:
        """The buffer range this bucket's shard ``shard_rank`` of ``num_shards`` covers (default: this rank's)."""
        if shard_rank is None:
            shard_rank, num_shards = self.reduction.shard_rank, self.reduction.num_shards
        size = (self.end - self.start) // num_shards
        return self.start + shard_rank * size, self.start + (shard_rank + 1) * size


@dataclass
class Piece:
    """The part of one parameter that falls in this rank's shard: buffer ``[start, end)``, its fp32 main copy."""

    slot: Slot
    start: int
    end: int
    main: torch.Tensor = field(repr=False)


def ordered_parameters(chunks: Mapping[int, torch.nn.Module], context) -> list[tuple[str, torch.nn.Parameter, bool]]:
    """``(name, param, sequence_parallel)`` of every chunk, last chunk and last parameter first.

    ``chunks`` come in model-stage order (the trainer builds them so): reversed, that is
    about the order in which the backward finishes them, and it is the same on every
    rank of the ``replica`` group, DualPipe's mirror ranks included (they hold the same
    model stages as two different global stages). ``sequence_parallel``: the parameter's
    gradient is this TP rank's share, summed over TP (``grads.tp_summed``: its tokens under SP,
    or its heads for a q/k norm).
    """
    ordered, seen = [], set()
    for stage in reversed(list(chunks)):
        chunk = chunks[stage]
        for name, param in reversed(list(chunk.named_parameters())):
            if id(param) not in seen:
                seen.add(id(param))
                ordered.append((name, param, tp_summed(param, chunk, context)))
    return ordered


def tied_copies(chunks: Mapping[int, torch.nn.Module], context) -> list[torch.nn.Parameter]:
    """The copies of a tied word embedding on this rank whose gradients must be summed with other copies."""
    copies = [chunk.embedding_weight_for_tying() for chunk in chunks.values()]
    copies = [param for param in copies if param is not None]
    return copies if len(copies) > 1 or context.size("embedding") > 1 else []


def plan_buckets(sizes: list[int], late: list[bool], bucket_size: int, num_shards: int | Mapping[str, int],
                 kinds: list[str] | None = None) -> list[tuple[int, int, list[int]]]:
    """Group parameters (in order) into buckets: ``(start, end, parameter indices)``, each padded to ``num_shards``
    (with ``kinds``, each parameter's reduction group: a bucket holds one kind, padded to ``num_shards[kind]``).

    A bucket closes once it holds ``bucket_size`` elements, or before a parameter of another kind; the ``late``
    parameters (tied embedding copies) form the last bucket on their own.
    """
    kinds = kinds or [""] * len(sizes)
    shards = num_shards if isinstance(num_shards, Mapping) else {kind: num_shards for kind in kinds}
    groups, current, current_size = [], [], 0
    for index, size in enumerate(sizes):
        if late[index]:
            continue
        if current and kinds[current[-1]] != kinds[index]:
            groups.append(current)
            current, current_size = [], 0
        current.append(index)
        current_size += size
        if current_size >= bucket_size:
            groups.append(current)
            current, current_size = [], 0
    groups += [group for group in (current, [i for i, is_late in enumerate(late) if is_late]) if group]
    buckets, start = [], 0
    for group in groups:
        used, group_shards = sum(sizes[index] for index in group), shards[kinds[group[0]]]
        end = start + math.ceil(used / group_shards) * group_shards
        buckets.append((start, end, group))
        start = end
    return buckets


class BucketedOptimizer(AdamWStateful):
    """fp32 main gradients, fp32 main parameters and AdamW state of this rank's chunks, in bucketed flat buffers.

    ``sharded``: each rank keeps the gradients, main parameters and AdamW state of its
    shard of every bucket only (buckets reduce-scattered, then all-gathered after the
    step: the distributed optimizer); else every bucket is all-reduced and every
    parameter stepped on every rank.
    """

    def __init__(self, chunks: Mapping[int, torch.nn.Module], context, settings, num_microbatches: int, *,
                 sharded: bool, decays=None):
        self.chunks, self.context, self.settings = chunks, context, settings
        self.num_microbatches = num_microbatches
        self.sharded = sharded
        self.reductions = {name: self._reduction_group(name) for name in REDUCTION_GROUPS}
        # DualPipe's second parameter copy: its elements are the first copy's, counted once in the norm.
        copy_of = context.layout.placement.copy_of
        self.second_copy = {id(param) for stage, chunk in chunks.items() if copy_of(stage)
                            for param in chunk.parameters()}
        self.tied = tied_copies(chunks, context)
        self.tied_outputs = [copy for copy in map(tied_output_copy, chunks.values()) if any(copy is t for t in self.tied)]
        self._build_buffers(ordered_parameters(chunks, context))
        self.pieces = self._shard_pieces()
        self.optimizer = self._build_adamw(decays or (lambda name, param: param.dim() >= 2))
        accumulate = weakly_bound(self._accumulate)
        self._hooks = [slot.param.register_post_accumulate_grad_hook(accumulate) for slot in self.slots]
        self._hooks += self._register_gather_waits()
        self.next_launch = 0
        self.zero_grad()

    # --- layout ---------------------------------------------------------------------------

    def _reduction_group(self, name: str) -> ReductionGroup:
        """The ``ReductionGroup`` of the context's group ``name`` (``replica`` or ``expert_replica``)."""
        if name not in self.context.group_ranks or self.context.size(name) <= 1:
            return ReductionGroup(None, 1, 0)
        group = self.context.groups[name]
        return ReductionGroup(group, self.context.size(name), self.context.index(name)) if self.sharded else \
            ReductionGroup(group, 1, 0)

    def _build_buffers(self, named: list[tuple[str, torch.nn.Parameter, bool]]) -> None:
        """Lay the parameters out in buckets; move every parameter into ``param_data``."""
        tied_ids = {id(param) for param in self.tied}
        kinds = [reduction_group_name(param, self.context) for _, param, _ in named]
        plan = plan_buckets([param.numel() for _, param, _ in named], [id(param) in tied_ids for _, param, _ in named],
                            self.settings.bucket_size,
                            {kind: reduction.num_shards for kind, reduction in self.reductions.items()}, kinds)
        total = plan[-1][1] if plan else 0
        device, dtype = named[0][1].device, named[0][1].dtype
        self.grad_data = torch.zeros(total, dtype=torch.float32 if dtype != torch.float64 else dtype, device=device)
        self.param_data = torch.zeros(total, dtype=dtype, device=device)
        self.slots, self.buckets, self.slot_of = [], [], {}
        for index, (start, end, members) in enumerate(plan):
            bucket = Bucket(index, start, end, [], self.reductions[kinds[members[0]]])
            offset = start
            for member in members:
                name, param, sequence_parallel = named[member]
                slot = Slot(name, param, offset, offset + param.numel(), index, sequence_parallel)
                self.param_data[slot.start:slot.end].copy_(param.detach().reshape(-1))
                param.data = self.param_data[slot.start:slot.end].view_as(param)
                bucket.slots.append(slot)
                self.slots.append(slot)
                self.slot_of[param] = slot
                offset = slot.end
            self.buckets.append(bucket)

    def _shard_pieces(self) -> list[Piece]:
        """This rank's shard of every bucket, cut at parameter boundaries, each with an fp32 main copy."""
        pieces = []
        for bucket in self.buckets:
            shard_start, shard_end = bucket.shard()
            for slot in bucket.slots:
                start, end = max(slot.start, shard_start), min(slot.end, shard_end)
                if start < end:
                    main = self.param_data[start:end].detach().clone().to(self.grad_data.dtype)
                    main.grad = self.grad_data[start:end]
                    pieces.append(Piece(slot, start, end, main))
        return pieces

    def _build_adamw(self, decays) -> torch.optim.Optimizer:
        settings = self.settings
        decay = [piece.main for piece in self.pieces if decays(piece.slot.name, piece.slot.param)]
        no_decay = [piece.main for piece in self.pieces if not decays(piece.slot.name, piece.slot.param)]
        return adamw(decay, no_decay, settings)

    @property
    def param_groups(self) -> list[dict]:
        """The AdamW parameter groups (their ``lr`` is what a step uses)."""
        return self.optimizer.param_groups

    # --- gradients --------------------------------------------------------------------------

    def zero_grad(self) -> None:
        """Start a step: empty main gradients, every parameter waiting for all its microbatches."""
        self.grad_data.zero_()
        for slot in self.slots:
            slot.microbatches_seen = 0
        for bucket in self.buckets:
            bucket.pending, bucket.launched, bucket.grad_work = len(bucket.slots), False, None
        self.next_launch = 0

    def _accumulate(self, param: torch.nn.Parameter) -> None:
        """Post-accumulate hook: add the gradient into its fp32 slot; launch the buckets that became complete."""
        slot = self.slot_of[param]
        self.grad_data[slot.start:slot.end].add_(param.grad.reshape(-1))
        param.grad = None
        slot.microbatches_seen += 1
        if slot.microbatches_seen == self.num_microbatches:
            self.buckets[slot.bucket].pending -= 1
            if self.settings.overlap_grad_reduce:
                self._launch_ready_buckets(include_late=False)

    def _launch_ready_buckets(self, include_late: bool) -> None:
        """Reduce-scatter complete buckets in index order (the same order on every rank of ``replica``)."""
        while self.next_launch < len(self.buckets):
            bucket = self.buckets[self.next_launch]
            is_late = bool(self.tied) and bucket.index == len(self.buckets) - 1
            if not include_late and (bucket.pending or is_late):
                return
            self._reduce_scatter(bucket)
            self.next_launch += 1

    def _reduce_scatter(self, bucket: Bucket) -> None:
        """Sum the bucket over its replicas in the background: into this rank's shard, or all of it unsharded."""
        data, group = self.grad_data[bucket.start:bucket.end], bucket.reduction.group
        if group is not None and self.sharded:
            start, end = bucket.shard()
            bucket.grad_work = reduce_scatter_single(self.grad_data[start:end], data, group=group, async_op=True)
        elif group is not None:
            bucket.grad_work = dist.all_reduce(data, group=group, async_op=True)
        bucket.launched = True

    def finish_grad_sync(self) -> None:
        """After the last backward: sum tied copies, reduce what is left, wait, then SP's TP sums on the shards."""
        self._sum_tied_copies()
        self._launch_ready_buckets(include_late=True)
        for bucket in self.buckets:
            if bucket.grad_work is not None:
                bucket.grad_work.wait()
                bucket.grad_work = None
        self._sum_sequence_parallel_shards()

    def _sum_tied_copies(self) -> None:
        """Give every copy of a tied embedding the sum of all copies' (not yet DP-reduced) gradients."""
        if not self.tied:
            return
        grads = [self.grad_data[self.slot_of[p].start:self.slot_of[p].end] for p in self.tied]
        if len(grads) > 1:
            total = torch.stack(grads).sum(dim=0)
            for grad in grads:
                grad.copy_(total)
        if self.context.size("embedding") > 1:
            dist.all_reduce(grads[0], group=self.context.groups["embedding"])
            for grad in grads[1:]:
                grad.copy_(grads[0])

    def _sum_sequence_parallel_shards(self) -> None:
        """Sum over TP the shard gradients of TP-replicated parameters whose ranks hold shares (``tp_summed``: under
        SP, and a q/k norm's; same layout on every TP rank)."""
        grads = [piece.main.grad for piece in self.pieces if piece.slot.sequence_parallel]
        if grads and self.context.size("tp") > 1:
            all_reduce_coalesced(grads, self.context.groups["tp"])

    def grad_norm(self) -> float:
        """The global L2 gradient norm from the shards: each element of the model counted once over all ranks."""
        squares = self.local_grad_squares().reshape(1)
        self.sum_grad_squares(squares)
        return math.sqrt(float(squares.item()))

    def local_grad_squares(self) -> torch.Tensor:
        """The sum of squares of this rank's share of the gradient (float64 scalar; unsharded with expert
        parallelism, the experts' squares are first summed over the ep group, whose ranks hold different ones)."""
        counted = [piece for piece in self.pieces if self._counted(piece.slot)]
        dense, experts = (sum_of_squares([piece.main.grad for piece in counted
                                          if reduction_group_name(piece.slot.param, self.context) == name],
                                         self.grad_data.device) for name in REDUCTION_GROUPS)
        if not self.sharded and self.context.layout.ep > 1:
            experts = stage_expert_squares(experts, self.context)
        return dense + experts.reshape(())

    def sum_grad_squares(self, squares: torch.Tensor) -> None:
        """Sum ``local_grad_squares`` values (any shape, float64) over the ranks that share the model, in place."""
        if self.sharded:
            dist.all_reduce(squares)  # the shards partition the whole model over all ranks
        elif self.context.size("tp_pp") > 1:
            dist.all_reduce(squares, group=self.context.groups["tp_pp"])  # every dp_cp replica holds the rest

    def _counted(self, slot: Slot) -> bool:
        if tp_replicated(slot.param, self.context) and self.context.coords["tp"] != 0:
            return False
        if not self.sharded and id(slot.param) in self.second_copy:
            return False  # sharded, the replica group's shards cover each element of both copies once
        # The tied output weight on the last stage is a copy of the first stage's word embedding.
        return not any(slot.param is copy for copy in self.tied_outputs)

    def scale_gradients(self, factor: float) -> None:
        """Multiply the shard gradients by ``factor`` (clipping, fp16 unscaling)."""
        if factor != 1.0:
            for piece in self.pieces:
                piece.main.grad.mul_(factor)

    # --- parameters ------------------------------------------------------------------------

    def step(self) -> None:
        """AdamW on the fp32 shards, written back into ``param_data``, then every bucket all-gathered."""
        self.optimizer.step()
        for piece in self.pieces:
            self.param_data[piece.start:piece.end].copy_(piece.main)
        for bucket in self.buckets:
            start, end = bucket.shard()
            if bucket.reduction.group is not None and self.sharded:
                bucket.param_work = all_gather_single(self.param_data[bucket.start:bucket.end],
                                                      self.param_data[start:end], group=bucket.reduction.group,
                                                      async_op=True)
        if not self.settings.overlap_param_gather:
            self.sync_parameters()

    def sync_parameters(self) -> None:
        """Wait for every parameter all-gather in flight (before reading parameters outside a forward)."""
        for bucket in self.buckets:
            self._wait_param_gather(bucket)

    def _wait_param_gather(self, bucket: Bucket) -> None:
        if bucket.param_work is not None:
            bucket.param_work.wait()
            bucket.param_work = None

    def _register_gather_waits(self) -> list:
        """A forward pre-hook on each module owning parameters: wait for their buckets' all-gathers."""
        handles = []
        for chunk in self.chunks.values():
            for module in chunk.modules():
                buckets = sorted({self.slot_of[param].bucket for param in module.parameters(recurse=False)})
                if buckets:
                    handles.append(module.register_forward_pre_hook(self._waiter(buckets)))
        return handles

    def _waiter(self, bucket_indices: list[int]):
        def wait_for_parameters(_module, _inputs):
            for index in bucket_indices:
                self._wait_param_gather(self.buckets[index])
        return wait_for_parameters

    # --- inspection ------------------------------------------------------------------------

    def describe(self) -> str:
        """One phrase for the run's banner: sharding, buckets, overlap."""
        buckets = f"{len(self.buckets)} bucket{'s' if len(self.buckets) != 1 else ''}"
        if not self.sharded:
            return f"optimizer: AdamW on fp32 main copies, {buckets} all-reduced"
        overlap = [name for name, on in (("gradient reduce-scatter", self.settings.overlap_grad_reduce),
                                         ("parameter all-gather", self.settings.overlap_param_gather)) if on]
        copies = self.context.layout.placement.copies
        over = "dp*cp ranks" if copies == 1 else f"ranks (dp*cp x {copies} parameter copies)"
        if self.context.layout.ep > 1:
            over += f", experts over {self.reductions['expert_replica'].num_shards} edp ranks"
        return (f"optimizer: distributed over {self.reductions['replica'].num_shards} {over}, {buckets}"
                + (f", overlapped {' and '.join(overlap)}" if overlap else ""))

    def full_gradients(self) -> dict[str, torch.Tensor]:
        """Every parameter's reduced gradient, gathered from the shards (for tests and debugging; collective)."""
        full = self.grad_data.clone()
        for bucket in self.buckets:
            if bucket.reduction.group is not None and self.sharded:
                start, end = bucket.shard()
                all_gather_single(full[bucket.start:bucket.end], full[start:end].clone(), group=bucket.reduction.group)
        return {slot.name: full[slot.start:slot.end].view_as(slot.param).to(slot.param.dtype) for slot in self.slots}

    def state_bytes(self) -> int:
        """Bytes of fp32 main parameters (the shard pieces AdamW steps) and AdamW state this rank holds."""
        return optimizer_state_bytes(self.optimizer)

    # --- checkpoints -----------------------------------------------------------------------

    def state_tensors(self, create: bool = False) -> list[StateTensors]:
        """This rank's shard pieces: AdamW moments, and the fp32 main parameter when it is not the parameter
        (half precision); ``create``: zero moments where there are none yet."""
        found = []
        for piece in self.pieces:
            state = adam_state(self.optimizer, piece.main, create)
            if not state:
                continue
            tensors = {"exp_avg": state["exp_avg"], "exp_avg_sq": state["exp_avg_sq"]}
            if piece.main.dtype != self.param_data.dtype:
                tensors["main"] = piece.main
            found.append(StateTensors(piece.slot.name, tuple(piece.slot.param.shape), piece.start - piece.slot.start,
                                      tensors))
        return found

    def after_load(self) -> None:
        """After the parameters were loaded into ``param_data``: same-precision main copies follow them."""
        for piece in self.pieces:
            if piece.main.dtype == self.param_data.dtype:
                piece.main.detach().copy_(self.param_data[piece.start:piece.end])
