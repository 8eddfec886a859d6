"""One rank of a real-size layout on one CPU: its memory measured in fake tensors, next to the memory model's.

``measure_rank(resolved, rank)`` joins torch's ``fake`` process group as global rank ``rank`` of the layout's
world (every collective and pipeline message completes at once, moving nothing), builds that rank's ``Trainer``
at full size under ``FakeTensorMode`` (tensors with shapes, dtypes and storages but no data: an 8B model's
chunk costs no memory), and runs its lowered program: a warm-up step (AdamW's state and the gradients come to
exist), then the measured step, both with the optimizer's step. The data are synthetic microbatches of the
configured shapes (``SyntheticData``): nothing is read or prepared.

What is measured, by the same definitions as the tests against real runs (``tests/distributed/test_memory_model``):

- ``parameters``, ``gradients``, ``optimizer``: the storages the trainer holds between steps (the parameters;
  ``param.grad`` or the bucketed optimizer's flat fp32 buffer; the fp32 main copy and AdamW's moments);
- ``activations``: the most bytes the step's operations hold at the end of any action of the program
  (``MemoryMeter``, asked by the runtime after each action) but the receive buffers posted for the next ones:
  what the schedule keeps in flight;
- ``peak``: the most bytes the step's operations hold at once, at any operation (within an action too: the
  backward's working memory, a recomputed group), on top of what is held between steps (``held``, which also
  counts the module buffers such as rotary tables).

Own accounting rather than ``torch.distributed._tools.mem_tracker.MemTracker`` (which does run on fake tensors):
MemTracker files a storage under the module phase that allocated it, where the memory model's parts follow
ownership (the bucketed optimizer's flat gradient buffer is a gradient, its fp32 main copy optimizer state), and
it does not know the program's actions, between which the schedule's kept activations are read.

Fake tensors cannot see what is not a tensor: the allocator's caching and fragmentation, kernel workspaces,
the CUDA context, NCCL's buffers (``ppctl.plan.memory``'s docstring lists what the model leaves out alike).
"""

from __future__ import annotations

import gc
import time
import weakref
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from ppctl.data.dataset import Microbatch
from ppctl.data.iterator import ALL_FIELDS, FLOAT32_FIELDS
from ppctl.model.moe.dispatch import Dispatch
from ppctl.model.moe.layer import RoutingPlans, moe_mlps
from ppctl.parallel.expert_parallel import EPGroup, ExpertExchange
from ppctl.parallel.groups import ParallelContext, build_parallel_context
from ppctl.pipeline.p2p import PipelineTransport
from ppctl.plan.memory import MemoryParts, config_kept_peaks, config_memory
from ppctl.resolve.resolved import ResolvedConfig
from ppctl.run.memory import StoragePeak, reachable_tensors, storage_bytes, storage_key

# What ``.item()`` of a fake tensor reads: it has no value, and every decision a step takes on one (a finite
# gradient norm, a loss count) then follows the path of a healthy step.
FAKE_SCALAR = 1


class MemoryMeter(StoragePeak):
    """Live bytes of the storages operations create while counting, their peak, and their peak at the ends of
    actions (``at_action_end``); also answers ``.item()`` of a fake tensor with ``FAKE_SCALAR``.

    Storages are told apart by their storage object (``storage_key``), fake or real; those of ``ignore``'s
    tensors (what the trainer holds before the measured step) are never counted.
    """

    def __init__(self):
        super().__init__()
        self.counting = False
        self.ignored: set[int] = set()
        self.peak_at_action_end = 0

    def start(self, ignore: list[torch.Tensor]) -> None:
        """Count from now on, leaving the storages of ``ignore`` out while they live (a storage freed during the
        step may lend its key to a new one, which is counted)."""
        self.counted, self.ignored = set(), set()
        for tensor in ignore:
            storage = tensor.untyped_storage()
            if storage_key(storage) not in self.ignored:
                self.ignored.add(storage_key(storage))
                weakref.finalize(storage, self.ignored.discard, storage_key(storage))
        self.counting, self.live_bytes, self.peak_bytes, self.peak_at_action_end = True, 0, 0, 0

    def stop(self) -> None:
        """Stop counting (what is counted stays)."""
        self.counting = False

    def at_action_end(self, messages: int = 0) -> int:
        """Told after each action of the program: note the live bytes but ``messages``, the receive buffers posted
        for the next actions (the memory model counts them apart, with its buffers)."""
        held = self.live_bytes - messages
        self.peak_at_action_end = max(self.peak_at_action_end, held)
        return held

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default:
            return fake_scalar(args[0].dtype)
        if func is torch.ops.aten.bincount.default and isinstance(args[0], FakeTensor):
            result = fake_bincount(*args, **kwargs)
        else:
            result = func(*args, **kwargs)
        if self.counting:
            self.count_outputs(result)
        return result

    def left_out(self, key: int) -> bool:
        """The storages the trainer held before the measured step are not the step's."""
        return key in self.ignored


def fake_bincount(values: torch.Tensor, weights: torch.Tensor | None = None, minlength: int = 0) -> torch.Tensor:
    """A fake ``bincount`` of values below ``minlength`` (a router's load over its experts): its length is known
    without the values, which fake tensors lack (the routing statistics' numbers are then ``FAKE_SCALAR``)."""
    dtype = torch.int64 if weights is None else weights.dtype
    return torch.zeros(minlength, dtype=dtype, device=values.device)


def fake_scalar(dtype: torch.dtype) -> bool | int | float:
    """``FAKE_SCALAR`` as the Python number ``.item()`` of a tensor of ``dtype`` returns."""
    if dtype == torch.bool:
        return bool(FAKE_SCALAR)
    return float(FAKE_SCALAR) if dtype.is_floating_point else int(FAKE_SCALAR)


class InstantSends(PipelineTransport):
    """The pipeline transport of a fake rank: a send is done once posted. The fake process group's works never
    say they completed, so the plain transport would keep every payload of the step until its end, where a real
    peer takes each message within the next actions."""

    def _drop_completed_sends(self) -> None:
        self.pending_sends = []

    @staticmethod
    def replacing(transport: PipelineTransport) -> "InstantSends":
        """The ``InstantSends`` of the same peers, message shapes, device and timeout as ``transport``."""
        return InstantSends(transport.peer_rank, transport.receive_spec, transport.device, transport.timeout_s)


class BalancedPlans(RoutingPlans):
    """A fake rank's routing plans (``ppctl.model.moe.layer.RoutingPlans``): fake tensors hold no routing, so every
    expert gets an equal share of the microbatch's assignments (at most its capacity) and every EP rank routes the
    same counts: each rank sends and receives the same rows, the mean the memory model predicts for an EP rank."""

    @staticmethod
    def dispatch(experts: torch.Tensor, weights: torch.Tensor, num_experts: int, capacity: int | None,
                 drop_policy: str) -> Dispatch:
        """The shapes ``plan_dispatch`` gives balanced routing: the kept assignments in order, equal counts."""
        assignments = experts.numel()
        counts = tuple(min(share, capacity if capacity is not None else share)
                       for share in balanced_shares(assignments, num_experts))
        device = experts.device
        return Dispatch(order=torch.arange(sum(counts), device=device), counts=counts,
                        kept=torch.ones(assignments, dtype=torch.bool, device=device),
                        source=torch.arange(assignments, device=device))

    @staticmethod
    def exchange(counts: tuple[int, ...], group: EPGroup, device) -> ExpertExchange:
        """The exchange ``ExpertExchange.plan`` gives when every EP rank routes ``counts``: to each rank the rows of
        its experts, from each rank the rows of this rank's (arriving source-major: the regrouping is a gather of
        them all)."""
        per_rank = len(counts) // group.size
        send = tuple(sum(counts[rank * per_rank:(rank + 1) * per_rank]) for rank in range(group.size))
        mine = counts[group.rank * per_rank:(group.rank + 1) * per_rank]
        recv = (sum(mine),) * group.size
        return ExpertExchange(group, send, recv, tuple(group.size * rows for rows in mine),
                              torch.arange(sum(recv), device=device))


def balanced_shares(total: int, parts: int) -> list[int]:
    """``total`` split into ``parts`` shares as equal as can be (the first ones one larger)."""
    return [total // parts + (1 if part < total % parts else 0) for part in range(parts)]


class SyntheticData:
    """Microbatches of the configured shapes for one rank (the ``PipelineDataIterator`` a trainer reads): zeros for
    ids, ones for the loss mask, the fields its stages read; the loss-token count is the global batch's tokens."""

    def __init__(self, config, context: ParallelContext, fields: tuple[str, ...]):
        trainer, layout = config.trainer, context.layout
        self.num_microbatches = trainer.global_batch_size // trainer.micro_batch_size // layout.dp
        self.fields = fields
        self.shape = (trainer.micro_batch_size, trainer.seq_length // layout.cp)
        self.loss_tokens = float(trainer.global_batch_size * trainer.seq_length)

    def microbatches(self, step: int) -> list[Microbatch]:
        """This rank's microbatches (the same every step)."""
        return [Microbatch(**{name: self._field(name) for name in ALL_FIELDS}) for _ in range(self.num_microbatches)]

    def _field(self, name: str) -> torch.Tensor | None:
        if name not in self.fields:
            return None
        if name in FLOAT32_FIELDS:
            return torch.ones(self.shape, dtype=torch.float32)
        return torch.zeros(self.shape, dtype=torch.int64)

    def global_loss_tokens(self, step: int, microbatches: list[Microbatch], replicas=None) -> float:
        """The global batch's trained tokens: every one (the mask is all ones)."""
        return self.loss_tokens


@dataclass(frozen=True)
class MeasuredMemory:
    """Bytes one rank measured in fake tensors (the module docstring says what each is)."""

    parameters: int
    gradients: int
    optimizer: int
    held: int
    activations: int
    peak: int

    @property
    def total(self) -> int:
        """The rank's peak: what it holds between steps and the most the step held on top."""
        return self.held + self.peak

    def to_json(self) -> dict:
        """The parts and ``total``, in bytes."""
        return {"parameters": self.parameters, "gradients": self.gradients, "optimizer": self.optimizer,
                "held": self.held, "activations": self.activations, "peak": self.peak, "total": self.total}


@dataclass(frozen=True)
class RankCheck:
    """One rank's measurement next to the memory model's prediction for its pp rank."""

    rank: int
    coords: dict
    measured: MeasuredMemory
    predicted: MemoryParts
    seconds: float
    # of the predicted activations, what a backward holds beyond the kept peak while it rebuilds a recomputed group
    rebuilt: int = 0

    def differences(self) -> dict[str, float]:
        """Predicted over measured, minus 1, per compared part: the held parts, the activations the schedule keeps
        (at the ends of actions: the predicted ones but what a recomputing backward rebuilds within its action), the
        step's peak on top of the held parts (activations and buffers) and the total."""
        measured, predicted = self.measured, self.predicted
        pairs = {"parameters": (predicted.parameters, measured.parameters),
                 "gradients": (predicted.gradients, measured.gradients),
                 "optimizer": (predicted.optimizer, measured.optimizer),
                 "activations": (predicted.activations - self.rebuilt, measured.activations),
                 "step peak": (predicted.activations + predicted.buffers, measured.peak),
                 "total": (predicted.total, measured.total)}
        return {part: relative_difference(model, seen) for part, (model, seen) in pairs.items()}

    def worst(self) -> tuple[str, float]:
        """The part whose prediction is furthest from the measurement, and that difference."""
        return max(self.differences().items(), key=lambda item: abs(item[1]))

    def to_json(self) -> dict:
        """``rank``, ``coords``, ``measured``, ``predicted``, ``difference`` (per part) and ``seconds``."""
        return {"rank": self.rank, "coords": self.coords, "measured": self.measured.to_json(),
                "predicted": {**self.predicted.to_json(), "rebuilt": self.rebuilt}, "difference": self.differences(),
                "seconds": self.seconds}


def relative_difference(predicted: int, measured: int) -> float:
    """``predicted / measured - 1`` (0 when both are 0)."""
    if measured == 0:
        return 0.0 if predicted == 0 else float("inf")
    return predicted / measured - 1


def join_fake_group(rank: int, world_size: int) -> None:
    """This process as global rank ``rank`` of ``world_size`` in torch's fake process group (leaving a fake group
    it joined before: one rank at a time)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        if dist.get_backend() != "fake":
            raise RuntimeError("a real process group is initialised in this process: fake ranks need their own")
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)


def measure_rank(resolved: ResolvedConfig, rank: int, fake: bool = True) -> RankCheck:
    """Global rank ``rank`` of the resolved layout, built at full size in fake tensors: a warm-up step, then the
    measured one (the module docstring), next to ``config_memory``'s prediction for its pp rank. ``fake=False``:
    real tensors, the same way (a tiny model's check that fake tensors hold what real ones do; messages from the
    fake group's peers are left uninitialised, which changes no byte)."""
    from ppctl.run.train import Trainer

    started = time.perf_counter()
    layout = resolved.layout
    join_fake_group(rank, layout.world_size)
    context = build_parallel_context(layout, resolved.config.launcher.timeout_s)
    meter = MemoryMeter()
    with FakeTensorMode(allow_non_fake_inputs=True) if fake else nullcontext(), meter:
        # the runtime asks after each action, once ``trainer`` exists
        trainer = Trainer(resolved, context, data_of=SyntheticData,
                          track_memory=lambda: meter.at_action_end(posted_receive_bytes(trainer.runtime.transport)))
        trainer.runtime.transport = InstantSends.replacing(trainer.runtime.transport)
        for chunk in trainer.chunks.values():
            for mlp in moe_mlps(chunk).values():
                mlp.plans = BalancedPlans()
        trainer.train_steps(0, 1)
        gc.collect()  # the warm-up step's garbage (autograd graphs in reference cycles) is not the next step's
        measured = held_parts(trainer)
        meter.start(reachable_tensors(trainer))
        trainer.train_steps(1, 1)
        meter.stop()
    measured = MeasuredMemory(**measured, activations=meter.peak_at_action_end, peak=meter.peak_bytes)
    predicted = config_memory(resolved)[context.pp_rank]
    rebuilt = predicted.activations - config_kept_peaks(resolved)[context.pp_rank]
    dist.destroy_process_group()
    coords = {**context.coords, **({"ep": layout.expert_coords(rank)["ep"]} if layout.ep > 1 else {})}
    return RankCheck(rank, coords, measured, predicted, time.perf_counter() - started, rebuilt)


def posted_receive_bytes(transport: PipelineTransport) -> int:
    """Bytes of the receive buffers ``transport`` has posted and not handed out yet."""
    return sum(buffer.untyped_storage().nbytes() for _, buffer in transport.pending_receives.values())


def held_parts(trainer) -> dict[str, int]:
    """What ``trainer`` holds between steps: ``parameters``, ``gradients`` and ``optimizer`` state as the memory
    model counts them, and ``held``, every storage reachable from it."""
    optimizer, params = trainer.optimizer, trainer.parameters()
    parameters = storage_bytes(params)
    bucketed = hasattr(optimizer, "grad_data")
    gradients = storage_bytes([optimizer.grad_data] if bucketed else [param.grad for param in params])
    # the plain optimizer steps the model's own parameters: its "main copy" is no extra memory
    optimizer_state = optimizer.state_bytes() - (0 if bucketed else parameters)
    held = storage_bytes(reachable_tensors(trainer))
    return {"parameters": parameters, "gradients": gradients, "optimizer": optimizer_state, "held": held}


def chosen_ranks(resolved: ResolvedConfig, text: str) -> list[int]:
    """The ranks ``--ranks`` names: ``all``, ``sample`` (``distinct_ranks``) or global ranks apart by commas;
    ``ValueError`` in one line for anything else or a rank outside the layout."""
    if text in ("all", "sample"):
        return distinct_ranks(resolved, text)
    world_size = resolved.layout.world_size
    try:
        ranks = [int(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(f"--ranks {text!r}: give all, sample or global ranks apart by commas (e.g. 0,17)") from None
    outside = [rank for rank in ranks if not 0 <= rank < world_size]
    if outside:
        raise ValueError(f"--ranks {text!r}: rank {outside[0]} is outside the layout's {world_size} ranks "
                         f"(0 to {world_size - 1})")
    return ranks


def distinct_ranks(resolved: ResolvedConfig, which: str) -> list[int]:
    """The global ranks to check: ``all``, one per pp rank (the tp, cp and dp ranks of a pp rank hold tensors of the
    same shapes, and the model predicts one per pp rank), or ``sample``, the first, a middle and the last pp rank;
    each at tp = cp = dp = 0, and with ep > 1 the last EP rank of the middle one (``all``: of each) as well (its
    experts are others, its tokens' share of the exchange its own)."""
    layout = resolved.layout
    pp_ranks = range(layout.pp) if which == "all" else sorted({0, layout.pp // 2, layout.pp - 1})
    ranks = [layout.rank(pp=pp_rank) for pp_rank in pp_ranks]
    if layout.ep > 1:
        expert_pp_ranks = pp_ranks if which == "all" else [layout.pp // 2]
        ranks += [layout.expert_rank(ep=layout.ep - 1, pp=pp_rank) for pp_rank in expert_pp_ranks]
    return sorted(set(ranks))


def check_ranks(resolved: ResolvedConfig, ranks: list[int]) -> list[RankCheck]:
    """``measure_rank`` of each of ``ranks``, one after the other in this process."""
    return [measure_rank(resolved, rank) for rank in ranks]
