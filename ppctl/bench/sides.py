"""The two sides of a ``ppctl bench`` comparison, each training the same steps of the same model on one rank.

A side runs ``run_steps(first, count)`` and returns each step's loss (the global batch's
mean token loss on a rank holding the loss, None elsewhere); ``holder`` is what it keeps
between steps (weights, gradients, optimizer state, buffers), for the memory figure.

- ``PpctlSide``: ppctl's ``Trainer`` (runtime, lowered program, gradient path, optimizer).
- ``TorchPipelineSide``: ``torch.distributed.pipelining`` written as its documentation
  shows: a ``PipelineStage`` per local chunk, the schedule class of the same schedule,
  a loss function, then the global gradient norm over the pipeline, clipping and AdamW.
- ``PlainLoopSide``: at pp=1, forward and backward of each microbatch, clip, AdamW.
- ``EagerSide``: ppctl's ``Trainer`` again with ``trainer.compile=false`` (the run's own is compiled): what
  compiling the blocks gains, any layout and schedule.

The other sides' chunks come from ppctl's builder (equal weights: initialisation depends
on the seed alone), their optimizer from the same AdamW groups, their data from a second
iterator over the same samples, their loss from the same ``MaskedTokenLoss``.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import torch
from torch import nn

from ppctl.resolve.resolved import ResolvedConfig, resolve
from ppctl.model.stages import MaskedTokenLoss, chunk_fields
from ppctl.optim.grads import build_optimizer, clip_gradients, global_grad_norm
from ppctl.optim.lr import learning_rate, lr_schedule_of, set_learning_rate
from ppctl.parallel.groups import ParallelContext
from ppctl.parallel.tensor_parallel import TPGroup, vocab_parallel_cross_entropy
from ppctl.run.train import Trainer, build_chunks, build_data, loss_count_group, to_device

from .rules import TORCH_SCHEDULE_CLASSES


class PpctlSide:
    """ppctl's own training step."""

    name = "ppctl"

    def __init__(self, trainer: Trainer):
        self.trainer = trainer
        self.holder = trainer

    def run_steps(self, first: int, count: int) -> list[float | None]:
        """Train ``count`` steps from ``first`` (one stream for PipeDream-2BW); their losses."""
        return [result.loss for result in self.trainer.train_steps(first, count)]


class EagerSide(PpctlSide):
    """ppctl's training step with eager blocks, beside a run whose blocks are compiled."""

    name = "eager"

    def __init__(self, resolved: ResolvedConfig, context: ParallelContext):
        config = resolved.config
        eager = dataclasses.replace(config, trainer=dataclasses.replace(config.trainer, compile=False))
        super().__init__(Trainer(resolve(eager, check=False), context))


class _ChunkBody(nn.Module):
    """A model chunk as a pipeline stage module: tokens or hidden states in, hidden states or logits out (the loss
    is the schedule's loss function, as torch.distributed.pipelining expects)."""

    def __init__(self, chunk: nn.Module):
        super().__init__()
        self.chunk = chunk

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """The chunk on whole sequences (positions 0..seq-1), without labels."""
        return self.chunk(inputs)


class _StepLoss:
    """``MaskedTokenLoss`` on the last stage's logits; the target packs labels and loss mask (one tensor, as the
    schedule splits targets into microbatches along the batch)."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.normalizer = 1.0  # the step's loss-token count, set before each step

    def __call__(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        labels, mask = target[..., 0].long(), target[..., 1]
        token_losses = vocab_parallel_cross_entropy(logits, labels, TPGroup.single(), self.vocab_size)
        loss, _ = MaskedTokenLoss(self.normalizer)(token_losses, SimpleNamespace(loss_mask=mask))
        return loss


class _ReferenceParts:
    """What the other sides share: chunks from ppctl's builder, AdamW groups, a data iterator, the LR schedule."""

    def __init__(self, resolved: ResolvedConfig, context: ParallelContext):
        config = resolved.config
        self.config, self.context = config, context
        self.chunks = build_chunks(resolved, context)
        separate = config.data.documents == "separate"
        fields = tuple(sorted({name for chunk in self.chunks.values() for name in chunk_fields(chunk, separate)}))
        self.data = build_data(config, context, fields)
        self.optimizer = build_optimizer(self.chunks.values(), config.optimizer)
        self.lr_schedule = lr_schedule_of(config)

    def microbatches(self, step: int) -> list:
        """This rank's microbatches of global batch ``step``, on the device."""
        return [to_device(microbatch, self.context.device) for microbatch in self.data.microbatches(step)]

    def clip_and_update(self, step: int) -> None:
        """Clip by the global gradient norm (over the pipeline) and take AdamW step ``step``."""
        clip_gradients(self.chunks, global_grad_norm(self.chunks, self.context), self.config.optimizer.clip_grad)
        set_learning_rate(self.optimizer, learning_rate(step, self.lr_schedule))
        self.optimizer.step()


class TorchPipelineSide(_ReferenceParts):
    """torch.distributed.pipelining on the same chunks."""

    name = "torch"

    def __init__(self, resolved: ResolvedConfig, context: ParallelContext):
        from torch.distributed import pipelining

        super().__init__(resolved, context)
        config = resolved.config
        placement = context.layout.placement
        total = placement.stages_per_copy
        device = torch.device(context.device)
        # torch numbers stages in model order; its stage modules are ppctl's chunks without the loss
        by_model_stage = sorted((placement.model_stage(stage), chunk) for stage, chunk in self.chunks.items())
        stages = [pipelining.PipelineStage(_ChunkBody(chunk), index, total, device, group=context.groups["pp"])
                  for index, chunk in by_model_stage]
        self.holds_first = by_model_stage[0][0] == 0
        self.holds_loss = by_model_stage[-1][0] == total - 1
        self.loss = _StepLoss(config.model.vocab_size)
        schedule_class = getattr(pipelining, TORCH_SCHEDULE_CLASSES[config.schedule.name])
        one_stage = schedule_class in (pipelining.ScheduleGPipe, pipelining.Schedule1F1B)
        self.schedule = schedule_class(stages[0] if one_stage else stages, n_microbatches=self.data.num_microbatches,
                                       loss_fn=self.loss, scale_grads=False)
        self.holder = (self.chunks, self.optimizer, stages)

    def run_steps(self, first: int, count: int) -> list[float | None]:
        """Train ``count`` steps from ``first``; their losses."""
        return [self._step(step) for step in range(first, first + count)]

    def _step(self, step: int) -> float | None:
        self.optimizer.zero_grad(set_to_none=False)
        microbatches = self.microbatches(step)
        args = (torch.cat([mb.tokens for mb in microbatches]),) if self.holds_first else ()
        target, losses = None, []
        if self.holds_loss:
            self.loss.normalizer = self.data.global_loss_tokens(step, microbatches, loss_count_group(self.context))
            target = torch.cat([torch.stack([mb.labels.double(), mb.loss_mask.double()], dim=-1)
                                for mb in microbatches])
        self.schedule.step(*args, target=target, losses=losses, return_outputs=False)
        self.clip_and_update(step)
        return float(torch.stack(losses).sum()) if self.holds_loss else None


class PlainLoopSide(_ReferenceParts):
    """A plain PyTorch loop at pp=1: forward and backward per microbatch (gradient accumulation), clip, AdamW."""

    name = "plain"

    def __init__(self, resolved: ResolvedConfig, context: ParallelContext):
        super().__init__(resolved, context)
        (self.model,) = self.chunks.values()
        self.holder = (self.chunks, self.optimizer)

    def run_steps(self, first: int, count: int) -> list[float | None]:
        """Train ``count`` steps from ``first``; their losses."""
        return [self._step(step) for step in range(first, first + count)]

    def _step(self, step: int) -> float:
        self.optimizer.zero_grad(set_to_none=False)
        microbatches = self.microbatches(step)
        loss_fn = MaskedTokenLoss(self.data.global_loss_tokens(step, microbatches, loss_count_group(self.context)))
        total = 0.0
        for mb in microbatches:
            token_losses = self.model(mb.tokens, position_ids=mb.position_ids, labels=mb.labels,
                                      segment_ids=mb.segment_ids)
            loss, masked_sum = loss_fn(token_losses, mb)
            loss.backward()
            total = total + masked_sum.detach()  # no host sync per microbatch
        self.clip_and_update(step)
        return float(total) / loss_fn.normalizer


def other_side(against: str, resolved: ResolvedConfig, context: ParallelContext):
    """The side ppctl is compared with (None for ``none``)."""
    sides = {"torch": TorchPipelineSide, "plain": PlainLoopSide, "eager": EagerSide}
    return sides[against](resolved, context) if against in sides else None
