"""Activation recomputation: which layers keep only their input and run their forward again in the backward.

``model.recompute`` (Megatron-LM's ``--recompute-granularity``):

- ``none``: every layer keeps what its backward needs;
- ``full``: groups of whole transformer layers keep only the group's input; the
  backward runs the group's forward again to rebuild the rest;
- ``selective``: only the attention core (softmax(QK^T)V, whose memory grows with the
  square of the sequence where no fused kernel runs) is recomputed.

With ``full``, ``model.recompute_method`` and ``model.recompute_num_layers`` pick the
groups within each model chunk, as Megatron-LM's ``--recompute-method`` and
``--recompute-num-layers`` do: ``uniform`` checkpoints consecutive groups of N layers
(the last may be shorter), ``block`` checkpoints each of the first N layers of the chunk
and keeps the rest.

This module is pure (the memory model reads it too); the layers recompute through
``ppctl.autograd.checkpoint.recomputed``, ``torch.utils.checkpoint`` without re-entry: the backward graph is
the one the first forward built, so a split backward (B, then W later) recomputes once,
in B (or in W where B hands the whole backward to W, on the first stage); B stashes the
recomputed tensors that W needs. The layers draw no random numbers (no dropout), so the
forward run again gives bitwise the same tensors and no RNG state is saved.
"""

from __future__ import annotations

from dataclasses import dataclass

from ppctl.config.schema import RECOMPUTE_METHODS, RECOMPUTE_MODES


@dataclass(frozen=True)
class Recompute:
    """What a model chunk recomputes in its backward (see the module docstring)."""

    mode: str = "none"
    method: str = "uniform"
    num_layers: int = 1

    def __post_init__(self):
        if self.mode not in RECOMPUTE_MODES:
            raise ValueError(f"recompute mode must be one of {', '.join(RECOMPUTE_MODES)}, got {self.mode!r}")
        if self.method not in RECOMPUTE_METHODS:
            raise ValueError(f"recompute method must be one of {', '.join(RECOMPUTE_METHODS)}, got {self.method!r}")
        if self.num_layers < 1:
            raise ValueError(f"recompute num_layers must be >= 1, got {self.num_layers}")

    @property
    def attention_core(self) -> bool:
        """Whether attention's core is recomputed (``selective``)."""
        return self.mode == "selective"

    def layer_groups(self, count: int) -> list[tuple[int, int, bool]]:
        """A chunk's ``count`` layers as runs ``(first, end, recomputed)`` of local indices, in order."""
        if self.mode != "full" or count == 0:
            return [(0, count, False)] if count else []
        if self.method == "uniform":
            return [(first, min(first + self.num_layers, count), True) for first in range(0, count, self.num_layers)]
        recomputed = min(self.num_layers, count)
        return [(index, index + 1, True) for index in range(recomputed)] + (
            [(recomputed, count, False)] if recomputed < count else [])
