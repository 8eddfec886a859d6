"""The trainer's optimizer, one interface for every path: plain, or bucketed (sharded or not).

A step calls ``zero_grad``, runs the backward, then ``finish_grad_sync`` (every
reduction), ``grad_norm``, ``scale_gradients`` (clipping, fp16 unscaling) and ``step``.
``PlainOptimizer`` keeps the classic path: gradients all-reduced over the replicas
(``dp_cp``; DualPipe adds its mirror rank) and a full ``torch.optim.AdamW`` on every rank.
``BucketedOptimizer`` (``ppctl.optim.bucketed``) holds fp32 main gradients and parameters
in bucketed flat buffers: sharded over the replicas, it is the distributed optimizer
(ZeRO-1); unsharded, the plain path of a half-precision model.
"""

from __future__ import annotations

from typing import Mapping

import torch

from ppctl.optim.bucketed import BucketedOptimizer
from ppctl.optim.grads import (AdamWStateful, StateTensors, adam_state, build_optimizer, decays,
                               finalize_gradients, global_grad_norm, optimizer_state_bytes, scale_gradients)


class PlainOptimizer(AdamWStateful):
    """Gradients all-reduced over the replicas (and tied / SP sums), AdamW over every parameter of this rank."""

    def __init__(self, chunks: Mapping[int, torch.nn.Module], context, settings):
        self.chunks, self.context = chunks, context
        self.optimizer = build_optimizer(chunks.values(), settings)

    @property
    def param_groups(self) -> list[dict]:
        """The AdamW parameter groups (their ``lr`` is what a step uses)."""
        return self.optimizer.param_groups

    def zero_grad(self) -> None:
        """Start a step with zero gradients (kept allocated)."""
        self.optimizer.zero_grad(set_to_none=False)

    def finish_grad_sync(self) -> None:
        """Every reduction of the step's gradients (``ppctl.optim.grads.finalize_gradients``)."""
        finalize_gradients(self.chunks, self.context)

    def grad_norm(self) -> float:
        """The global gradient norm, each parameter counted once."""
        return global_grad_norm(self.chunks, self.context)

    def scale_gradients(self, factor: float) -> None:
        """Multiply every gradient by ``factor`` (clipping, fp16 unscaling)."""
        scale_gradients(self.chunks, factor)

    def step(self) -> None:
        """The AdamW step."""
        self.optimizer.step()

    def sync_parameters(self) -> None:
        """Nothing in flight on this path."""

    def describe(self) -> str:
        """One phrase for the run's banner."""
        return "optimizer: AdamW on every rank, gradients all-reduced"

    def full_gradients(self) -> dict[str, torch.Tensor]:
        """Every parameter's reduced gradient."""
        return {name: param.grad for chunk in self.chunks.values() for name, param in chunk.named_parameters()}

    def state_bytes(self) -> int:
        """Bytes of the fp32 main parameters (the parameters themselves here) and AdamW state."""
        return optimizer_state_bytes(self.optimizer)

    def state_tensors(self, create: bool = False) -> list[StateTensors]:
        """Every parameter's AdamW moments, whole (``create``: zero moments where there are none yet)."""
        names = {id(param): name for chunk in self.chunks.values() for name, param in chunk.named_parameters()}
        found = []
        for group in self.optimizer.param_groups:
            for param in group["params"]:
                state = adam_state(self.optimizer, param, create)
                if state:
                    found.append(StateTensors(names[id(param)], tuple(param.shape), 0,
                                              {"exp_avg": state["exp_avg"], "exp_avg_sq": state["exp_avg_sq"]}))
        return found

    def after_load(self) -> None:
        """Nothing derived from the parameters on this path."""


def build_trainer_optimizer(chunks: Mapping[int, torch.nn.Module], context, settings, num_microbatches: int,
                            bucketed: bool = False):
    """The distributed optimizer (sharded buckets) when ``settings.distributed``; else the plain path:
    unsharded buckets of fp32 main parameters and gradients when the model is in half precision or
    ``bucketed`` is asked for (PipeDream-2BW keeps its two weight versions in flat buffers), else
    ``PlainOptimizer``."""
    half_precision = any(param.dtype in (torch.bfloat16, torch.float16)
                         for chunk in chunks.values() for param in chunk.parameters())
    if settings.distributed or half_precision or bucketed:
        return BucketedOptimizer(chunks, context, settings, num_microbatches, sharded=settings.distributed,
                                 decays=lambda name, param: decays(name, param, settings))
    return PlainOptimizer(chunks, context, settings)
