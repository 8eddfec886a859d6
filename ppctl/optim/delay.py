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
