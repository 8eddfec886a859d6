"""One executor for every schedule: walks a rank's steps of the lowered program over its pipeline stages.

The runtime is a table from action kind to handler. Its own handler (``run_in_order``) runs
each step through its action kind's computation, which calls one method of a ``PipelineStage``
(``ppctl.pipeline.stage``), which knows its chunk and keeps what passes between forward and
backward. The runtime itself knows no model, no data field and no loss: those come from the
stages and the step's ``loss_fn``.

Per step (``ppctl.pipeline.program`` gives the protocol): take the inputs (received or
handed over on this rank), compute, then post the step's sends together with
its receives. A remotely sent activation is released right after sending, keeping
only its autograd node (Megatron's ``deallocate_output_tensor``).

The table also holds the two-step actions a schedule marks (torch.distributed.pipelining's
``OVERLAP_F_B``): an overlapped pair (``OVERLAP_F_B``: DualPipe's F&B) and a weight fill
(``WEIGHT_FILL``: ZB's W beside a backward, ``Schedule.with_weight_fills``). Their handler runs the
two steps one after the other unless one of their own is registered (``register``): the
expert-exchange overlap's (``ppctl.pipeline.overlap``) runs them interleaved.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Protocol, Sequence

import torch

from ppctl.pipeline.p2p import PipelineTransport
from ppctl.pipeline.program import Message, Program, Step
from ppctl.pipeline.schedules import ACTION_KINDS, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, Action
from ppctl.pipeline.stage import LossFn, PipelineStage, release_output
from ppctl.pipeline.trace import Tracer

# The two-step actions: an overlapped pair (an F and a backward) and a weight fill (a backward and a W), each two
# consecutive steps of a rank (``Schedule.pair_starts`` and ``Schedule.fill_starts``).
OVERLAP_F_B = "OVERLAP_F_B"
WEIGHT_FILL = "WEIGHT_FILL"


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


Computation = Callable[[Step, list, StepState], "torch.Tensor | None"]  # one action's, on its inputs
# Runs one entry of a rank's steps (one step, or a two-step action's two) on the runtime it is given.
Handler = Callable[["PipelineRuntime", Sequence[Step], StepState], None]


class ActionHooks(Protocol):
    """What a run calls around each action (a stream of several steps: which weights, when to update)."""

    def before(self, action: Action) -> None:
        """Called just before ``action`` runs."""

    def after(self, action: Action) -> None:
        """Called just after ``action`` ran and its messages were posted."""


class PipelineRuntime:
    """Runs rank ``pp_rank``'s steps of programs over ``stages`` (global stage -> ``PipelineStage``).

    ``track_memory``: after each action the step state's ``peak_held_bytes`` notes the bytes the stages hold
    (``held_bytes``), or what a callable given instead returns (a fake-tensor rank's meter:
    ``ppctl.run.fake_rank``).
    """

    def __init__(self, pp_rank: int, stages: dict[int, PipelineStage], transport: PipelineTransport,
                 tracer: Tracer | None = None, release_outputs: bool = True,
                 track_memory: bool | Callable[[], int] = False):
        self.pp_rank = pp_rank
        self.stages = stages
        self.transport = transport
        self.tracer = tracer
        self.release_outputs = release_outputs
        self.track_memory = track_memory
        self.loss_fns: Sequence[LossFn | None] = ()  # the current run's, per microbatch: set by ``run``
        self.microbatches: Sequence = ()
        self.messages: Sequence[Message] = ()  # the current program's message table
        self.hooks: ActionHooks | None = None  # the current run's
        self.computations: dict[str, Computation] = {
            FORWARD: self._forward,
            BACKWARD: self._backward,
            BACKWARD_INPUT: self._backward_input,
            BACKWARD_WEIGHT: self._backward_weight,
        }
        self.forward_only_computations: dict[str, Computation] = {FORWARD: self._forward_only}
        self.run_computations: dict[str, Computation] = self.computations  # the current run's (``run``)
        self.handlers: dict[str, Handler] = {kind: PipelineRuntime.run_in_order
                                             for kind in (*ACTION_KINDS, OVERLAP_F_B, WEIGHT_FILL)}

    def register(self, kind: str, handler: Handler) -> None:
        """Run the actions of ``kind`` through ``handler(runtime, steps, state)`` (a two-step kind: ``OVERLAP_F_B`` or
        ``WEIGHT_FILL``)."""
        if kind not in (OVERLAP_F_B, WEIGHT_FILL):
            raise ValueError(f"the runtime runs action kind {kind!r} itself; only {OVERLAP_F_B} and {WEIGHT_FILL} "
                             f"take a handler of their own")
        self.handlers[kind] = handler

    def run(self, program: Program, microbatches: Sequence, loss_fn: LossFn | Sequence[LossFn] | None,
            forward_only: bool = False, hooks: ActionHooks | None = None) -> StepState:
        """Execute this rank's steps of ``program``; returns the step state (logged losses on the last stage).

        ``loss_fn`` is the step's, or one per microbatch (a stream of steps, each with its normaliser).
        ``forward_only`` runs forwards without graphs (evaluation; the program holds F actions only).
        ``hooks`` are called around every action.
        """
        state = StepState()
        self.loss_fns = loss_fn if isinstance(loss_fn, Sequence) else [loss_fn] * len(microbatches)
        self.microbatches, self.messages, self.hooks = microbatches, program.messages, hooks
        self.run_computations = self.forward_only_computations if forward_only else self.computations
        self.transport.post([], [self.messages[number] for number in program.initial_receives[self.pp_rank]])
        for kind, steps in self._entries(program):
            handler = self.handlers.get(kind)
            if handler is None:
                raise ValueError(f"the runtime has no handler for action kind {kind!r}")
            handler(self, steps, state)
        self.transport.finish()
        self._check_drained(state)
        return state

    def _entries(self, program: Program) -> Iterator[tuple[str, Sequence[Step]]]:
        """This rank's steps as the table's entries: each overlapped pair's and weight fill's two steps as one
        action of its two-step kind, every other step alone under its own kind."""
        steps = program.steps[self.pp_rank]
        starts = dict.fromkeys(program.schedule.pair_starts(self.pp_rank), OVERLAP_F_B)
        starts.update(dict.fromkeys(program.schedule.fill_starts(self.pp_rank), WEIGHT_FILL))
        index = 0
        while index < len(steps):
            kind = starts.get(index)
            if kind is None:
                yield steps[index].action.kind, steps[index:index + 1]
                index += 1
            else:
                yield kind, steps[index:index + 2]
                index += 2

    @property
    def overlap_pairs(self) -> bool:
        """Whether overlapped pairs run other than one step after the other (a handler of their own)."""
        return self.handlers[OVERLAP_F_B] is not PipelineRuntime.run_in_order

    def run_in_order(self, steps: Sequence[Step], state: StepState) -> None:
        """The runtime's own handler: each step in turn takes its inputs, computes and posts its batch."""
        for step in steps:
            inputs = self.inputs(step, state)
            self.before(step)
            started = self.mark()
            produced = self.computation(step)(step, inputs, state)
            self.traced(step, started)
            self.hand_over(step, produced, state)
            del inputs, produced  # posted: the step's messages die with it, before ``after`` measures what is held
            self.after(step, state)

    # --- what a handler runs a step with ----------------------------------------------------

    def computation(self, step: Step) -> Computation:
        """The current run's computation of ``step``'s action kind."""
        computation = self.run_computations.get(step.action.kind)
        if computation is None:
            raise ValueError(f"the runtime has no handler for action kind {step.action.kind!r}")
        return computation

    def inputs(self, step: Step, state: StepState) -> list[torch.Tensor]:
        """``step``'s input messages: handed over on this rank, or received (waiting for them)."""
        return [self._input(number, state) for number in step.inputs]

    def before(self, step: Step) -> None:
        """Told before ``step`` runs: the current run's hooks."""
        if self.hooks is not None:
            self.hooks.before(step.action)

    def after(self, step: Step, state: StepState) -> None:
        """Told after ``step`` ran and its batch was posted: the hooks, and the peak of held memory when tracked."""
        if self.hooks is not None:
            self.hooks.after(step.action)
        if self.track_memory:
            held = self.track_memory() if callable(self.track_memory) else self.held_bytes()
            state.peak_held_bytes = max(state.peak_held_bytes, held)

    def mark(self) -> tuple[float, float] | None:
        """An action's start (``Tracer.mark``) when tracing, else None (called on the thread that computes it)."""
        return Tracer.mark() if self.tracer is not None else None

    def traced(self, step: Step, started, ended=None) -> None:
        """Record ``step``'s action from ``started`` to now, or to ``ended`` (``Tracer.action``), when tracing."""
        if self.tracer is not None:
            self.tracer.action(step.action, started, ended)

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

    # --- computations: one per action kind --------------------------------------------------

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

    def hand_over(self, step: Step, produced: torch.Tensor | None, state: StepState) -> None:
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
