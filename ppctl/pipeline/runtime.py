"""One executor for every schedule: walks a rank's communication plan over its model chunks.

Per action (see ``pipeline/comm.py`` for the protocol):
- ``F``: the first stage reads the microbatch's tokens, others take the received (or
  local) activation; the last stage turns per-token losses into the masked loss sum
  divided by the global batch's loss-token count, so the accumulated gradient equals
  the full-batch mean-token-loss gradient. A remotely sent output is released right
  after sending, keeping only its autograd node (Megatron's ``deallocate_output_tensor``).
- ``BW``: backward through the autograd engine directly (the released output no
  longer has the gradient's shape), then send the input gradient upstream.
Inputs and outputs are kept per (stage, microbatch) until their backward, FIFO per chunk.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch.autograd import Variable

from ppctl.pipeline.comm import ActionStep, Message
from ppctl.pipeline.p2p import PipelineTransport
from ppctl.pipeline.trace import Tracer


def release_output(output: torch.Tensor) -> None:
    """Free an output's storage after it was sent, keeping its ``grad_fn`` for the backward."""
    output.data = torch.empty((1,), device=output.device, dtype=output.dtype)


def backward_from(output: torch.Tensor, grad_output: torch.Tensor | None) -> None:
    """Run the autograd engine from ``output`` without the shape check ``torch.autograd.backward`` does."""
    if grad_output is None:
        grad_output = torch.ones_like(output)
    Variable._execution_engine.run_backward(
        tensors=(output,), grad_tensors=(grad_output,), keep_graph=False, create_graph=False,
        inputs=(), allow_unreachable=True, accumulate_grad=True,
    )


@dataclass
class StepState:
    """What one step keeps between a microbatch's forward and its backward."""

    inputs: dict[tuple[int, int], torch.Tensor | None] = field(default_factory=dict)
    outputs: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    local: dict[tuple[str, int, int], torch.Tensor] = field(default_factory=dict)
    loss_sum: float = 0.0
    peak_held_bytes: int = 0


class PipelineRuntime:
    """Runs one rank's plan. ``chunks`` maps each global stage this rank holds to its module."""

    def __init__(
        self,
        plan: Sequence[ActionStep],
        initial_receives: Sequence[Message],
        chunks: dict[int, torch.nn.Module],
        num_stages: int,
        transport: PipelineTransport,
        tracer: Tracer | None = None,
        default_position_ids: torch.Tensor | None = None,
        release_outputs: bool = True,
        track_memory: bool = False,
    ):
        self.plan = list(plan)
        self.initial_receives = list(initial_receives)
        self.chunks = chunks
        self.last_stage = num_stages - 1
        self.transport = transport
        self.tracer = tracer
        self.default_position_ids = default_position_ids  # for stages that get no data (rotary needs positions)
        self.release_outputs = release_outputs
        self.track_memory = track_memory

    def run_step(self, microbatches: Sequence, loss_normalizer: float) -> StepState:
        """Execute every action of one step; returns the step state (loss sum on the last stage)."""
        state = StepState()
        self.transport.post([], self.initial_receives)
        for step in self.plan:
            inputs = [self._input(message, state) for message in step.waits + step.local_inputs]
            started = time.perf_counter() if self.tracer is not None else 0.0
            kind = step.action.kind
            if kind == "F":
                produced = self._forward(step, inputs, microbatches, loss_normalizer, state)
            elif kind == "BW":
                produced = self._backward(step, inputs, state)
            else:
                raise ValueError(f"the runtime cannot run action kind {kind!r} yet")
            if self.tracer is not None:
                self.tracer.action(step.action, started, time.perf_counter())
            self._hand_over(step, produced, state)
            if self.track_memory:
                state.peak_held_bytes = max(state.peak_held_bytes, held_bytes(state))
        self.transport.finish()
        return state

    def _input(self, message: Message, state: StepState) -> torch.Tensor:
        if message.local:
            return state.local.pop((message.kind, message.src_stage, message.microbatch))
        if self.tracer is None:
            return self.transport.take(message)
        started = time.perf_counter()
        tensor = self.transport.take(message)
        self.tracer.wait(started, time.perf_counter())
        return tensor

    def _forward(self, step: ActionStep, inputs, microbatches, loss_normalizer: float, state: StepState):
        stage, index = step.action.stage, step.action.microbatch
        microbatch = microbatches[index]
        chunk_input = None if stage == 0 else inputs[0].requires_grad_()
        is_last = stage == self.last_stage
        position_ids = microbatch.position_ids if microbatch.position_ids is not None else self.default_position_ids
        output = self.chunks[stage](
            microbatch.tokens if stage == 0 else chunk_input,
            position_ids=position_ids,
            labels=microbatch.labels if is_last else None,
        )
        if is_last:
            loss_sum = (output * microbatch.loss_mask.to(output.dtype)).sum()
            output = loss_sum / loss_normalizer
            state.loss_sum += float(loss_sum.detach())
        state.inputs[(stage, index)] = chunk_input
        state.outputs[(stage, index)] = output
        return output

    def _backward(self, step: ActionStep, inputs, state: StepState):
        stage, index = step.action.stage, step.action.microbatch
        output = state.outputs.pop((stage, index))
        chunk_input = state.inputs.pop((stage, index))
        backward_from(output, None if stage == self.last_stage else inputs[0])
        return None if chunk_input is None else chunk_input.grad

    def _hand_over(self, step: ActionStep, produced, state: StepState) -> None:
        """Post this action's sends with the receives for the next action; keep a local output in memory."""
        action = step.action
        has_consumer = produced is not None and not (action.kind == "F" and action.stage == self.last_stage)
        if has_consumer and not step.sends:
            # The next stage runs on this rank: hand over a detached tensor, so the consumer's
            # input is a leaf whose gradient its backward can read (as for a received tensor).
            kind = "act" if action.kind == "F" else "grad"
            state.local[(kind, action.stage, action.microbatch)] = produced.detach()
        self.transport.post([(message, produced) for message in step.sends], step.prefetch)
        if step.sends and action.kind == "F" and self.release_outputs:
            release_output(produced)


def held_bytes(state: StepState) -> int:
    """Bytes of distinct storages held by the step's saved inputs and outputs."""
    storages = {}
    for tensor in list(state.inputs.values()) + list(state.outputs.values()):
        if tensor is not None:
            storage = tensor.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())
