"""The communication plan: every send and receive of a schedule, derived in one place.

Schedules only list computations. The messages follow from stage adjacency:

- the output of ``F(s, mb)`` is the input of ``F(s + 1, mb)``: an ``act`` message
  from the owner of stage s to the owner of stage s + 1;
- the input gradient made by the backward (``B`` or ``BW``) of ``(s, mb)`` is the
  input of the backward of ``(s - 1, mb)``: a ``grad`` message going the other way.

A message between two stages on the same rank is *local* (handed over in memory).
Remote messages are point-to-point, and NCCL (like gloo) matches them by order, not
by tag: for every ordered pair of ranks (src -> dst), dst must post its receives in
exactly the order src posts its sends. The plan guarantees this by construction:
per sender, receives are posted in its send order (when a receive is needed, every
earlier message of that sender is posted with it).

How a runtime executes the plan of one rank (``plan[pp_rank]``):

1. Before the first action, post ``initial_receives(plan, pp_rank)`` (irecv) as one batch.
2. For each ``ActionStep`` in order:
   a. post (irecv) any message of ``waits`` not yet posted, in the order listed
      (never needed for plans built here; kept so hand-made plans stay safe);
   b. wait for every receive in ``waits`` to complete;
   c. compute ``action``, taking ``local_inputs`` from this rank's own memory;
   d. issue ``sends`` (isend) and ``prefetch`` (irecv) together as ONE batch
      (``batch_isend_irecv``), sends first, each in the order given; skip empty
      batches; never post a receive twice.
3. Never block on a send before the end of the step; after the last action, wait
   for every outstanding send.

Where receives go. On NCCL all batched point-to-point operations of a rank run on
one stream, one batch after the other, and a send only completes once the peer has
posted the matching receive. Posting each receive just before it is needed can then
hang (a rank's send waits for a receive its peer posts only after it got something
queued behind that send). So a receive is posted in the batch the receiver issues
when, in a unit-cost replay of the schedule, the sender sends it (at the latest in
the batch before the action that needs it): the batches of two neighbours line up
like Megatron's paired send/receive calls, crossing pairs land in the same batch,
and ``ppctl.pipeline.check`` proves the plan runs under that NCCL-like model.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass, field
from typing import Iterable, NamedTuple, Optional

from .schedules.base import BACKWARD, BACKWARD_INPUT, FORWARD, Action, Schedule, ScheduleError

ACTIVATION = "act"
GRADIENT = "grad"


@dataclass(frozen=True)
class Message:
    """One tensor handed from one stage to the next (``act``) or the previous (``grad``)."""

    kind: str
    src_stage: int
    dst_stage: int
    microbatch: int
    src_rank: int
    dst_rank: int
    step: int = 0
    _hash: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Plans hash messages hundreds of thousands of times: compute the hash once.
        object.__setattr__(self, "_hash", hash((self.src_stage, self.dst_stage, self.microbatch, self.step)))

    def __hash__(self) -> int:
        return self._hash

    @property
    def local(self) -> bool:
        """True when producer and consumer run on the same rank (no point-to-point message)."""
        return self.src_rank == self.dst_rank

    def __str__(self) -> str:
        return (f"{self.kind} mb {self.microbatch} stage {self.src_stage}->{self.dst_stage} "
                f"(rank {self.src_rank}->{self.dst_rank})")


@dataclass(frozen=True)
class ActionStep:
    """One action of a rank with the messages around it (see the module docstring for the protocol)."""

    action: Action
    waits: tuple[Message, ...]
    local_inputs: tuple[Message, ...]
    sends: tuple[Message, ...]
    prefetch: tuple[Message, ...]


CommPlan = list[list[ActionStep]]


def input_message(schedule: Schedule, action: Action) -> Optional[Message]:
    """The message ``action`` consumes, or None (first-stage forward, last-stage backward, W)."""
    stages = _input_stages(action, schedule.num_stages)
    return None if stages is None else _message(schedule, action, *stages)


def output_message(schedule: Schedule, action: Action) -> Optional[Message]:
    """The message ``action`` produces, or None (last-stage forward, first-stage backward, W)."""
    stages = _output_stages(action, schedule.num_stages)
    return None if stages is None else _message(schedule, action, *stages)


def _input_stages(action: Action, num_stages: int) -> Optional[tuple[str, int, int]]:
    if action.kind == FORWARD and action.stage > 0:
        return ACTIVATION, action.stage - 1, action.stage
    if action.kind in (BACKWARD, BACKWARD_INPUT) and action.stage < num_stages - 1:
        return GRADIENT, action.stage + 1, action.stage
    return None


def _output_stages(action: Action, num_stages: int) -> Optional[tuple[str, int, int]]:
    if action.kind == FORWARD and action.stage < num_stages - 1:
        return ACTIVATION, action.stage, action.stage + 1
    if action.kind in (BACKWARD, BACKWARD_INPUT) and action.stage > 0:
        return GRADIENT, action.stage, action.stage - 1
    return None


def _message(schedule: Schedule, action: Action, kind: str, src_stage: int, dst_stage: int) -> Message:
    return Message(kind, src_stage, dst_stage, action.microbatch,
                   schedule.placement[src_stage], schedule.placement[dst_stage], action.step)


def plan_communication(schedule: Schedule) -> CommPlan:
    """Derive every rank's sends, waits and prefetched receives from the schedule's actions.

    Raises ``ScheduleError`` when an action needs a message that no action produces.
    """
    flows = _message_flows(schedule)
    slots = _receive_slots(schedule, flows)
    return [
        [ActionStep(action, waits, local_inputs, sends, tuple(slots[pp_rank][index + 1]))
         for index, (action, waits, local_inputs, sends) in enumerate(rank_flows)]
        for pp_rank, rank_flows in enumerate(flows)
    ]


class _Flow(NamedTuple):
    """An ActionStep before its prefetch is known."""

    action: Action
    waits: tuple[Message, ...]
    local_inputs: tuple[Message, ...]
    sends: tuple[Message, ...]


def _message_flows(schedule: Schedule) -> list[list[_Flow]]:
    """Every rank's actions with their input and output messages (one Message object per message)."""
    outputs = [[output_message(schedule, action) for action in rank_actions] for rank_actions in schedule.actions]
    produced = {(m.src_stage, m.dst_stage, m.microbatch, m.step): m
                for rank_outputs in outputs for m in rank_outputs if m is not None}
    return [[_flow(schedule, pp_rank, action, output, produced)
             for action, output in zip(rank_actions, outputs[pp_rank])]
            for pp_rank, rank_actions in enumerate(schedule.actions)]


def _flow(schedule: Schedule, pp_rank: int, action: Action, output: Optional[Message],
          produced: dict[tuple, Message]) -> _Flow:
    sends = (output,) if output is not None and output.src_rank != output.dst_rank else ()
    stages = _input_stages(action, schedule.num_stages)
    if stages is None:
        return _Flow(action, (), (), sends)
    message = produced.get((stages[1], stages[2], action.microbatch, action.step))
    if message is None:
        raise ScheduleError(f"rank {pp_rank}: {action} needs {stages[0]} of microbatch {action.microbatch} "
                            f"from stage {stages[1]}, which no action produces")
    if message.src_rank == message.dst_rank:
        return _Flow(action, (), (message,), sends)
    return _Flow(action, (message,), (), sends)


def _receive_slots(schedule: Schedule, flows: list[list[_Flow]]) -> list[list[list[Message]]]:
    """Per rank, slot 0 (initial) and slot i + 1 (after action i): the receives posted there.

    A receive goes in the batch the receiver issues when, in a unit-cost replay of
    the schedule, the sender sends the message; at the latest in the batch before
    the action that needs it. Per sender, slots never decrease along its send order.
    """
    from .simulate import replay  # the one replay engine; it imports this module

    ends = replay(schedule).ends
    send_time = {message: ends[pp_rank][index]
                 for pp_rank, rank_flows in enumerate(flows)
                 for index, flow in enumerate(rank_flows[:len(ends[pp_rank])]) for message in flow.sends}
    needed_at = [{message: index for index, flow in enumerate(rank_flows) for message in flow.waits}
                 for rank_flows in flows]
    slots: list[list[list[Message]]] = [[[] for _ in range(len(rank_flows) + 1)] for rank_flows in flows]
    all_sends = (flow.sends for rank_flows in flows for flow in rank_flows)
    for (_, dst_rank), sequence in _pair_sequences(all_sends).items():
        wanted = [min(needed_at[dst_rank].get(message, len(flows[dst_rank])),
                      bisect_right(ends[dst_rank], send_time.get(message, float("inf"))))
                  for message in sequence]
        for message, slot in zip(sequence, _suffix_minimum(wanted)):
            slots[dst_rank][slot].append(message)
    for rank_slots in slots:
        for posted in rank_slots:  # stable: each sender's messages stay in send order
            if len(posted) > 1:
                posted.sort(key=lambda message: (send_time.get(message, float("inf")), message.src_rank))
    return slots


def _suffix_minimum(values: list[int]) -> list[int]:
    """Each value lowered to the smallest value after it, so the list never decreases."""
    result, smallest = [], float("inf")
    for value in reversed(values):
        smallest = min(smallest, value)
        result.append(smallest)
    return result[::-1]


def _pair_sequences(sends_in_order: Iterable[tuple[Message, ...]]) -> dict[tuple[int, int], list[Message]]:
    """(src rank, dst rank) -> messages in the order given (each rank's sends in its action order)."""
    sequences: dict[tuple[int, int], list[Message]] = {}
    for sends in sends_in_order:
        for message in sends:
            sequences.setdefault((message.src_rank, message.dst_rank), []).append(message)
    return sequences


def initial_receives(plan: CommPlan, pp_rank: int) -> tuple[Message, ...]:
    """Receives ``pp_rank`` posts before its first action: those no step's prefetch posts.

    Per sender these are a prefix of its send sequence, in that order.
    """
    steps = plan[pp_rank]
    prefetched = {message for step in steps for message in step.prefetch}
    senders = sorted({message.src_rank for step in steps for message in step.waits})
    return tuple(
        message
        for src_rank in senders
        for message in send_order(plan, src_rank, pp_rank)
        if message not in prefetched
    )


def send_order(plan: CommPlan, src_rank: int, dst_rank: int) -> list[Message]:
    """Messages ``src_rank`` sends to ``dst_rank``, in the order it posts them."""
    return [message for step in plan[src_rank] for message in step.sends if message.dst_rank == dst_rank]


def posted_receives(plan: CommPlan, dst_rank: int) -> list[Message]:
    """Every receive ``dst_rank`` posts, from all senders, in the order the runtime protocol posts them.

    Initial receives, then per step: the waits not yet posted, then the prefetch.
    """
    posted = list(initial_receives(plan, dst_rank))
    seen = set(posted)
    for step in plan[dst_rank]:
        for message in step.waits + step.prefetch:
            if message not in seen:
                seen.add(message)
                posted.append(message)
    return posted


def receive_order(plan: CommPlan, dst_rank: int, src_rank: int) -> list[Message]:
    """Messages ``dst_rank`` receives from ``src_rank``, in the order it posts the receives."""
    return [message for message in posted_receives(plan, dst_rank) if message.src_rank == src_rank]


def planned_sends(plan: CommPlan) -> dict[tuple[int, int], list[Message]]:
    """(src rank, dst rank) -> the messages src sends to dst, in the order it posts them."""
    return _pair_sequences(step.sends for steps in plan for step in steps)
