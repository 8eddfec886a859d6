"""Steps as one stream (PipeDream-2BW): the pipeline runs on from one step into the next with no flush.

A stream of K steps is one lowered program of the schedule over K * m microbatches
(step t's are the m after step t-1's): the warm-up comes once, the cool-down once. The
runtime calls this stream around every action (``ActionHooks``): before an action of step
s the rank's parameters are pointed at W(s-1) (``WeightVersions.bind``); after the rank's
last backward of step t, the rank reduces that step's gradients over its replicas and
takes its optimizer step, writing W(t+1) over W(t-1), with no barrier across the pipeline.
The global gradient norms and the losses of the stream's steps are reduced once, when the
stream has drained: a rank waits for no other rank at a step boundary.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from ppctl.model.stages import MaskedTokenLoss
from ppctl.optim.delay import WeightVersions
from ppctl.optim.lr import learning_rate, set_learning_rate
from ppctl.pipeline.check import check_schedule
from ppctl.pipeline.program import Program
from ppctl.pipeline.schedules import BACKWARD, BACKWARD_WEIGHT, Action, stream_of


class StreamedStep(NamedTuple):
    """What one step of a stream gave: its loss and its trained-token count (None off the loss ranks), global grad
    norm and learning rate."""

    step: int
    loss: float | None
    grad_norm: float
    lr: float
    trained_tokens: float | None = None


class StepStream:
    """Runs consecutive steps of one trainer as one stream (``Trainer.train_steps`` for a streaming schedule)."""

    def __init__(self, trainer, versions: WeightVersions):
        self.trainer, self.versions = trainer, versions
        self.num_microbatches = trainer.data.num_microbatches
        self.programs: dict[int, Program] = {}
        self.first_step = 0
        self.backwards_left: dict[int, int] = {}
        self.squares: dict[int, torch.Tensor] = {}
        self.learning_rates: dict[int, float] = {}

    def program(self, num_steps: int) -> Program:
        """The checked program of a stream of ``num_steps`` steps (built once per length)."""
        if num_steps not in self.programs:
            self.programs[num_steps] = check_schedule(stream_of(self.trainer.schedule, num_steps))
        return self.programs[num_steps]

    def run(self, first_step: int, num_steps: int) -> list[StreamedStep]:
        """Train steps ``first_step`` .. ``first_step + num_steps - 1`` as one stream; what each step gave."""
        trainer = self.trainer
        microbatches, loss_fns, normalizers = self._inputs(first_step, num_steps)
        self.first_step = first_step
        local_backwards = self.num_microbatches * len(trainer.stages)
        self.backwards_left = {step: local_backwards for step in range(first_step, first_step + num_steps)}
        self.squares, self.learning_rates = {}, {}
        self.versions.start(first_step)
        trainer.optimizer.zero_grad()
        if trainer.tracer is not None:
            trainer.tracer.start_step()
        trainer.last_program = self.program(num_steps)
        state = trainer.runtime.run(trainer.last_program, microbatches, loss_fns, hooks=self)
        self.versions.finish(first_step + num_steps)
        trainer.last_step_state = state
        return self._results(state, normalizers)

    def _inputs(self, first_step: int, num_steps: int) -> tuple[list, list, list[float]]:
        """Every step's microbatches, one loss function per microbatch (its step's normaliser), the normalisers."""
        microbatches, loss_fns, normalizers = [], [], []
        for step in range(first_step, first_step + num_steps):
            step_microbatches, normalizer = self.trainer.batch(step, self.trainer.data)
            microbatches += step_microbatches
            loss_fns += [MaskedTokenLoss(normalizer)] * len(step_microbatches)
            normalizers.append(normalizer)
        return microbatches, loss_fns, normalizers

    def step_of(self, action: Action) -> int:
        """The step whose microbatch ``action`` computes."""
        return self.first_step + action.microbatch // self.num_microbatches

    def before(self, action: Action) -> None:
        """Point the parameters at the version the action's step runs on."""
        self.versions.bind(self.step_of(action))

    def after(self, action: Action) -> None:
        """After the rank's last backward of a step: that step's update."""
        if action.kind not in (BACKWARD, BACKWARD_WEIGHT):
            return
        step = self.step_of(action)
        self.backwards_left[step] -= 1
        if self.backwards_left[step] == 0:
            self._update(step)

    def _update(self, step: int) -> None:
        """Reduce the step's gradients over the replicas, keep their local square sum, write W(step+1)."""
        optimizer = self.trainer.optimizer
        optimizer.finish_grad_sync()
        self.squares[step] = optimizer.local_grad_squares()
        self.learning_rates[step] = learning_rate(step, self.trainer.lr_schedule)
        set_learning_rate(optimizer, self.learning_rates[step])
        self.versions.target(step)
        optimizer.step()
        optimizer.zero_grad()

    def _results(self, state, normalizers: list[float]) -> list[StreamedStep]:
        """The stream's steps: global norms and losses reduced once, now that the pipeline drained."""
        steps = sorted(self.squares)
        squares = torch.stack([self.squares[step] for step in steps])
        self.trainer.optimizer.sum_grad_squares(squares)
        norms = [math.sqrt(value) for value in squares.tolist()]
        losses = self._losses(state, normalizers)
        counts = normalizers if self.trainer.holds_loss else [None] * len(normalizers)
        return [StreamedStep(step, loss, norm, self.learning_rates[step], count)
                for step, loss, norm, count in zip(steps, losses, norms, counts)]

    def _losses(self, state, normalizers: list[float]) -> list:
        """Each step's global mean token loss on the loss ranks (summed over the replicas), None elsewhere."""
        if not self.trainer.holds_loss:
            return [None] * len(normalizers)
        sums = [0.0] * len(normalizers)
        for microbatch, logged in state.logged.items():
            sums[microbatch // self.num_microbatches] += float(logged)
        return [self.trainer.reduce_loss(total / normalizer) for total, normalizer in zip(sums, normalizers)]
