"""The training loop: one ``Trainer`` per worker, built once from the config and the parallel context.

A step is: this rank's schedule actions (the runtime walks its steps of the lowered program) ->
the optimizer's gradient sync (SP, DP/CP reduction, tied embeddings; overlapped with
the backward by the distributed optimizer) -> global grad norm and clipping ->
``torch.optim.AdamW`` (sharded or not) -> the loss reduced to the rank that logs it.
"""

from __future__ import annotations

import math
import signal
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from ppctl.config import PpctlConfig
from ppctl.resolve.resolved import ResolvedConfig
from ppctl.data.iterator import PipelineDataIterator
from ppctl.model.compiled import compile_blocks
from ppctl.model.from_config import build_chunk, dataset_of
from ppctl.model.moe.layer import set_router_loss_scale
from ppctl.model.moe.statistics import RoutingStatistics, routing_statistics, routing_table, update_expert_biases
from ppctl.model.stages import MaskedTokenLoss, build_stages
from ppctl.optim.bucketed import weakly_bound
from ppctl.optim.delay import DelayedWeights, WeightVersions
from ppctl.optim.grads import clip_coefficient
from ppctl.optim.loss_scale import DynamicLossScaler
from ppctl.optim.optimizer import build_trainer_optimizer
from ppctl.optim.lr import learning_rate, lr_schedule_of, set_learning_rate
from ppctl.parallel.groups import ParallelContext, rank_groups_of
from ppctl.pipeline.check import check_program, check_schedule
from ppctl.pipeline.overlap import ExchangeOverlap
from ppctl.pipeline.program import Message, Program, lower
from ppctl.pipeline.p2p import PipelineTransport
from ppctl.pipeline.runtime import PipelineRuntime
from ppctl.pipeline.schedules import Schedule, streams_steps
from ppctl.pipeline.stage import TensorSpec
from ppctl.pipeline.trace import Tracer
from ppctl.run.faults import inject_fault
from ppctl.run.stream import StepStream


class NonFiniteGradients(RuntimeError):
    """The gradient norm of a step was not finite and the run was asked to stop on it, or too many steps in a row
    were skipped (``trainer.max_skipped_steps``)."""


@dataclass
class SkippedSteps:
    """The steps skipped so far (``total``) and the run of them in a row, with the rule that stops a run that trains
    nothing: ``limit`` (``trainer.max_skipped_steps``) skips in a row. Every rank sees the same norm and the same
    loss scale, so every rank counts alike and stops after the same step, with no message exchanged.

    An fp16 overflow while the loss scale can still fall is the scaler doing its work (a run starting at 65536 may
    halve it a few times): it is counted in ``total`` but neither counts towards the limit nor breaks the run of
    skips. At ``optimizer.min_loss_scale`` nothing is left to back off, and a skip counts.
    """

    limit: int
    total: int = 0
    in_a_row: int = 0

    def record(self, step: int, grad_norm: float, taken: bool, overflow: bool = False) -> None:
        """Count step ``step``: taken (the run of skips ends), skipped on an overflow, or skipped on a non-finite
        norm; raise ``NonFiniteGradients`` in one line when the run of skips reaches the limit (its step counted
        from 1, as the console counts them)."""
        if taken:
            self.in_a_row = 0
            return
        self.total += 1
        if overflow:
            return
        self.in_a_row += 1
        if self.in_a_row >= self.limit:
            raise NonFiniteGradients(
                f"step {step + 1}: the last {self.in_a_row} steps were all skipped (gradient norm {grad_norm}): the "
                f"run trains nothing; stopping (trainer.max_skipped_steps={self.limit}); find what makes the loss or "
                f"the gradients non-finite (the learning rate, a model setting, the data)")

    def state_dict(self) -> dict:
        """The counts, as a checkpoint keeps them."""
        return {"skipped_steps": self.total, "skipped_in_a_row": self.in_a_row}

    def load_state_dict(self, state: dict) -> None:
        """Continue the counts of a ``state_dict()`` (a checkpoint saved before the run of skips was kept: 0)."""
        self.total = int(state["skipped_steps"])
        self.in_a_row = int(state.get("skipped_in_a_row", 0))


@dataclass
class StepResult:
    """What one step measured. ``loss`` is the global batch's mean token loss: the sum of its trained tokens' losses
    over ``trained_tokens``, their count (loss weights summed; both None off the loss ranks). ``tokens_per_s`` counts
    every input token of the global batch (what the hardware computed, a masked one too)."""

    step: int
    loss: float | None
    grad_norm: float
    lr: float
    step_time_s: float
    tokens_per_s: float
    bubble_ratio_measured: float | None = None
    skipped: bool = False      # the gradient norm was not finite: nothing was updated
    skipped_steps: int = 0     # skipped steps so far in this run
    routing: RoutingStatistics | None = None  # a mixture of experts' routing this step (every rank has it)
    trained_tokens: float | None = None  # the global batch's loss-weight sum: the loss's denominator

    @property
    def trained_tokens_per_s(self) -> float | None:
        """Trained tokens (loss weight summed) per second of the step (None off the loss ranks)."""
        return None if self.trained_tokens is None else self.trained_tokens / self.step_time_s


def norm_outcome(grad_norm: float, loss_scaler: DynamicLossScaler | None) -> tuple[bool, bool]:
    """``(finite, overflow)`` of a step's global gradient norm, the fp16 loss scale moved by it: an overflow is a
    non-finite norm while the scale can still fall (``DynamicLossScaler.is_overflow``)."""
    finite = math.isfinite(grad_norm)
    if loss_scaler is None:
        return finite, False
    overflow = loss_scaler.is_overflow(finite)
    loss_scaler.update(finite)
    return finite, overflow


def to_device(microbatch, device: str):
    """The microbatch with its tensors on ``device`` (unchanged on CPU).

    Its fields travel as one packed buffer, in pinned memory and copied without blocking the
    host (``pack_fields``): one transfer per microbatch instead of one per field.
    """
    if device == "cpu":
        return microbatch
    packed, layout = pack_fields(microbatch)
    return unpack_fields(packed.pin_memory().to(device, non_blocking=True), layout, type(microbatch))


def pack_fields(microbatch) -> tuple[torch.Tensor, list]:
    """A microbatch's tensor fields as one flat byte tensor, and the layout to cut it back: per field, its name
    and (offset, bytes, shape, dtype) or None for a field that is not a tensor (kept as it is)."""
    pieces, layout, offset = [], [], 0
    for name, value in vars(microbatch).items():
        if not isinstance(value, torch.Tensor):
            layout.append((name, value, None))
            continue
        raw = value.contiguous().reshape(-1).view(torch.uint8)
        layout.append((name, None, (offset, raw.numel(), tuple(value.shape), value.dtype)))
        pieces.append(raw)
        offset += raw.numel()
    packed = torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.uint8)
    return packed, layout


def unpack_fields(packed: torch.Tensor, layout: list, kind):
    """The microbatch of type ``kind`` whose tensor fields are views into ``packed`` (``pack_fields``' output)."""
    fields = {}
    for name, value, place in layout:
        if place is None:
            fields[name] = value
            continue
        offset, size, shape, dtype = place
        fields[name] = packed[offset:offset + size].view(dtype).reshape(shape)
    return kind(**fields)


def build_chunks(resolved: ResolvedConfig, context: ParallelContext, load_init_from: bool = True,
                 on_exchange=None, overlap: ExchangeOverlap | None = None) -> dict[int, torch.nn.Module]:
    """This rank's model chunks, keyed by global stage, from the resolved layer map (its placement); their weights
    read from ``model.init_from`` unless ``load_init_from`` is False (a resumed run reads its checkpoint);
    ``on_exchange``: told the span of each expert-parallel all-to-all; ``overlap``: the runtime's expert-exchange
    overlap, whose pacer the groups' lanes finish their collectives through (None: off)."""
    config = resolved.config
    groups = rank_groups_of(context, sequence_parallel=config.parallel.sequence_parallel,
                            cp_comm=config.parallel.cp_comm, on_exchange=on_exchange,
                            pacer=overlap.interleave if overlap is not None else None)
    chunks = {}
    for stage in resolved.rank_stages(context.pp_rank):
        chunk = build_chunk(config, stage, groups, load_init_from=load_init_from, model=resolved.model)
        # built on the CPU: moved only to another device (moving a fake tensor's module would swap its parameters)
        chunks[stage.stage] = chunk if context.device == "cpu" else chunk.to(context.device)
        if config.trainer.compile:
            compile_blocks(chunks[stage.stage])  # compiled at its first microbatch (ppctl.model.compiled)
    # Model-stage order: DualPipe's mirror ranks then list the same parameters in the same order.
    return dict(sorted(chunks.items(), key=lambda item: context.layout.placement.model_stage(item[0])))


def build_data(config: PpctlConfig, context: ParallelContext, fields: tuple[str, ...],
               split: str = "train") -> PipelineDataIterator:
    """The microbatch iterator of a data split: TP rank 0 reads and broadcasts ``fields`` (what this rank's
    stages read).

    Every rank then keeps its CP rank's tokens of each field.
    """
    trainer = config.trainer
    tp_ranks = context.group_ranks["tp"]
    return PipelineDataIterator(
        dataset_of(config, split), trainer.seed, trainer.global_batch_size, trainer.micro_batch_size,
        trainer.seq_length, dp_rank=context.coords["dp"], dp_size=context.layout.dp,
        tp_group=context.groups["tp"] if len(tp_ranks) > 1 else None,
        tp_src_rank=tp_ranks[0], is_tp_src=context.rank == tp_ranks[0], fields=fields, device=context.device,
        cp_rank=context.coords["cp"], cp_size=context.layout.cp,
    )


def loss_scaler_of(config: PpctlConfig) -> DynamicLossScaler | None:
    """The dynamic loss scaler of an fp16 run (None otherwise)."""
    if config.trainer.precision != "fp16":
        return None
    settings = config.optimizer
    return DynamicLossScaler(settings.loss_scale, settings.loss_scale_window, settings.min_loss_scale)


class Trainer:
    """Everything one worker needs to train: stages, schedule programs, runtime, data, optimizer.

    ``schedule`` replaces the resolved one (a hand-made schedule, checked here); the resolved one was
    proved by the checker when the config was validated. ``resuming``: the weights come from a checkpoint
    loaded next (``load_checkpoint``), so ``model.init_from`` is not read. ``track_memory``: the runtime notes
    the memory held after each action (``PipelineRuntime``); ``data_of(config, context, fields)``: the step's
    microbatches (``build_data``; ``ppctl.run.fake_rank`` gives synthetic ones).
    """

    def __init__(self, resolved: ResolvedConfig, context: ParallelContext, release_outputs: bool = True,
                 track_memory: bool | Callable[[], int] = False, schedule: Schedule | None = None,
                 resuming: bool = False, data_of: Callable = build_data):
        config = resolved.config
        self.resolved, self.config, self.context = resolved, config, context
        layout = context.layout
        if schedule is None:
            schedule = resolved.schedule
            program = lower(schedule)
        else:
            program = check_schedule(schedule)
        if schedule.placement != layout.placement:
            raise RuntimeError(f"schedule {schedule.name} places stages {schedule.placement.owners} "
                               f"({schedule.placement.copies} model copies) but the layout says "
                               f"{layout.placement.owners} ({layout.placement.copies})")
        self.schedule = schedule
        self.tracer = Tracer(context.rank) if config.trainer.trace else None
        overlaps = config.parallel.overlap_ep_comm and layout.ep > 1
        overlap = ExchangeOverlap(on_piece=weakly_bound(self._note_piece)) if overlaps else None
        self.chunks = build_chunks(resolved, context, load_init_from=not resuming,
                                   on_exchange=weakly_bound(self._note_exchange), overlap=overlap)
        self.stages = build_stages(self.chunks, config, schedule.splits_backward)
        self.padded_vocab_size = resolved.model.padded_vocab_size
        self.fields = tuple(sorted({name for stage in self.stages.values() for name in stage.io.fields}))
        self.data = data_of(config, context, self.fields)
        self._validation_data: PipelineDataIterator | None = None
        # Each parameter copy runs its share of the microbatches (DualPipe: half each).
        streams = streams_steps(schedule)
        self.optimizer = build_trainer_optimizer(self.chunks, context, config.optimizer,
                                                 self.data.num_microbatches // layout.placement.copies,
                                                 bucketed=streams)
        self.lr_schedule = lr_schedule_of(config)
        self.skips = SkippedSteps(config.trainer.max_skipped_steps)
        # PipeDream-2BW streams its steps over two weight versions; other delayed runs keep the previous one
        self.delayed = (WeightVersions(self.optimizer) if streams
                        else DelayedWeights(self.named_parameters()) if config.optimizer.gradient_delay else None)
        self.stream = StepStream(self, self.delayed) if streams else None
        self.loss_scaler = loss_scaler_of(config)
        self.loss_scale = 1.0  # the scale the current step's gradients carry
        transport = PipelineTransport(context.pp_peer, self._receive_spec, context.device,
                                      timeout_s=config.launcher.timeout_s)
        self.runtime = PipelineRuntime(context.pp_rank, self.stages, transport, self.tracer, release_outputs,
                                       track_memory)
        if overlap is not None:
            overlap.install(self.runtime)
        self.program = program
        self.last_program = program  # what the last training run walked (a stream's, for PipeDream-2BW)
        self._eval_program: Program | None = None
        self.holds_loss = context.pp_rank in layout.placement.loss_pp_ranks
        self.logging_rank = layout.rank(pp=layout.placement.last_stage_rank)
        self.moe = resolved.model.moe
        self.routing: RoutingStatistics | None = None  # the last step's, with experts
        self.trained_tokens: float | None = None  # the last step's loss-token count (loss ranks)
        self.validation_tokens: float | None = None  # the last validation loss's (loss ranks)

    def set_tracing(self, on: bool) -> None:
        """Trace the following steps' actions and waits (as ``trainer.trace=true`` does from the start), or stop."""
        self.tracer = Tracer(self.context.rank) if on else None
        self.runtime.tracer = self.tracer

    def _note_exchange(self, start: float, end: float, lane: int) -> None:
        """An expert-parallel all-to-all's span, for the tracer when tracing."""
        if self.tracer is not None:
            self.tracer.exchange(start, end, lane)

    def _note_piece(self, half: str, start: float, end: float) -> None:
        """A piece of an overlapped pair's half (``ppctl.pipeline.interleave``), for the tracer when tracing."""
        if self.tracer is not None:
            self.tracer.piece(half, start, end)

    def _receive_spec(self, message: Message) -> TensorSpec:
        return self.stages[message.dst_stage].receive_spec(message.kind)

    @property
    def eval_program(self) -> Program:
        """The forward-only program of the schedule (lowered and checked on first use)."""
        if self._eval_program is None:
            self._eval_program = lower(self.schedule.forward_only())
            check_program(self._eval_program)  # its messages and progress (it has no backwards to check)
        return self._eval_program

    @property
    def skipped_steps(self) -> int:
        """The steps skipped so far in this run."""
        return self.skips.total

    def state_dict(self) -> dict:
        """The trainer's own counters (``Stateful``; its parts have their own): the steps skipped so far, and the
        last of them in a row."""
        return self.skips.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Continue the counters of a ``state_dict()``."""
        self.skips.load_state_dict(state)

    def parameters(self):
        """Every parameter of this rank's chunks."""
        return [param for chunk in self.chunks.values() for param in chunk.parameters()]

    def named_parameters(self) -> dict[str, torch.Tensor]:
        """Global parameter name -> this rank's shard (names are layout independent), up to date."""
        self.optimizer.sync_parameters()
        return {name: param for chunk in self.chunks.values() for name, param in chunk.named_parameters()}

    def gradients(self) -> dict[str, torch.Tensor]:
        """Global parameter name -> this rank's shard of its reduced gradient (collective with the
        distributed optimizer, which gathers them from the ``dp_cp`` shards)."""
        return self.optimizer.full_gradients()

    def train_steps(self, first_step: int, num_steps: int) -> list[StepResult]:
        """Train steps ``first_step`` .. ``first_step + num_steps - 1``: one by one, or, for a schedule that streams
        steps (PipeDream-2BW), as one stream (``ppctl.run.stream``) whose results come when it has drained.

        A stream cannot skip a step (no rank waits for the others' norms before its update): a non-finite
        norm stops the run after the stream.
        """
        if self.stream is None:
            return [self.train_step(step) for step in range(first_step, first_step + num_steps)]
        started = time.perf_counter()
        streamed = self.stream.run(first_step, num_steps)
        step_time = (time.perf_counter() - started) / num_steps
        tokens = self.config.trainer.global_batch_size * self.config.trainer.seq_length
        bubble = self._measured_bubble()
        for step in streamed:
            if not math.isfinite(step.grad_norm):
                raise NonFiniteGradients(f"step {step.step}: the gradient norm is {step.grad_norm}; a stream of "
                                         f"steps (schedule {self.schedule.name}) cannot skip a step")
        return [StepResult(step.step, step.loss, step.grad_norm, step.lr, step_time, tokens / step_time, bubble,
                           skipped_steps=self.skipped_steps, trained_tokens=step.trained_tokens)
                for step in streamed]

    def train_step(self, step: int) -> StepResult:
        """Run one global batch through the schedule and update the parameters (a stream of one step when the
        schedule streams steps)."""
        if self.stream is not None:
            return self.train_steps(step, 1)[0]
        started = time.perf_counter()
        loss, grad_norm = self.compute_gradients(step)
        applied = self.apply_gradients(step, grad_norm)
        elapsed = time.perf_counter() - started
        tokens = self.config.trainer.global_batch_size * self.config.trainer.seq_length
        return StepResult(step, loss, grad_norm, self.optimizer.param_groups[0]["lr"], elapsed, tokens / elapsed,
                          self._measured_bubble(), skipped=not applied, skipped_steps=self.skipped_steps,
                          routing=self.routing, trained_tokens=self.trained_tokens)

    def compute_gradients(self, step: int) -> tuple[float | None, float]:
        """Forward and backward of global batch ``step``: reduced gradients; returns (loss, global grad norm).

        The loss is the global batch's mean token loss on the ranks that hold the last stage, else None: every
        microbatch's masked loss sum over the one count of the whole global batch's trained tokens (``batch``), so
        the accumulated gradient is the full batch's mean token loss gradient whatever the microbatches hold.
        """
        self.optimizer.zero_grad()
        microbatches, normalizer = self.batch(step, self.data)
        self.trained_tokens = normalizer if self.holds_loss else None
        if self.tracer is not None:
            self.tracer.start_step()
        self.loss_scale = self.loss_scaler.scale if self.loss_scaler is not None else 1.0
        self._scale_router_losses()
        with self._gradient_weights():
            state = self.runtime.run(self.program, microbatches, MaskedTokenLoss(normalizer, self.loss_scale))
        self.last_step_state = state
        self.optimizer.finish_grad_sync()
        self.routing = self._routing_statistics()
        return self._mean_loss(state, normalizer), self.optimizer.grad_norm() / self.loss_scale

    def _scale_router_losses(self) -> None:
        """Each microbatch's router losses weigh 1 / (the global batch's microbatches), times the loss scale, as
        the token loss does (``ppctl.model.moe.layer``)."""
        if self.moe is None:
            return
        trainer = self.config.trainer
        global_microbatches = trainer.global_batch_size // trainer.micro_batch_size
        for chunk in self.chunks.values():
            set_router_loss_scale(chunk, self.loss_scale / global_microbatches)

    def _routing_statistics(self) -> RoutingStatistics | None:
        """The step's routing of every MoE layer, summed over every rank (one all-reduce; None without experts)."""
        if self.moe is None:
            return None
        layer_ids = self.moe.layer_ids(self.config.model.num_layers)
        table = routing_table(self.chunks.values(), layer_ids, self.moe.num_experts, self.context.device)
        dist.all_reduce(table)
        return routing_statistics(table, layer_ids)

    def _gradient_weights(self):
        """The weights a step's gradients are computed on: the current ones, or with ``optimizer.gradient_delay=1``
        the previous version (``ppctl.optim.delay``; in-flight parameter gathers finished first)."""
        if self.delayed is None:
            return nullcontext()
        self.optimizer.sync_parameters()
        return self.delayed.on_previous()

    def evaluate(self, step: int, data: PipelineDataIterator | None = None) -> float | None:
        """Mean token loss of global batch ``step`` (of ``data``, default the training data) through the
        forward-only schedule; nothing is kept or changed.

        Returns the loss on the ranks holding the last stage, None elsewhere.
        """
        loss_sum, trained_tokens = self.evaluate_sum(step, data)
        return loss_sum / trained_tokens if self.holds_loss else None

    def evaluate_sum(self, step: int, data: PipelineDataIterator | None = None) -> tuple[float, float]:
        """The summed token losses of global batch ``step``'s trained tokens (loss-weighted, summed over the
        replicas) and their count, through the forward-only schedule; (0.0, 1.0) off the loss ranks."""
        microbatches, normalizer = self.batch(step, data or self.data)
        state = self.runtime.run(self.eval_program, microbatches, MaskedTokenLoss(normalizer), forward_only=True)
        if not self.holds_loss:
            return 0.0, 1.0
        return self.reduce_loss(float(state.loss_sum)), normalizer

    def validation_loss(self) -> float | None:
        """The mean token loss over validation batches 0 .. ``trainer.eval_iters``-1 together (the same batches every
        time, in every layout): their trained tokens' summed losses over their count, so a batch with few trained
        tokens weighs little, as in training; on the loss ranks, None elsewhere."""
        if self._validation_data is None:
            self._validation_data = build_data(self.config, self.context, self.fields, split="validation")
        sums = [self.evaluate_sum(batch, self._validation_data) for batch in range(self.config.trainer.eval_iters)]
        self.validation_tokens = sum(count for _, count in sums) if self.holds_loss else None
        return pooled_mean(sums) if self.holds_loss else None

    def batch(self, step: int, data: PipelineDataIterator) -> tuple[list, float]:
        """This rank's microbatches of global batch ``step`` and the batch's loss-token count (loss ranks; 1.0
        elsewhere): the loss weights of every dp x cp rank's microbatches, added once per step."""
        microbatches = [to_device(mb, self.context.device) for mb in data.microbatches(step)]
        if not self.holds_loss:
            return microbatches, 1.0
        return microbatches, data.global_loss_tokens(step, microbatches, loss_count_group(self.context))

    def _mean_loss(self, state, normalizer: float) -> float | None:
        """The global batch's mean token loss on the loss ranks (summed over DP), None elsewhere."""
        return self.reduce_loss(float(state.loss_sum) / normalizer) if self.holds_loss else None

    def apply_gradients(self, step: int, grad_norm: float) -> bool:
        """Clip by the global norm and take optimizer step ``step`` at the schedule's learning rate.

        A non-finite norm (the same on every rank) skips the step: no parameter and no
        optimizer state changes. With fp16 it is an overflow of the loss scale, which is
        halved; otherwise ``trainer.stop_on_nonfinite`` raises ``NonFiniteGradients``
        instead, as ``trainer.max_skipped_steps`` skips in a row do (``SkippedSteps``).
        Returns whether the step was taken.
        """
        finite, overflow = norm_outcome(grad_norm, self.loss_scaler)
        if not finite and not overflow and self.config.trainer.stop_on_nonfinite:  # an overflow is no fault
            raise NonFiniteGradients(f"step {step}: the gradient norm is {grad_norm}; stopping "
                                     "(trainer.stop_on_nonfinite=true)")
        self.skips.record(step, grad_norm, taken=finite, overflow=overflow)
        if not finite:
            return False
        # Clipping and undoing the loss scale in one pass over the gradients.
        self.optimizer.scale_gradients(clip_coefficient(grad_norm, self.config.optimizer.clip_grad) / self.loss_scale)
        set_learning_rate(self.optimizer, learning_rate(step, self.lr_schedule))
        self.optimizer.step()
        if self.routing is not None:
            update_expert_biases(self.chunks.values(), self.routing)
        return True

    def reduce_loss(self, local_loss: float) -> float:
        """Sum the shares of the replicas (each already divided by the global token count).

        The replicas are the dp x cp ranks, and with DualPipe the mirror pp rank, whose
        parameter copy computed the loss of the other half of the microbatches.
        """
        total = torch.tensor([local_loss], dtype=torch.float64, device=self.context.device)
        if self.context.size("replica") > 1:
            dist.all_reduce(total, group=self.context.groups["replica"])
        return float(total.item())

    def _measured_bubble(self) -> float | None:
        """Idle time waiting for messages over compute time, averaged over the ranks (tracing only)."""
        if self.tracer is None:
            return None
        compute = self.tracer.compute_seconds()
        ratio = torch.tensor([self.tracer.wait_seconds() / compute if compute else 0.0], dtype=torch.float64,
                             device=self.context.device)
        dist.all_reduce(ratio)
        return float(ratio.item()) / dist.get_world_size()


def loss_count_group(context: ParallelContext):
    """The ranks whose microbatches' loss weights add up to a global batch's count: the dp x cp ranks of this pp rank
    (DualPipe's mirror rank holds the same microbatches, so not its replica group); None when this rank is alone."""
    return context.groups["dp_cp"] if context.size("dp_cp") > 1 else None


def pooled_mean(sums_and_counts: list[tuple[float, float]]) -> float:
    """The mean over every token of several batches: their summed losses over their summed counts (not the mean of
    the batches' means, which would weigh a batch of few trained tokens like one of many)."""
    return sum(total for total, _ in sums_and_counts) / sum(count for _, count in sums_and_counts)


def train(resolved: ResolvedConfig, context: ParallelContext, run_dir: Path, resume_from: str | None = None,
          stop=None) -> list[StepResult]:
    """The worker's training job: build the trainer (resumed from the checkpoint ``resume_from``, the launch's),
    run every step, validate and save as configured, log from the loss-owning rank.

    ``stop`` (``ppctl.run.interrupt``) says whether this worker was asked to stop: after each step all
    ranks agree on it, save a checkpoint and return.
    """
    from ppctl.checkpoint.state import load_checkpoint
    from ppctl.run.logging import TrainingLogger

    config = resolved.config
    trainer = Trainer(resolved, context, resuming=bool(resume_from))
    start = load_checkpoint(trainer, Path(resume_from)) if resume_from else 0
    logger = (TrainingLogger(config, run_dir, trainer, start_step=start, resumed_from=resume_from)
              if context.rank == trainer.logging_rank else None)
    results, step = [], start
    while step < config.trainer.max_steps:
        end = _run_until(trainer, step)
        done = trainer.train_steps(step, end - step)
        if trainer.tracer is not None:
            gather_trace(trainer, run_dir, step, logger)
        if logger is not None:
            for result in done:
                logger.log(result)
        results += done
        step, before = end, step
        if _after_step(trainer, run_dir, step, stop, logger):
            break
        inject_fault(config.launcher.inject_fault, context.rank, before, step)
    if logger is not None:
        logger.close()
    return results


def _run_until(trainer: Trainer, step: int) -> int:
    """Where the steps from ``step`` on pause to validate, save, read signals or end: the next step for most
    schedules; for one that streams steps, up to ``schedule.stream_steps`` later, cut at validation and saves."""
    if trainer.stream is None:
        return step + 1
    settings = trainer.config.trainer
    end = min(settings.max_steps, step + trainer.config.schedule.stream_steps)
    for every in (settings.eval_every, settings.save_every if settings.checkpoints else 0):
        if every:
            end = min(end, (step // every + 1) * every)
    return end


def _after_step(trainer: Trainer, run_dir: Path, done: int, stop, logger) -> bool:
    """Validate and save when due (``done`` steps taken); return whether every rank agreed to stop."""
    settings = trainer.config.trainer
    if settings.eval_every and done % settings.eval_every == 0:
        validation = trainer.validation_loss()
        if logger is not None:
            logger.log_validation(done - 1, validation, trainer.validation_tokens)
    stop_signal = stop_agreed(stop, trainer.context) if stop is not None else None
    reason = (f"interrupted by {stop_signal}" if stop_signal else "end" if done == settings.max_steps
              else "periodic" if settings.save_every and done % settings.save_every == 0 else None)
    saved = None
    if settings.checkpoints and reason is not None:
        from ppctl.checkpoint.state import save_checkpoint

        saved = save_checkpoint(trainer, run_dir, done, reason, settings.keep_last)
        if logger is not None:
            logger.saved(saved, done, reason)
    if stop_signal and logger is not None:
        logger.stopped(done, stop_signal, saved)
    return stop_signal is not None


def stop_agreed(stop, context: ParallelContext) -> str | None:
    """The signal that asked any rank to stop (``"SIGTERM"``), or None: one all-reduce over every rank, so that
    all ranks stop after the same step, also those the signal did not reach."""
    number = signal.Signals[stop.signal_name].value if stop.requested else 0
    agreed = torch.tensor([number], dtype=torch.int64, device=context.device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
    return signal.Signals(int(agreed.item())).name if agreed.item() else None


def gather_trace(trainer: Trainer, run_dir: Path, step: int, logger) -> None:
    """Collect every rank's timeline of this step on the logging rank (which writes the files)."""
    gathered = [None] * dist.get_world_size() if trainer.context.rank == trainer.logging_rank else None
    dist.gather_object(trainer.tracer.snapshot(), gathered, dst=trainer.logging_rank)
    if logger is not None:
        logger.add_trace(step, gathered)
