"""Dynamic loss scaling for fp16 training (as Megatron-LM's and torch.amp's grad scalers).

fp16 keeps 5 exponent bits: small gradients underflow to zero unless the loss is
multiplied by a large scale before the backward (and the gradients divided by it
after). Too large a scale overflows instead; the non-finite gradient norm it causes is
the signal: that step is skipped and the scale halved. After ``growth_interval`` good
steps in a row the scale doubles again, so it stays near the largest safe value.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DynamicLossScaler:
    """The current loss scale and how it moves: backed off on an overflow, grown after a run of good steps."""

    scale: float = 2.0 ** 16
    growth_interval: int = 1000
    min_scale: float = 1.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    good_steps: int = 0

    def __post_init__(self):
        if self.scale < self.min_scale or self.min_scale <= 0:
            raise ValueError(f"loss scale {self.scale} must be >= min_scale {self.min_scale} > 0")
        if self.growth_interval < 1:
            raise ValueError(f"growth_interval must be >= 1, got {self.growth_interval}")

    def is_overflow(self, grad_norm_finite: bool) -> bool:
        """Whether a non-finite norm is an overflow of the scale (skip and back off), not a real fault.

        At the minimum scale there is nothing left to back off: the gradients themselves are broken.
        """
        return not grad_norm_finite and self.scale > self.min_scale

    def update(self, finite: bool) -> None:
        """After a step: halve the scale on an overflow; double it after ``growth_interval`` good steps."""
        if not finite:
            self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            self.good_steps = 0
            return
        self.good_steps += 1
        if self.good_steps == self.growth_interval:
            self.scale *= self.growth_factor
            self.good_steps = 0

    def state_dict(self) -> dict:
        """What moves during training (``Stateful``): the scale and the run of good steps."""
        return {"scale": self.scale, "good_steps": self.good_steps}

    def load_state_dict(self, state: dict) -> None:
        """Continue from a ``state_dict()``."""
        self.scale, self.good_steps = float(state["scale"]), int(state["good_steps"])
