"""The pipeline stage: one model chunk (one global virtual stage) as the runtime sees it.

The runtime knows no model. It calls a stage's ``forward``, ``backward`` (whole),
``backward_input`` and ``backward_weight`` (a backward split into B and W) and
``forward_only`` (evaluation); the stage keeps what passes between them (its inputs,
its outputs, what a W needs), per microbatch. Two functions come from the training
side:

- ``forward_fn(module, stage_input, microbatch)`` is the data contract: which
  microbatch fields the module reads (tokens on the first stage, labels on the last)
  and what it returns;
- ``loss_fn(output, microbatch) -> (loss, logged)`` turns the last stage's output into
  the scalar to back-propagate and the value to report (like torch.distributed.pipelining's
  ``loss_fn`` or Megatron's ``forward_step_func``). It is given per step, so the step's
  normaliser can change.

A split backward is real: the stage owns a ``WeightGradStore`` and hands it to the
layers of its chunk that can defer their weight gradients (``ppctl.autograd.weight_grad``).
B runs the autograd graph once, for the input gradient, with the store deferring: those
layers stash what their weight gradients need (keyed by the microbatch) instead of
computing them, and the graph is freed. W computes the weight gradients from the stash
and accumulates them through autograd. A whole backward computes them at once.

Each stage has an I/O spec: the shape and dtype of the activation it receives and the
one it sends (the gradients flowing back have the same), and which microbatch fields
its forward reads. Receive buffers are allocated from it, and the data iterator reads
the fields it lists.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.autograd import Variable

from ppctl.autograd.weight_grad import ComputedWeightGrads, WeightGradStore, attach_weight_grad_store

ForwardFn = Callable[[torch.nn.Module, "torch.Tensor | None", Any], torch.Tensor]
LossFn = Callable[[torch.Tensor, Any], "tuple[torch.Tensor, torch.Tensor]"]


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of one pipeline message."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        """Bytes of one message of this spec."""
        count = 1
        for size in self.shape:
            count *= size
        return count * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class StageIO:
    """What a stage receives, sends and reads.

    ``input``: the activation from the previous stage (None on the first stage, which
    reads data); its gradient goes back with the same spec. ``output``: the activation
    for the next stage (None on the last stage, which makes the loss); its gradient
    comes back with the same spec. ``fields``: the microbatch fields the forward and the
    loss read (names of the training side's data contract; the runtime does not read them).
    """

    input: TensorSpec | None
    output: TensorSpec | None
    fields: tuple[str, ...]


def release_output(output: torch.Tensor) -> None:
    """Free an output's storage after it was sent, keeping its ``grad_fn`` for the backward."""
    output.data = torch.empty((1,), device=output.device, dtype=output.dtype)


def run_backward(output: torch.Tensor, grad_output: torch.Tensor | None, inputs: tuple = (),
                 keep_graph: bool = False, accumulate: bool = True):
    """Run the autograd engine from ``output`` without the shape check of ``torch.autograd.backward``.

    A released output no longer has its gradient's shape (Megatron's ``custom_backward``).
    With ``inputs`` only their gradients are computed; with ``accumulate=False`` they are
    returned instead of added to ``.grad``.
    """
    if grad_output is None:
        grad_output = torch.ones_like(output)
    return Variable._execution_engine.run_backward(
        tensors=(output,), grad_tensors=(grad_output,), keep_graph=keep_graph, create_graph=False,
        inputs=inputs, allow_unreachable=True, accumulate_grad=accumulate,
    )


class PipelineStage:
    """One model chunk as a pipeline stage: forward, backward (whole or split) and evaluation.

    ``index`` is the global virtual stage; ``is_last`` says whether its output is the
    loss. Saved tensors are keyed by the microbatch's index (``key``).
    """

    def __init__(self, index: int, module: torch.nn.Module, io: StageIO, forward_fn: ForwardFn, is_last: bool,
                 split_backward: bool = False):
        self.index, self.module, self.io = index, module, io
        self.forward_fn, self.is_last = forward_fn, is_last
        self.is_first = io.input is None
        self.inputs: dict[int, torch.Tensor | None] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        # First stage only: B has no input gradient to make, so W runs the whole backward from here.
        self.pending_weight: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
        self.weight_grads = WeightGradStore()
        if split_backward:  # only then: the layers' split ops cost a small model's backward time
            attach_weight_grad_store(module, self.weight_grads)
        self._weights = tuple(param for param in module.parameters() if param.requires_grad)

    def forward(self, key: int, microbatch, stage_input: torch.Tensor | None,
                loss_fn: LossFn | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run the chunk for one microbatch, keeping what its backward needs.

        Returns ``(output, logged)``: the activation for the next stage and None, or on the
        last stage the loss to back-propagate and the value ``loss_fn`` reports.
        """
        if stage_input is not None:
            stage_input.requires_grad_()
        output = self.forward_fn(self.module, stage_input, microbatch)
        logged = None
        if self.is_last:
            output, logged = loss_fn(output, microbatch)
        self.inputs[key] = stage_input
        self.outputs[key] = output
        return output, logged

    def backward(self, key: int, grad_output: torch.Tensor | None) -> torch.Tensor | None:
        """Whole backward of one microbatch: weight gradients accumulated; returns the input gradient."""
        output, stage_input = self.outputs.pop(key), self.inputs.pop(key)
        run_backward(output, grad_output)
        return None if stage_input is None else stage_input.grad

    def backward_input(self, key: int, grad_output: torch.Tensor | None) -> torch.Tensor | None:
        """B of a split backward: the input gradient only; weight-gradient work is stashed for W, the graph freed.

        Layers that can defer stash their work; gradients of any other parameter are
        computed here (not accumulated) and kept for W, so B never touches ``param.grad``.
        """
        output, stage_input = self.outputs.pop(key), self.inputs.pop(key)
        if stage_input is None:
            # The first stage has no input gradient to send, and its word/position embeddings
            # cannot defer: its B only hands the graph to W, which runs the whole backward.
            self.pending_weight[key] = (output, grad_output)
            return None
        with self.weight_grads.defer(key):
            grad_input, *weight_grads = run_backward(output, grad_output, inputs=(stage_input, *self._weights),
                                                     accumulate=False)
            if any(grad is not None for grad in weight_grads):
                self.weight_grads.stash(ComputedWeightGrads(self._weights, tuple(weight_grads)))
        return grad_input

    def backward_weight(self, key: int, pause: Callable[[], None] = lambda: None) -> None:
        """W of a split backward: accumulate the weight gradients of a microbatch whose B has run (``pause()``
        between two layers' stashed work: ``WeightGradStore.accumulate``)."""
        if key in self.pending_weight:
            output, grad_output = self.pending_weight.pop(key)
            run_backward(output, grad_output)
        elif key in self.weight_grads:
            self.weight_grads.accumulate(key, pause)
        else:
            raise RuntimeError(f"stage {self.index}: W of microbatch {key} before its B (backward_input)")

    @torch.no_grad()
    def forward_only(self, microbatch, stage_input: torch.Tensor | None,
                     loss_fn: LossFn | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Evaluation: the forward without a graph and without keeping anything."""
        output = self.forward_fn(self.module, stage_input, microbatch)
        if self.is_last:
            return loss_fn(output, microbatch)
        return output, None

    def receive_spec(self, kind: str) -> TensorSpec:
        """The spec of a message this stage receives: an activation (``act``) or a gradient (``grad``)."""
        spec = self.io.input if kind == "act" else self.io.output
        if spec is None:
            raise ValueError(f"stage {self.index} receives no {kind} message")
        return spec

    def held_tensors(self) -> list[torch.Tensor]:
        """Every tensor kept between a forward and its backward, or a B and its W (for memory accounting)."""
        kept = [t for t in self.inputs.values() if t is not None] + list(self.outputs.values())
        return kept + [output for output, _ in self.pending_weight.values()] + self.weight_grads.held_tensors()

    def holds_work(self) -> bool:
        """Whether some forward still waits for its backward (or some B for its W)."""
        return bool(self.outputs or self.pending_weight or self.weight_grads.pending())
