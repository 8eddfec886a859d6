"""The learning-rate schedule: linear warm-up, then constant, linear or cosine decay (Megatron-LM's shapes).

Pure: no torch. ``learning_rate(step, schedule)`` is the learning rate that optimizer
step ``step`` (0-based: the first step of a run is step 0) uses. With peak ``L``, minimum
``m``, ``W`` warm-up steps and ``D`` decay steps:

- warm-up, ``step < W``: ``L * (step + 1) / W``. Megatron-LM uses ``L * n / W`` with ``n``
  the steps already taken, so its first step runs at lr 0; shifting the ramp one step
  earlier gives the first step ``L / W`` and the last warm-up step (``W - 1``) the peak;
- ``constant``, ``step >= W``: ``L`` (``m`` and ``D`` play no part, as in Megatron-LM);
- ``step > D``: ``m``;
- otherwise (``W <= step <= D``): ``ratio = (step - W) / (D - W)`` and
  ``m + coeff * (L - m)`` with ``coeff = 1 - ratio`` (``linear``) or
  ``coeff = (cos(pi * ratio) + 1) / 2`` (``cosine``), exactly Megatron-LM's decay.

So step ``W`` also runs at the peak, and the decay reaches ``m`` at step ``D``: in a run of
``D`` steps (``decay_steps`` defaults to ``trainer.max_steps``) the last step, ``D - 1``,
still has a learning rate above ``m`` (none of the run's steps is wasted at lr 0).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DECAY_STYLES = ("constant", "linear", "cosine")


@dataclass(frozen=True)
class LRSchedule:
    """A learning-rate schedule: ``peak`` after ``warmup_steps``, decaying to ``minimum`` at ``decay_steps``."""

    peak: float
    minimum: float
    warmup_steps: int
    decay_steps: int
    style: str

    def __post_init__(self):
        if self.style not in DECAY_STYLES:
            raise ValueError(f"style={self.style!r} must be one of {', '.join(DECAY_STYLES)}")
        if self.peak <= 0:
            raise ValueError(f"peak={self.peak} must be positive")
        if not 0 <= self.minimum <= self.peak:
            raise ValueError(f"minimum={self.minimum} must be in 0..peak={self.peak}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps={self.warmup_steps} must be >= 0")
        if self.decay_steps <= self.warmup_steps:
            raise ValueError(f"decay_steps={self.decay_steps} must be greater than warmup_steps={self.warmup_steps}")


def learning_rate(step: int, schedule: LRSchedule) -> float:
    """The learning rate optimizer step ``step`` (0-based) uses; the formulas are in the module docstring."""
    if step < 0:
        raise ValueError(f"step={step} must be >= 0")
    peak, warmup = schedule.peak, schedule.warmup_steps
    if step < warmup:
        return peak * (step + 1) / warmup
    if schedule.style == "constant":
        return peak
    if step > schedule.decay_steps:
        return schedule.minimum
    ratio = (step - warmup) / (schedule.decay_steps - warmup)
    coefficient = 1.0 - ratio if schedule.style == "linear" else 0.5 * (math.cos(math.pi * ratio) + 1.0)
    return schedule.minimum + coefficient * (peak - schedule.minimum)


def lr_schedule_of(config) -> LRSchedule:
    """The schedule a ``PpctlConfig`` asks for (``optimizer.decay_steps`` unset: ``trainer.max_steps``)."""
    optimizer = config.optimizer
    decay_steps = optimizer.decay_steps if optimizer.decay_steps is not None else config.trainer.max_steps
    return LRSchedule(peak=optimizer.lr, minimum=optimizer.min_lr, warmup_steps=optimizer.warmup_steps,
                      decay_steps=decay_steps, style=optimizer.lr_decay_style)


def set_learning_rate(optimizer, lr: float) -> None:
    """Give every parameter group of a ``torch.optim`` optimizer the learning rate ``lr``."""
    for group in optimizer.param_groups:
        group["lr"] = lr
