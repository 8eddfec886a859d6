"""The communication plan: every send and receive of a schedule, derived in one place.

Schedules only list computations. The messages follow from stage adjacency
(``ppctl.pipeline.messages``, the one place that knows it):

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

Internally the plan is built, checked and replayed as a ``NumberedPlan``: each distinct
message is a number (an index into its ``messages``), so nothing hashes messages on
the hot paths; ``plan_communication`` turns it into ``ActionStep``s of ``Message``s.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass
from functools import cached_property
from itertools import chain, filterfalse
from operator import add, attrgetter
from typing import Any, Callable, Iterable, NamedTuple, Optional, Sequence

from .messages import ACTIVATION, GRADIENT, Message, input_message, output_message
from .replay import NO_MESSAGE, Program, compile_schedule, gc_paused, run
from .schedules.base import Action, Schedule, ScheduleError

__all__ = ["ACTIVATION", "GRADIENT", "NO_MESSAGE", "ActionStep", "CommPlan", "Message", "NumberedPlan",
           "initial_receives", "input_message", "number_plan", "output_message", "plan_communication",
           "plan_numbered", "planned_sends", "posted_receives", "receive_order", "send_order"]


class ActionStep(NamedTuple):
    """One action of a rank with the messages around it (see the module docstring for the protocol).

    ``local_output`` is the message the action hands to a stage on its own rank (in
    memory, no point-to-point), or None.
    """

    action: Action
    waits: tuple[Message, ...]
    local_inputs: tuple[Message, ...]
    sends: tuple[Message, ...]
    prefetch: tuple[Message, ...]
    local_output: Optional[Message] = None


CommPlan = list[list[ActionStep]]

Column = list[list[tuple[int, ...]]]  # per rank, per step: message numbers


@dataclass
class NumberedPlan:
    """A plan whose messages are numbers (``messages[number]`` is the message), kept as columns.

    ``waits[rank][index]`` (likewise ``local_inputs``, ``sends``, ``prefetch``) are the
    numbers of that ``ActionStep`` field of ``actions[rank][index]``. ``local_outputs``
    holds, per step, the message its action hands to a stage on its own rank (or
    NO_MESSAGE); a replay needs it, and it is None for a plan numbered without its schedule.
    """

    messages: Sequence[Message]
    src_ranks: list[int]  # message number -> the rank that sends it
    dst_ranks: list[int]  # message number -> the rank that receives it
    actions: list[Sequence[Action]]
    waits: Column
    local_inputs: Column
    sends: Column
    prefetch: Column
    local_outputs: Optional[list[list[int]]]

    @property
    def num_ranks(self) -> int:
        """Number of pipeline ranks in the plan."""
        return len(self.actions)

    def send_order(self, src_rank: int, dst_rank: int) -> list[int]:
        """Messages ``src_rank`` sends to ``dst_rank``, in the order it posts them."""
        return list(self._sends_by_destination.get((src_rank, dst_rank), ()))

    @cached_property
    def _sends_by_destination(self) -> dict[tuple[int, int], list[int]]:
        """(rank, dst rank) -> ``send_order``: every rank's sends grouped in one pass."""
        dst_ranks = self.dst_ranks
        by_destination: dict[tuple[int, int], list[int]] = {}
        for src_rank, rank_sends in enumerate(self.sends):
            for numbers in rank_sends:
                for number in numbers:
                    sequence = by_destination.get((src_rank, dst_ranks[number]))
                    if sequence is None:
                        sequence = by_destination[src_rank, dst_ranks[number]] = []
                    sequence.append(number)
        return by_destination

    def initial_receives(self, pp_rank: int) -> tuple[int, ...]:
        """Receives ``pp_rank`` posts before its first action (see ``initial_receives``)."""
        return self._all_initial_receives[pp_rank]

    @cached_property
    def _all_initial_receives(self) -> list[tuple[int, ...]]:
        """``initial_receives`` of every rank (the checker and the replay both need them)."""
        return [self._initial_receives_of(pp_rank) for pp_rank in range(self.num_ranks)]

    def _initial_receives_of(self, pp_rank: int) -> tuple[int, ...]:
        """``initial_receives`` of ``pp_rank``, the send orders taken from ``_sends_by_destination``."""
        sends_to = self._sends_by_destination
        return _initial_receives(self.waits[pp_rank], self.prefetch[pp_rank], self.src_ranks.__getitem__,
                                 lambda src_rank: sends_to.get((src_rank, pp_rank), ()))

    def posted_receives(self, dst_rank: int) -> list[int]:
        """Every receive ``dst_rank`` posts, in order (see ``posted_receives``)."""
        return _posted_receives(self.initial_receives(dst_rank), self.waits[dst_rank], self.prefetch[dst_rank])

    def planned_sends(self) -> dict[tuple[int, int], list[int]]:
        """(src rank, dst rank) -> the messages src sends to dst, in the order it posts them."""
        return _pair_sequences(chain.from_iterable(self.sends), self.pairs.__getitem__)

    @cached_property
    def pairs(self) -> list[tuple[int, int]]:
        """Message number -> (the rank that sends it, the rank that receives it)."""
        return list(zip(self.src_ranks, self.dst_ranks))

    def as_messages(self, numbers: Sequence[int]) -> list[Message]:
        """The messages numbered ``numbers``, in order."""
        messages = self.messages
        return [messages[number] for number in numbers]

    def message_plan(self) -> CommPlan:
        """The plan of ``ActionStep``s: one Message object per message, shared by every step that names it."""
        alone = [(message,) for message in self.messages]  # most steps wait for, or send, one message or none
        messages = self.messages
        local_outputs = self.local_outputs or [[NO_MESSAGE] * len(actions) for actions in self.actions]
        return [[_new_action_step((action, _messages(waits, alone), _messages(local_inputs, alone),
                                   _messages(sends, alone), _messages(prefetch, alone),
                                   None if local_output == NO_MESSAGE else messages[local_output]))
                 for action, waits, local_inputs, sends, prefetch, local_output in zip(*columns)]
                for columns in zip(self.actions, self.waits, self.local_inputs, self.sends, self.prefetch,
                                   local_outputs)]


def _messages(numbers: tuple[int, ...], alone: list[tuple[Message]]) -> tuple[Message, ...]:
    """The messages numbered ``numbers``; ``alone[number]`` is the one-message tuple of each."""
    if not numbers:
        return ()
    if len(numbers) == 1:
        return alone[numbers[0]]
    return tuple([alone[number][0] for number in numbers])


def _new_action_step(fields: tuple) -> ActionStep:
    """An ActionStep from its six fields, without the keyword-handling constructor (plans hold many)."""
    return tuple.__new__(ActionStep, fields)


def number_plan(plan: CommPlan, schedule: Optional[Schedule] = None) -> NumberedPlan:
    """Number the distinct messages of ``plan`` (equal messages share a number).

    With ``schedule``, each step's local output (its action's output message when that
    stays on the rank, from stage adjacency) is numbered too: a replay needs it.
    """
    numbering = _Numbering()
    waits = [numbering.numbers(step.waits for step in rank_steps) for rank_steps in plan]
    local_inputs = [numbering.numbers(step.local_inputs for step in rank_steps) for rank_steps in plan]
    sends = [numbering.numbers(step.sends for step in rank_steps) for rank_steps in plan]
    prefetch = [numbering.numbers(step.prefetch for step in rank_steps) for rank_steps in plan]
    local_outputs = None
    if schedule is not None:
        local_outputs = [[numbering.local_output(schedule, step.action) for step in rank_steps]
                         for rank_steps in plan]
    messages = numbering.messages
    return NumberedPlan(messages, [message.src_rank for message in messages],
                        [message.dst_rank for message in messages],
                        [[step.action for step in rank_steps] for rank_steps in plan],
                        waits, local_inputs, sends, prefetch, local_outputs)


class _Numbering:
    """Gives each distinct message the next number."""

    def __init__(self) -> None:
        self.numbers_of: dict[Message, int] = {}
        self.messages: list[Message] = []

    def number(self, message: Message) -> int:
        """The number of ``message``, assigned on first sight."""
        number = self.numbers_of.get(message)
        if number is None:
            number = self.numbers_of[message] = len(self.messages)
            self.messages.append(message)
        return number

    def numbers(self, field: Iterable[tuple[Message, ...]]) -> list[tuple[int, ...]]:
        """One ActionStep field of each step, messages replaced by their numbers."""
        number = self.number
        return [tuple([number(message) for message in messages]) if messages else () for messages in field]

    def local_output(self, schedule: Schedule, action: Action) -> int:
        """The number of the message ``action`` hands over on its own rank, or NO_MESSAGE."""
        output = output_message(schedule, action)
        return NO_MESSAGE if output is None or not output.local else self.number(output)


# --- deriving the plan ----------------------------------------------------------------------

@gc_paused
def plan_communication(schedule: Schedule) -> CommPlan:
    """Derive every rank's sends, waits and prefetched receives from the schedule's actions.

    Raises ``ScheduleError`` when an action needs a message that no action produces.
    """
    return plan_numbered(schedule).message_plan()


def plan_numbered(schedule: Schedule) -> NumberedPlan:
    """``plan_communication`` with message numbers: the form the checker and the replay work on."""
    program = compile_schedule(schedule)  # every message numbered once, by stage adjacency
    messages = program.messages
    src_ranks, dst_ranks = messages.src_ranks(), messages.dst_ranks()
    sends = [[sends for _, _, _, sends, _, _ in rank_steps] for rank_steps in program.steps]
    local_outputs = [[local_output for _, _, local_output, _, _, _ in rank_steps] for rank_steps in program.steps]
    produced = _produced(len(messages), sends, local_outputs)
    waits, local_inputs = _split_inputs(program, src_ranks, dst_ranks, produced)
    prefetch = _prefetch(waits, sends, run(program).ends, src_ranks, dst_ranks)
    return NumberedPlan(messages, src_ranks, dst_ranks, program.actions, waits, local_inputs, sends, prefetch,
                        local_outputs)


def _produced(num_messages: int, sends: Column, local_outputs: list[list[int]]) -> bytearray:
    """Message number -> 1 when some action produces it (sends it or hands it over), else 0."""
    produced = bytearray(num_messages)
    for rank_outputs in local_outputs:
        for number in rank_outputs:
            if number != NO_MESSAGE:
                produced[number] = 1
    for rank_sends in sends:
        for numbers in rank_sends:
            for number in numbers:
                produced[number] = 1
    return produced


def _split_inputs(program: Program, src_ranks: list[int], dst_ranks: list[int],
                  produced: bytearray) -> tuple[Column, Column]:
    """Each bare action's input as a wait (remote) or a local input; ScheduleError if nothing produces it."""
    waits, local_inputs = [], []
    for pp_rank, rank_steps in enumerate(program.steps):
        rank_waits, rank_local_inputs = [], []
        for index, (inputs, _, _, _, _, _) in enumerate(rank_steps):
            if not inputs:
                rank_waits.append(())
                rank_local_inputs.append(())
                continue
            number = inputs[0]  # a bare action has at most one input
            if not produced[number]:
                raise ScheduleError(_unproduced(pp_rank, program.actions[pp_rank][index],
                                                program.messages[number]))
            local = src_ranks[number] == dst_ranks[number]
            rank_waits.append(() if local else inputs)
            rank_local_inputs.append(inputs if local else ())
        waits.append(rank_waits)
        local_inputs.append(rank_local_inputs)
    return waits, local_inputs


def _unproduced(pp_rank: int, action: Action, message: Message) -> str:
    """The error for an action whose input no action produces."""
    return (f"rank {pp_rank}: {action} needs {message.kind} of microbatch {action.microbatch} "
            f"from stage {message.src_stage}, which no action produces")


def _prefetch(waits: Column, sends: Column, ends: list[list[float]], src_ranks: list[int],
              dst_ranks: list[int]) -> Column:
    """Per rank and step, the receives posted in the batch after the step (slot i + 1 of ``_receive_slots``)."""
    slots = _receive_slots(waits, sends, ends, src_ranks, dst_ranks)
    return [[tuple(posted) for posted in rank_slots[1:]] for rank_slots in slots]


def _receive_slots(waits: Column, sends: Column, ends: list[list[float]], src_ranks: list[int],
                   dst_ranks: list[int]) -> list[list[list[int]]]:
    """Per rank, slot 0 (initial) and slot i + 1 (after action i): the receives (numbers) posted there.

    A receive goes in the batch the receiver issues when, in the unit-cost replay
    (``ends``), the sender sends the message; at the latest in the batch before the
    action that needs it. Per sender, slots never decrease along its send order.
    """
    send_time = _send_times(sends, ends, len(src_ranks))
    needed_at = [{number: index for index, numbers in enumerate(rank_waits) for number in numbers}
                 for rank_waits in waits]
    slots: list[list[list[int]]] = [[[] for _ in range(len(rank_waits) + 1)] for rank_waits in waits]
    sequences = _pair_sequences(chain.from_iterable(sends), list(zip(src_ranks, dst_ranks)).__getitem__)
    for (_, dst_rank), sequence in sequences.items():
        wanted = _wanted_slots(sequence, send_time, ends[dst_rank], needed_at[dst_rank], len(waits[dst_rank]))
        rank_slots = slots[dst_rank]
        for number, slot in zip(sequence, _suffix_minimum(wanted)):
            rank_slots[slot].append(number)
    for rank_slots in slots:
        for posted in rank_slots:  # stable: each sender's messages stay in send order
            if len(posted) > 1:
                posted.sort(key=lambda number: (send_time[number], src_ranks[number]))
    return slots


def _wanted_slots(sequence: list[int], send_time: list[float], receiver_ends: list[float],
                  needed_at: dict[int, int], never: int) -> list[int]:
    """Each message's slot at its receiver: when it is sent, at the latest before the action needing it."""
    wanted = []
    for number in sequence:
        sent = bisect_right(receiver_ends, send_time[number])  # receiver actions done by the send
        needed = needed_at.get(number, never)
        wanted.append(needed if needed < sent else sent)
    return wanted


def _send_times(sends: Column, ends: list[list[float]], num_messages: int) -> list[float]:
    """Message number -> when the replay's sender finished sending it (infinity: never sent)."""
    send_time = [float("inf")] * num_messages
    for rank_sends, rank_ends in zip(sends, ends):
        for numbers, end in zip(rank_sends, rank_ends):  # the actions that ran
            for number in numbers:
                send_time[number] = end
    return send_time


def _suffix_minimum(values: list[int]) -> list[int]:
    """Each value lowered to the smallest value after it, so the list never decreases."""
    result, smallest = [], float("inf")
    for value in reversed(values):
        if value < smallest:
            smallest = value
        result.append(smallest)
    return result[::-1]


# --- the runtime protocol: which receives a rank posts, and in which order ------------------------

def initial_receives(plan: CommPlan, pp_rank: int) -> tuple[Message, ...]:
    """Receives ``pp_rank`` posts before its first action: those no step's prefetch posts.

    Per sender these are a prefix of its send sequence, in that order.
    """
    steps = plan[pp_rank]
    return _initial_receives([step.waits for step in steps], [step.prefetch for step in steps],
                             attrgetter("src_rank"), lambda src_rank: send_order(plan, src_rank, pp_rank))


def send_order(plan: CommPlan, src_rank: int, dst_rank: int) -> list[Message]:
    """Messages ``src_rank`` sends to ``dst_rank``, in the order it posts them."""
    return [message for step in plan[src_rank] for message in step.sends if message.dst_rank == dst_rank]


def posted_receives(plan: CommPlan, dst_rank: int) -> list[Message]:
    """Every receive ``dst_rank`` posts, from all senders, in the order the runtime protocol posts them.

    Initial receives, then per step: the waits not yet posted, then the prefetch.
    """
    steps = plan[dst_rank]
    return _posted_receives(initial_receives(plan, dst_rank), [step.waits for step in steps],
                            [step.prefetch for step in steps])


def receive_order(plan: CommPlan, dst_rank: int, src_rank: int) -> list[Message]:
    """Messages ``dst_rank`` receives from ``src_rank``, in the order it posts the receives."""
    return [message for message in posted_receives(plan, dst_rank) if message.src_rank == src_rank]


def planned_sends(plan: CommPlan) -> dict[tuple[int, int], list[Message]]:
    """(src rank, dst rank) -> the messages src sends to dst, in the order it posts them."""
    return _pair_sequences((step.sends for steps in plan for step in steps), attrgetter("src_rank", "dst_rank"))


# The rules above, written once for a plan of Messages and for a NumberedPlan: the messages
# (or numbers) come as one rank's per-step waits and prefetch, their ranks through accessors.

def _initial_receives(waits: Sequence[tuple], prefetch: Sequence[tuple], src_rank_of: Callable[[Any], int],
                      send_order_from: Callable[[int], Iterable]) -> tuple:
    """Per sender the rank waits for (in rank order), its sends to this rank that no step prefetches."""
    prefetched = set(chain.from_iterable(prefetch))
    senders = sorted(set(map(src_rank_of, chain.from_iterable(waits))))
    return tuple(filterfalse(prefetched.__contains__, chain.from_iterable(map(send_order_from, senders))))


def _posted_receives(initial: tuple, waits: Sequence[tuple], prefetch: Sequence[tuple]) -> list:
    """The initial receives, then each wait or prefetch at its first appearance, unless posted initially."""
    first_posts = dict.fromkeys(chain.from_iterable(map(add, waits, prefetch)))
    return list(initial) + list(filterfalse(set(initial).__contains__, first_posts))


def _pair_sequences(sends: Iterable[tuple], pair_of: Callable[[Any], tuple[int, int]]
                    ) -> dict[tuple[int, int], list]:
    """(src rank, dst rank) -> the messages sent, in the order of ``sends`` (each rank's, in step order)."""
    sequences: dict[tuple[int, int], list] = {}
    for items in sends:
        for item in items:
            pair = pair_of(item)
            sequence = sequences.get(pair)
            if sequence is None:
                sequence = sequences[pair] = []
            sequence.append(item)
    return sequences
