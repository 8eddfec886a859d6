"""Point-to-point transport for pipeline messages: batched non-blocking sends and receives.

The lowered program (``pipeline/program.py``) decides what is sent and received and in
which order; this module only moves tensors. Every batch (the sends of one action and
the receives posted ahead for the next) goes through one ``batch_isend_irecv`` call,
so crossing send/receive pairs between two ranks are issued together, on gloo and
NCCL alike. Shapes and dtypes are static, given per message by the receiving stage's
I/O spec, so no shape exchange.

Every wait for a message has a time limit (the transport's ``timeout_s``, by default the
process group's): a peer that is stuck, or gone, fails this rank with one line naming the
rank, the message and the peer, instead of hanging. On CUDA the wait is untimed, so that it
stays a stream wait; the process group's timeout bounds it there.
"""

from __future__ import annotations

import datetime
import re
import time
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from ppctl.pipeline.program import ACTIVATION, GRADIENT, Message
from ppctl.pipeline.stage import TensorSpec

MESSAGE_KINDS = {ACTIVATION: "activation", GRADIENT: "gradient"}


class MessageWaitError(RuntimeError):
    """A pipeline message that did not arrive (or leave) in time, or whose peer went away."""


class PipelineTransport:
    """Posts receives into fresh buffers, sends tensors, and hands out received tensors by message.

    ``peer_rank(pp_rank)`` maps a pipeline rank to the global rank in this pipeline group;
    ``receive_spec(message)`` gives the shape and dtype of a message this rank receives;
    ``timeout_s`` bounds each wait for a message (None: the process group's timeout, which gloo
    applies to a wait by itself).
    """

    def __init__(self, peer_rank: Callable[[int], int], receive_spec: Callable[[Message], TensorSpec], device,
                 timeout_s: float | None = None):
        self.peer_rank = peer_rank
        self.receive_spec = receive_spec
        self.device = device
        # On CUDA an untimed wait is a stream wait (no host block); a timed one would block the CPU
        # thread until the transfer completes. There the process group's timeout and NCCL's watchdog
        # catch a stuck peer instead.
        self.timeout_s = None if torch.device(device).type == "cuda" else timeout_s
        self.pending_receives: dict[Message, tuple[list, torch.Tensor]] = {}
        # (work, payload kept alive until done, message)
        self.pending_sends: list[tuple[object, torch.Tensor, Message]] = []

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
        self.pending_sends.extend(zip(send_works, payloads, [message for message, _ in sends]))
        for (message, buffer), batch_works in zip(new_buffers, receive_works):
            self.pending_receives[message] = (batch_works, buffer)
        self._drop_completed_sends()

    def take(self, message: Message) -> torch.Tensor:
        """Wait for a posted receive and return its tensor (the checked program posted it before)."""
        works, buffer = self.pending_receives.pop(message)
        for work in works:
            self._wait(work, message, receiving=True)
        return buffer

    def _drop_completed_sends(self) -> None:
        self.pending_sends = [pending for pending in self.pending_sends if not pending[0].is_completed()]

    def finish(self) -> None:
        """Wait for every outstanding send; the step's buffers are then free."""
        for work, _payload, message in self.pending_sends:
            self._wait(work, message, receiving=False)
        self.pending_sends.clear()
        if self.pending_receives:
            leftover = ", ".join(str(message) for message in self.pending_receives)
            raise RuntimeError(f"receives posted but never used: {leftover}")

    def _wait(self, work, message: Message, receiving: bool) -> None:
        """Wait for one send or receive; a timeout or a transport error becomes one line naming the message."""
        started = time.monotonic()
        try:
            if self.timeout_s is None:
                work.wait()
            else:
                work.wait(timeout=datetime.timedelta(seconds=self.timeout_s))
        except RuntimeError as error:
            raise MessageWaitError(self._describe(message, receiving, error, time.monotonic() - started)) from error

    def _describe(self, message: Message, receiving: bool, error: RuntimeError, waited_s: float) -> str:
        """``rank 1: no activation of microbatch 0 (stage 0->1) from rank 0 within 2 s ...``."""
        peer = self.peer_rank(message.src_rank if receiving else message.dst_rank)
        what = (f"{MESSAGE_KINDS.get(message.kind, message.kind)} of microbatch {message.microbatch} "
                f"(stage {message.src_stage}->{message.dst_stage})")
        reason = transport_reason(error)
        if "timed out" in reason.lower():
            limit = f"{self.timeout_s:g} s" if self.timeout_s is not None else "the process group's timeout"
            verb = f"no {what} from rank {peer}" if receiving else f"{what} not taken by rank {peer}"
            return (f"rank {dist.get_rank()}: {verb} within {limit} (waited {waited_s:.1f} s); that rank is stuck "
                    "or slow (launcher.timeout_s sets the limit)")
        action = f"receiving {what} from" if receiving else f"sending {what} to"
        return f"rank {dist.get_rank()}: {action} rank {peer} failed after {waited_s:.1f} s: {reason}"


def transport_reason(error: BaseException) -> str:
    """The gist of a backend error: its first sentence, without gloo's ``[file.cc:123]`` prefix."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    text = re.sub(r"^\[[^\]]*\]\s*", "", text)
    return text.split(". ")[0]
