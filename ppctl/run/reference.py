"""The single-process reference: a plain PyTorch loop on the same model, data and optimizer.

No pipeline, no runtime, no process group: one model chunk holding every layer takes
the whole global batch in one forward, the mean token loss is back-propagated, the
gradient clipped with ``torch.nn.utils.clip_grad_norm_`` and AdamW steps at the learning
rate of the configured schedule, with the same weight-decay groups as the workers (and, with
``optimizer.gradient_delay=1``, each step's gradients computed on the previous weights). Equivalence
tests compare every layout and schedule against it; the pp=1 overhead benchmark
times it against ``ppctl train``.

A mixture of experts routes each microbatch on its own statistics (its balancing loss, its capacity): its
objective depends on how the global batch is cut, so with experts the loop runs the global batch's microbatches
of ``trainer.micro_batch_size`` sequences one after the other (the consecutive slices every layout cuts),
accumulating their gradients, each microbatch's router losses weighted 1 / (their number), and moves the expert
biases by the step's load after the update (``ppctl.model.moe``).
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch

from ppctl.config import PpctlConfig
from ppctl.data.dataset import Microbatch, build_microbatch
from ppctl.model.family import ResolvedModel, resolve_model
from ppctl.model.compiled import compile_blocks
from ppctl.model.from_config import build_chunk, dataset_of
from ppctl.model.moe.layer import set_router_loss_scale
from ppctl.model.moe.statistics import routing_statistics, routing_table, update_expert_biases
from ppctl.model.recompute import Recompute
from ppctl.optim.delay import DelayedWeights
from ppctl.optim.grads import build_optimizer
from ppctl.optim.lr import learning_rate, lr_schedule_of, set_learning_rate
from ppctl.parallel.layout import StageLayers


@dataclass
class ReferenceRun:
    """Per-step losses and grad norms, the first step's gradients and the final parameters, by global name."""

    losses: list[float]
    grad_norms: list[float]
    first_gradients: dict[str, torch.Tensor]
    parameters: dict[str, torch.Tensor]


def reference_model(config: PpctlConfig, resolved: ResolvedModel | None = None) -> torch.nn.Module:
    """The whole model of ``config`` (its ``ResolvedModel``, resolved here if not given) as one chunk (one process:
    nothing of a parallel layout, and no recomputation: a run that recomputes must compute the same)."""
    model = build_chunk(config, StageLayers.whole(config.model.num_layers), recompute=Recompute(), model=resolved)
    if config.trainer.compile:
        compile_blocks(model)  # a compiled run's reference compiles its blocks the same way
    return model


def reference_step(model: torch.nn.Module, optimizer, batch, clip_grad: float,
                   gradients: dict[str, torch.Tensor] | None = None,
                   delayed: DelayedWeights | None = None, micro_batch_size: int | None = None) -> tuple[float, float]:
    """One full-batch step; returns (mean token loss, grad norm before clipping).

    ``gradients``, when given, receives a copy of every parameter's gradient before clipping.
    ``delayed`` (``optimizer.gradient_delay=1``): the gradients are computed on the previous weights.
    ``micro_batch_size``: the batch runs as microbatches of that many sequences, one after the other (a mixture
    of experts' objective; the module docstring); None: in one forward.
    """
    optimizer.zero_grad(set_to_none=False)
    with delayed.on_previous() if delayed is not None else nullcontext():
        if micro_batch_size is None:
            loss = _token_loss(model, batch, batch.loss_mask)
            loss.backward()
        else:
            loss = _accumulated_token_loss(model, batch, micro_batch_size)
    if gradients is not None:
        gradients.update({name: param.grad.detach().clone() for name, param in model.named_parameters()})
    max_norm = clip_grad if clip_grad > 0 else float("inf")
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, foreach=False)
    optimizer.step()
    return float(loss.detach()), float(grad_norm)


def _token_loss(model: torch.nn.Module, batch, whole_mask: torch.Tensor) -> torch.Tensor:
    """The masked sum of ``batch``'s token losses over the loss tokens of ``whole_mask`` (the global batch's)."""
    losses = model(batch.tokens, position_ids=batch.position_ids, labels=batch.labels, segment_ids=batch.segment_ids)
    mask = batch.loss_mask.to(losses.dtype)
    return (losses * mask).sum() / whole_mask.to(losses.dtype).sum()


def _accumulated_token_loss(model: torch.nn.Module, batch, micro_batch_size: int) -> torch.Tensor:
    """The batch's mean token loss, back-propagated one microbatch at a time (each router loss weighted 1 / the
    number of microbatches); returns the loss."""
    count = batch.tokens.shape[0] // micro_batch_size
    set_router_loss_scale(model, 1.0 / count)
    total = None
    for index in range(count):
        rows = slice(index * micro_batch_size, (index + 1) * micro_batch_size)
        microbatch = Microbatch(*(None if field is None else field[rows]
                                  for field in (batch.tokens, batch.position_ids, batch.labels, batch.loss_mask,
                                                batch.segment_ids)))
        loss = _token_loss(model, microbatch, batch.loss_mask)
        loss.backward()
        total = loss.detach() if total is None else total + loss.detach()
    return total


def run_reference(config: PpctlConfig, steps: int | None = None) -> ReferenceRun:
    """Train ``steps`` (default ``trainer.max_steps``) full-batch steps in this process."""
    trainer, resolved = config.trainer, resolve_model(config)
    model = reference_model(config, resolved)
    optimizer = build_optimizer([model], config.optimizer)
    schedule = lr_schedule_of(config)
    dataset = dataset_of(config)
    delayed = DelayedWeights(dict(model.named_parameters())) if config.optimizer.gradient_delay else None
    moe = resolved.moe
    losses, norms, first_gradients = [], [], {}
    for step in range(trainer.max_steps if steps is None else steps):
        ids = dataset.batch_sample_ids(trainer.seed, step, trainer.global_batch_size)
        set_learning_rate(optimizer, learning_rate(step, schedule))
        loss, norm = reference_step(model, optimizer, build_microbatch(dataset, ids), config.optimizer.clip_grad,
                                    first_gradients if step == 0 else None, delayed,
                                    None if moe is None else trainer.micro_batch_size)
        if moe is not None:
            layer_ids = moe.layer_ids(config.model.num_layers)
            update_expert_biases([model], routing_statistics(routing_table([model], layer_ids, moe.num_experts,
                                                                           "cpu"), layer_ids))
        losses.append(loss)
        norms.append(norm)
    parameters = {name: param.detach().clone() for name, param in model.named_parameters()}
    return ReferenceRun(losses, norms, first_gradients, parameters)
