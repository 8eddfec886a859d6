"""Point-to-point transport for pipeline messages: batched non-blocking sends and receives.

The communication plan (``pipeline/comm.py``) decides what is sent and received and in
which order; this module only moves tensors. Every batch (the sends of one action and
the receives posted ahead for the next) goes through one ``batch_isend_irecv`` call,
so crossing send/receive pairs between two ranks are issued together, on gloo and
NCCL alike. Shapes and dtypes are static, given per message by the receiving stage's
I/O spec, so no shape exchange.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.distributed as dist

from ppctl.pipeline.comm import Message
from ppctl.pipeline.stage import TensorSpec


class PipelineTransport:
    """Posts receives into fresh buffers, sends tensors, and hands out received tensors by message.

    ``peer_rank(pp_rank)`` maps a pipeline rank to the global rank in this pipeline group;
    ``receive_spec(message)`` gives the shape and dtype of a message this rank receives.
    """

    def __init__(self, peer_rank: Callable[[int], int], receive_spec: Callable[[Message], TensorSpec], device):
        self.peer_rank = peer_rank
        self.receive_spec = receive_spec
        self.device = device
        self.pending_receives: dict[Message, tuple[list, torch.Tensor]] = {}
        self.pending_sends: list[tuple[object, torch.Tensor]] = []  # (work, payload kept alive until done)

    def post(self, sends: Sequence[tuple[Message, torch.Tensor]], receives: Sequence[Message]) -> None:
        """Issue ``sends`` then ``receives`` as one batch; nothing blocks here."""
        operations, payloads = [], []
        for message, tensor in sends:
            # A stage may hand over a strided view (a sequence-parallel reduce-scatter with
            # micro_batch_size > 1, for one); the wire needs contiguous memory.
            payloads.append(tensor.detach().contiguous())
            operations.append(dist.P2POp(dist.isend, payloads[-1], self.peer_rank(message.dst_rank)))
        new_buffers = []
        for message in receives:
            if message in self.pending_receives:
                continue
            spec = self.receive_spec(message)
            buffer = torch.empty(spec.shape, dtype=spec.dtype, device=self.device)
            operations.append(dist.P2POp(dist.irecv, buffer, self.peer_rank(message.src_rank)))
            new_buffers.append((message, buffer))
        if not operations:
            return
        works = dist.batch_isend_irecv(operations)
        if len(works) != len(operations):
            # A coalescing backend (NCCL) returns one work for the whole batch: every
            # receive of the batch then waits on it.
            send_works, receive_works = works[:1] * len(sends), [works] * len(new_buffers)
        else:
            send_works, receive_works = works[: len(sends)], [[work] for work in works[len(sends):]]
        self.pending_sends.extend(zip(send_works, payloads))
        for (message, buffer), batch_works in zip(new_buffers, receive_works):
            self.pending_receives[message] = (batch_works, buffer)
        self._drop_completed_sends()

    def take(self, message: Message) -> torch.Tensor:
        """Wait for a posted receive and return its tensor (posting it first if the plan did not)."""
        if message not in self.pending_receives:
            self.post([], [message])
        works, buffer = self.pending_receives.pop(message)
        for work in works:
            work.wait()
        return buffer

    def _drop_completed_sends(self) -> None:
        self.pending_sends = [(work, payload) for work, payload in self.pending_sends if not work.is_completed()]

    def finish(self) -> None:
        """Wait for every outstanding send; the step's buffers are then free."""
        for work, _payload in self.pending_sends:
            work.wait()
        self.pending_sends.clear()
        if self.pending_receives:
            leftover = ", ".join(str(message) for message in self.pending_receives)
            raise RuntimeError(f"receives posted but never used: {leftover}")
