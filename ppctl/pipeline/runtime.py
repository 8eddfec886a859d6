"""One executor for every schedule: walks a rank's steps of the lowered program over its pipeline stages.

The runtime is a table from action kind to handler; each handler calls one method of
a ``PipelineStage`` (``ppctl.pipeline.stage``), which knows its chunk and keeps what
passes between forward and backward. The runtime itself knows no model, no data
field and no loss: those come from the stages and the step's ``loss_fn``.

Per step (``ppctl.pipeline.program`` gives the protocol): take the inputs (received or
handed over on this rank), run the handler, then post the step's sends together with
its receives. A remotely sent activation is released right after sending, keeping
only its autograd node (Megatron's ``deallocate_output_tensor``).

With an ``interleave`` an overlapped pair (DualPipe's F&B) runs its two halves interleaved
(``ppctl.pipeline.interleave``): the backward in a second thread (it takes its inputs there, once
the batch that receives them is posted), the forward here, whose batch is posted as soon as it
ends; then the backward's batch. One half computes at a time, the turn changing at each posted
expert all-to-all (and TP or CP collective; each half's on its own communicators,
``ppctl.parallel.lanes``), so one half's exchange travels while the other computes. The batches go out in the program's
order, so the checked program's proof holds. A weight fill (ZB's W beside a backward,
``Schedule.with_weight_fills``) runs the same way: the backward here, the W in the second thread,
computing its layers' weight gradients while the backward's exchanges travel.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

import torch

from ppctl.pipeline.interleave import PairInterleave
from ppctl.pipeline.p2p import PipelineTransport
from ppctl.pipeline.program import Message, Program, Step
from ppctl.pipeline.schedules import BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, Action
from ppctl.pipeline.stage import LossFn, PipelineStage, release_output
from ppctl.pipeline.trace import FILL_LABEL, Tracer


@dataclass
class StepState:
    """What one run of a program reports: the summed logged loss, each microbatch's logged loss (on the
    last stage) and, when tracked, peak held bytes.

    ``local`` holds the tensors handed over on the rank, by message number.
    """

    logged: dict[int, torch.Tensor] = field(default_factory=dict)
    peak_held_bytes: int = 0
    local: dict[int, torch.Tensor] = field(default_factory=dict)

    @property
    def loss_sum(self) -> torch.Tensor | float:
        """The logged losses summed in the order the microbatches finished (0.0 off the last stage)."""
        return sum(self.logged.values(), 0.0)


Handler = Callable[[Step, list, StepState], "torch.Tensor | None"]


class ActionHooks(Protocol):
    """What a run calls around each action (a stream of several steps: which weights, when to update)."""

    def before(self, action: Action) -> None:
        """Called just before ``action`` runs."""

    def after(self, action: Action) -> None:
        """Called just after ``action`` ran and its messages were posted."""


class PipelineRuntime:
    """Runs rank ``pp_rank``'s steps of programs over ``stages`` (global stage -> ``PipelineStage``)."""

    def __init__(self, pp_rank: int, stages: dict[int, PipelineStage], transport: PipelineTransport,
                 tracer: Tracer | None = None, release_outputs: bool = True, track_memory: bool = False,
                 interleave: PairInterleave | None = None):
        self.pp_rank = pp_rank
        self.interleave = interleave  # runs overlapped pairs' halves interleaved; None: one after the other
        self.stages = stages
        self.transport = transport
        self.tracer = tracer
        self.release_outputs = release_outputs
        self.track_memory = track_memory
        self.loss_fns: Sequence[LossFn | None] = ()  # the current run's, per microbatch: set by ``run``
        self.microbatches: Sequence = ()
        self.messages: Sequence[Message] = ()  # the current program's message table
        self.handlers: dict[str, Handler] = {
            FORWARD: self._forward,
            BACKWARD: self._backward,
            BACKWARD_INPUT: self._backward_input,
            BACKWARD_WEIGHT: self._backward_weight,
        }
        self.forward_only_handlers: dict[str, Handler] = {FORWARD: self._forward_only}

    def run(self, program: Program, microbatches: Sequence, loss_fn: LossFn | Sequence[LossFn] | None,
            forward_only: bool = False, hooks: ActionHooks | None = None) -> StepState:
        """Execute this rank's steps of ``program``; returns the step state (logged losses on the last stage).

        ``loss_fn`` is the step's, or one per microbatch (a stream of steps, each with its normaliser).
        ``forward_only`` runs forwards without graphs (evaluation; the program holds F actions only).
        ``hooks`` are called around every action.
        """
        state = StepState()
        self.loss_fns = loss_fn if isinstance(loss_fn, Sequence) else [loss_fn] * len(microbatches)
        self.microbatches, self.messages = microbatches, program.messages
        handlers = self.forward_only_handlers if forward_only else self.handlers
        self.transport.post([], [self.messages[number] for number in program.initial_receives[self.pp_rank]])
        steps = program.steps[self.pp_rank]
        interleaved = self.overlap_pairs and not forward_only
        pairs = set(program.schedule.pair_starts(self.pp_rank)) if interleaved else set()
        fills = set(program.schedule.fill_starts(self.pp_rank)) if interleaved else set()
        index = 0
        while index < len(steps):
            if index in pairs or index in fills:
                run_two = self._run_pair if index in pairs else self._run_fill
                run_two(steps[index], steps[index + 1], handlers, state, hooks)
                index += 2
                continue
            step = steps[index]
            inputs = [self._input(number, state) for number in step.inputs]
            handler = self._handler(handlers, step)
            if hooks is not None:
                hooks.before(step.action)
            started = self.tracer.mark() if self.tracer is not None else None
            produced = handler(step, inputs, state)
            if self.tracer is not None:
                self.tracer.action(step.action, started)
            self._hand_over(step, produced, state)
            self._after(step, state, hooks)
            index += 1
        self.transport.finish()
        self._check_drained(state)
        return state

    @property
    def overlap_pairs(self) -> bool:
        """Whether overlapped pairs run their halves interleaved."""
        return self.interleave is not None

    @staticmethod
    def _handler(handlers: dict[str, Handler], step: Step) -> Handler:
        handler = handlers.get(step.action.kind)
        if handler is None:
            raise ValueError(f"the runtime has no handler for action kind {step.action.kind!r}")
        return handler

    def _after(self, step: Step, state: StepState, hooks: ActionHooks | None) -> None:
        if hooks is not None:
            hooks.after(step.action)
        if self.track_memory:
            state.peak_held_bytes = max(state.peak_held_bytes, self.held_bytes())

    def _run_pair(self, forward: Step, backward: Step, handlers: dict[str, Handler], state: StepState,
                  hooks: ActionHooks | None) -> None:
        """An overlapped pair's halves interleaved (module docstring): the backward in the pair thread."""
        forward_posted = threading.Event()
        if not set(backward.inputs) & set(forward.receives):
            forward_posted.set()  # its receives were posted by an earlier batch
        backward_inputs = []

        def take_backward_inputs():
            forward_posted.wait()
            backward_inputs.extend(self._input(number, state) for number in backward.inputs)

        def run_forward():
            try:
                started = self.tracer.mark() if self.tracer is not None else None
                produced = self._handler(handlers, forward)(forward, inputs, state)
                if self.tracer is not None:
                    self.tracer.action(forward.action, started)
                self._hand_over(forward, produced, state)
            finally:
                forward_posted.set()

        def run_backward():
            started = self.tracer.mark() if self.tracer is not None else None
            produced = self._handler(handlers, backward)(backward, backward_inputs, state)
            return produced, started, Tracer.mark() if self.tracer is not None else None

        inputs = [self._input(number, state) for number in forward.inputs]
        if hooks is not None:
            hooks.before(forward.action)
            hooks.before(backward.action)
        _, (produced, started, ended) = self.interleave.run(run_forward, run_backward, take_backward_inputs)
        if self.tracer is not None:
            self.tracer.action(backward.action, started, ended)
        self._hand_over(backward, produced, state)
        self._after(forward, state, hooks)
        self._after(backward, state, hooks)

    def _run_fill(self, backward: Step, weight: Step, handlers: dict[str, Handler], state: StepState,
                  hooks: ActionHooks | None) -> None:
        """A weight fill (module docstring): the backward here, holding the turn first, its batch posted as soon
        as it ends; the W in the pair thread, computing in the backward's exchange waits, then its batch."""
        inputs = [self._input(number, state) for number in backward.inputs]
        if hooks is not None:
            hooks.before(backward.action)
            hooks.before(weight.action)

        def run_backward():
            started = self.tracer.mark() if self.tracer is not None else None
            produced = self._handler(handlers, backward)(backward, inputs, state)
            if self.tracer is not None:
                self.tracer.action(backward.action, started)
            self._hand_over(backward, produced, state)

        def run_weight():
            started = self.tracer.mark() if self.tracer is not None else None
            action = weight.action
            self.stages[action.stage].backward_weight(action.microbatch, self.interleave.pause)
            return started, Tracer.mark() if self.tracer is not None else None

        _, (started, ended) = self.interleave.run(run_backward, run_weight,
                                                  labels=(f"{FILL_LABEL} {backward.action.kind}",
                                                          f"{FILL_LABEL} {weight.action.kind}"))
        if self.tracer is not None:
            self.tracer.action(weight.action, started, ended)
        self._hand_over(weight, None, state)
        self._after(backward, state, hooks)
        self._after(weight, state, hooks)

    def _input(self, number: int, state: StepState) -> torch.Tensor:
        """Input message ``number``: handed over on this rank, or received."""
        message = self.messages[number]
        if message.local:
            return state.local.pop(number)
        if self.tracer is None:
            return self.transport.take(message)
        started = time.perf_counter()
        tensor = self.transport.take(message)
        self.tracer.wait(started, time.perf_counter())
        return tensor

    # --- handlers: one per action kind --------------------------------------------------

    def _forward(self, step: Step, inputs: list, state: StepState) -> torch.Tensor | None:
        action = step.action
        stage = self.stages[action.stage]
        output, logged = stage.forward(action.microbatch, self.microbatches[action.microbatch],
                                       inputs[0] if inputs else None, self.loss_fns[action.microbatch])
        if logged is None:
            return output
        state.logged[action.microbatch] = logged.detach()
        return None

    def _forward_only(self, step: Step, inputs: list, state: StepState) -> torch.Tensor | None:
        action = step.action
        output, logged = self.stages[action.stage].forward_only(
            self.microbatches[action.microbatch], inputs[0] if inputs else None, self.loss_fns[action.microbatch])
        if logged is None:
            return output
        state.logged[action.microbatch] = logged
        return None

    def _backward(self, step: Step, inputs: list, state: StepState) -> torch.Tensor | None:
        action = step.action
        return self.stages[action.stage].backward(action.microbatch, inputs[0] if inputs else None)

    def _backward_input(self, step: Step, inputs: list, state: StepState) -> torch.Tensor | None:
        action = step.action
        return self.stages[action.stage].backward_input(action.microbatch, inputs[0] if inputs else None)

    def _backward_weight(self, step: Step, inputs: list, state: StepState) -> None:
        action = step.action
        self.stages[action.stage].backward_weight(action.microbatch)
        return None

    # --- communication ------------------------------------------------------------------------

    def _hand_over(self, step: Step, produced: torch.Tensor | None, state: StepState) -> None:
        """Post this step's sends with its receives; keep a local output in memory."""
        if step.local_output is not None:
            # The next stage runs on this rank: hand over a detached tensor, so the consumer's
            # input is a leaf whose gradient its backward can read (as for a received tensor).
            state.local[step.local_output] = produced.detach()
        messages = self.messages
        self.transport.post([(messages[number], produced) for number in step.sends],
                            [messages[number] for number in step.receives])
        if step.sends and step.action.kind == FORWARD and self.release_outputs and produced.requires_grad:
            release_output(produced)

    def held_bytes(self) -> int:
        """Bytes of distinct storages the stages keep between forwards and backwards."""
        storages = {}
        for stage in self.stages.values():
            for tensor in stage.held_tensors():
                storage = tensor.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
        return sum(storages.values())

    def _check_drained(self, state: StepState) -> None:
        """After a step nothing may be left: every forward met its backward, every hand-over its consumer."""
        unfinished = [stage.index for stage in self.stages.values() if stage.holds_work()]
        if unfinished or state.local:
            raise RuntimeError(f"the step ended with work left: stages {unfinished} hold activations, "
                               f"{len(state.local)} local hand-overs unused")
