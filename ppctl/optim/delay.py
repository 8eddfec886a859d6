"""Delayed gradients (``optimizer.gradient_delay=1``): PipeDream-2BW's update with two weight versions.

PipeDream-2BW (Narayanan et al., "Memory-Efficient Pipeline-Parallel DNN Training") keeps
two versions of the weights so that its pipeline never flushes: every microbatch of step t
runs its forward and backward on the version before the last update, and the update is

    W(t+1) = W(t) - lr * g_t(W(t-1)),  with W(-1) = W(0)

(one step of delay; "lr * g" is whatever the optimizer does with the gradient, AdamW here).
``DelayedWeights`` gives any run those semantics: the gradients of a step are computed on
the previous version, then the current one is restored and updated. The single-process
reference uses it too, so a delayed run at any layout is compared with its own kind.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Mapping

import torch


class DelayedWeights:
    """The previous version of named parameters, swapped in while a step's gradients are computed (``Stateful``)."""

    def __init__(self, parameters: Mapping[str, torch.Tensor]):
        self.parameters = dict(parameters)
        self.previous = {name: param.detach().clone() for name, param in self.parameters.items()}  # W(-1) = W(0)

    @contextmanager
    def on_previous(self) -> Iterator[None]:
        """Inside: the parameters hold W(t-1). On leaving: W(t) again, and W(t) becomes the previous version."""
        current = {name: param.detach().clone() for name, param in self.parameters.items()}
        self._write(self.previous)
        try:
            yield
        finally:
            self._write(current)
            self.previous = current

    def _write(self, values: Mapping[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, param in self.parameters.items():
                param.copy_(values[name])

    def state_dict(self) -> dict:
        """``previous``: the version the next step's gradients are computed on, by name (the tensors themselves)."""
        return {"previous": self.previous}

    def load_state_dict(self, state: dict) -> None:
        """Take a saved previous version (copied into this one's tensors unless they are the same)."""
        for name, tensor in state["previous"].items():
            if tensor is not self.previous[name]:
                self.previous[name].copy_(tensor)


class WeightVersions:
    """PipeDream-2BW's two weight versions of one rank, in two flat parameter buffers (``Stateful``).

    The optimizer is a ``BucketedOptimizer``: its parameters are views into one flat buffer,
    and its step writes the updated parameters into ``param_data``. Here there are two such
    buffers. In a stream that starts at step ``a``, W(a) (the weights after ``a`` updates)
    is in buffer ``current`` and W(a-1) in the other; W(k) lives in ``current`` when k - a is
    even. An action of step s runs on W(s-1) (``bind``: every parameter's ``.data`` is pointed
    at that buffer, which leaves autograd's version counters alone, so graphs built on one
    version run their backward on it again); the update of step t writes W(t+1) into the
    buffer of W(t-1), whose last user, step t, has finished on this rank (``target``).
    Microbatches of step t+1 in flight keep W(t) untouched.
    """

    def __init__(self, optimizer):
        self.optimizer = optimizer
        self.slots = optimizer.slots
        self.buffers = [optimizer.param_data, optimizer.param_data.clone()]  # W(-1) = W(0)
        self.current, self.first_step, self.bound = 0, 0, 0

    def start(self, first_step: int) -> None:
        """A stream begins at ``first_step``: W(first_step) is the current version."""
        self.first_step = first_step

    def _buffer_of(self, version: int) -> int:
        return self.current ^ ((version - self.first_step) & 1)

    def bind(self, step: int) -> None:
        """Point the parameters at W(step - 1), the version step ``step``'s microbatches run on."""
        index = self._buffer_of(step - 1)
        if index == self.bound:
            return
        for slot in self.slots:
            slot.param.data = self.buffers[index][slot.start:slot.end].view_as(slot.param)
        self.bound = index

    def target(self, step: int) -> None:
        """Make the optimizer's next update (step ``step``'s) write W(step + 1), over W(step - 1)."""
        self.optimizer.param_data = self.buffers[self._buffer_of(step + 1)]

    def finish(self, end_step: int) -> None:
        """The stream ended after step ``end_step - 1``: W(end_step) becomes current, and the parameters hold it."""
        self.current = self._buffer_of(end_step)
        self.first_step = end_step
        self.optimizer.param_data = self.buffers[self.current]
        self.bind(end_step + 1)

    def state_dict(self) -> dict:
        """``previous``: the version before the current one, by name (views into its buffer), as ``DelayedWeights``."""
        previous = self.buffers[1 - self.current]
        return {"previous": {slot.name: previous[slot.start:slot.end].view_as(slot.param) for slot in self.slots}}

    def load_state_dict(self, state: dict) -> None:
        """Take a saved previous version (of this class or of ``DelayedWeights``)."""
        own = self.state_dict()["previous"]
        for name, tensor in state["previous"].items():
            if tensor is not own[name]:
                own[name].copy_(tensor)
