"""The lowered program: a schedule's computations with every send and receive made explicit.

A schedule lists computations only. ``lower`` turns it, once, into a ``Program``, the
one form that the checker, the simulator, the runtime, the drawings and the trace read:

- ``messages[n]`` is message number n: one tensor handed from a stage to the next
  (``act``) or the previous (``grad``). Each step names its messages by number.
- ``initial_receives[rank]``: the receives ``rank`` posts, as one batch, before its
  first action.
- ``steps[rank]``: its actions in order, each a ``Step``: the messages the action takes
  (``inputs``: received from another rank, or handed over in memory by a stage of its
  own rank), the one it hands over in memory (``local_output``), and the batch it posts
  right after: its ``sends`` and the ``receives`` posted ahead for later steps.

How a rank runs its program: post ``initial_receives``; then per step wait for its
received inputs (their receives were posted by an earlier batch), take its local
inputs from memory, compute, keep the local output, and post the sends and receives as
one batch (sends first, each in the order given); after the last step, wait for every
send. A rank never posts a receive twice and never blocks on a send before the end.

Where messages come from: stage adjacency, here and nowhere else. The output of
``F(s, mb)`` is the input of ``F(s + 1, mb)``; the input gradient a backward (``B`` or
``BW``) of ``(s, mb)`` makes is the input of the backward of ``(s - 1, mb)``; ``W``
takes and makes no message. Stages are adjacent only within one model copy
(``Placement.copies``: DualPipe holds two): the first stage of each copy reads the
tokens and the last computes the loss.

Where receives go. NCCL (like gloo) matches point-to-point messages by order, not by
tag: per ordered pair of ranks the receiver must post its receives in the order the
sender posts its sends. On NCCL all batches of a rank also run one after another on one
stream, and a send completes only once the peer posted its receive, so posting each
receive just before it is needed can hang. ``lower`` posts a receive in the batch the
receiver issues when, in a unit-cost replay of the schedule, the sender sends it (at
the latest in the batch before the action that needs it), never earlier than the
previous message of the same sender: the batches of neighbours line up like Megatron's
paired send/receive calls, and ``ppctl.pipeline.check`` proves the program runs under
an NCCL-like model.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass
from functools import cached_property
from itertools import chain, repeat
from typing import NamedTuple, Optional

from .replay import Costs, StepGraph, TimedProgram, action_durations, gc_paused, run_timed
from .schedules.base import BACKWARD, BACKWARD_INPUT, FORWARD, Action, Schedule, ScheduleError

ACTIVATION = "act"
GRADIENT = "grad"

# Where an action's output goes, in stages; its input comes from the other side. W: no message.
_OUTPUT_STEP = {FORWARD: 1, BACKWARD: -1, BACKWARD_INPUT: -1}


class Message(NamedTuple):
    """One tensor handed from one stage to the next (``act``) or the previous (``grad``)."""

    kind: str
    src_stage: int
    dst_stage: int
    microbatch: int
    src_rank: int
    dst_rank: int

    @property
    def local(self) -> bool:
        """True when producer and consumer run on the same rank (handed over in memory)."""
        return self.src_rank == self.dst_rank

    def __str__(self) -> str:
        return (f"{self.kind} mb {self.microbatch} stage {self.src_stage}->{self.dst_stage} "
                f"(rank {self.src_rank}->{self.dst_rank})")


class Step(NamedTuple):
    """One action of a rank with the messages around it; messages are numbers (``Program.messages``)."""

    action: Action
    inputs: tuple[int, ...]  # received from another rank, or handed over by a stage of this rank
    local_output: Optional[int]  # handed over in memory to a stage of this rank
    sends: tuple[int, ...]  # posted after the action, with ``receives``, as one batch
    receives: tuple[int, ...]


@dataclass(frozen=True)
class Program:
    """A schedule lowered to per-rank steps with explicit sends and receives (see the module docstring)."""

    schedule: Schedule
    messages: tuple[Message, ...]
    initial_receives: tuple[tuple[int, ...], ...]
    steps: tuple[tuple[Step, ...], ...]

    @property
    def num_ranks(self) -> int:
        """Number of pipeline ranks."""
        return len(self.steps)

    def posted_receives(self, rank: int) -> list[int]:
        """Every receive ``rank`` posts, in order: the initial batch, then each step's."""
        return list(chain(self.initial_receives[rank], *(step.receives for step in self.steps[rank])))

    def sends_by_pair(self) -> dict[tuple[int, int], list[int]]:
        """(src rank, dst rank) -> the messages src sends to dst, in the order it posts them."""
        return _by_pair(((rank, step.sends) for rank, steps in enumerate(self.steps) for step in steps),
                        self.dst_ranks, sender_known=True)

    def receives_by_pair(self) -> dict[tuple[int, int], list[int]]:
        """(src rank, dst rank) -> the messages dst receives from src, in the order it posts the receives."""
        return _by_pair(((rank, self.posted_receives(rank)) for rank in range(self.num_ranks)),
                        self.src_ranks, sender_known=False)

    @cached_property
    def src_ranks(self) -> list[int]:
        """Message number -> the rank that sends it."""
        return [message.src_rank for message in self.messages]

    @cached_property
    def dst_ranks(self) -> list[int]:
        """Message number -> the rank that receives it."""
        return [message.dst_rank for message in self.messages]

    @cached_property
    def graph(self) -> Optional[StepGraph]:
        """The steps as a ``StepGraph`` for buffered replays (None where ``StepGraph.of`` says), made once."""
        columns = [([step.inputs for step in steps], [step.local_output for step in steps],
                    [step.sends for step in steps]) for steps in self.steps]
        return StepGraph.of(self.schedule.actions, columns, len(self.messages))

    def timed(self, costs: Costs = Costs(), pairs_as_one: bool = False) -> TimedProgram:
        """The program against ``costs``, for the replay engine (``ppctl.pipeline.replay``)."""
        columns = [tuple(zip(*rank_steps))[1:] or ((),) * 4 for rank_steps in self.steps]  # less the actions
        return TimedProgram.of(self.schedule, self.messages, self.initial_receives, columns, costs, pairs_as_one)

    def to_json(self) -> dict:
        """The program as plain data: the placement, the message table, then per rank its initial receives and steps."""
        placement = self.schedule.placement
        return {
            "placement": {"owners": list(placement.owners), "copies": placement.copies},
            "messages": [message._asdict() for message in self.messages],
            "ranks": [{"rank": rank, "initial_receives": list(self.initial_receives[rank]),
                       "overlapped": list(self.schedule.pair_starts(rank)),
                       "filled": list(self.schedule.fill_starts(rank)),
                       "steps": [_step_json(step) for step in steps]}
                      for rank, steps in enumerate(self.steps)],
        }


def _step_json(step: Step) -> dict:
    """One step of ``Program.to_json``."""
    action = step.action
    return {"kind": action.kind, "stage": action.stage, "microbatch": action.microbatch,
            "inputs": list(step.inputs), "local_output": step.local_output,
            "sends": list(step.sends), "receives": list(step.receives)}


def _by_pair(posts, peer_of: list[int], sender_known: bool) -> dict[tuple[int, int], list[int]]:
    """Group each rank's posted messages by (src rank, dst rank), in posting order."""
    pairs: dict[tuple[int, int], list[int]] = {}
    for rank, numbers in posts:
        for number in numbers:
            pair = (rank, peer_of[number]) if sender_known else (peer_of[number], rank)
            sequence = pairs.get(pair)
            if sequence is None:
                sequence = pairs[pair] = []
            sequence.append(number)
    return pairs


# --- stage adjacency -------------------------------------------------------------------

def adjacent_stages(action: Action, num_stages: int, stages_per_copy: int) -> tuple[Optional[int], Optional[int]]:
    """(the stage ``action``'s input comes from, the stage its output goes to); None where there is none.

    ``num_stages`` global stages form copies of ``stages_per_copy`` consecutive stages;
    neighbours lie within the copy.
    """
    direction = _OUTPUT_STEP.get(action.kind)
    if direction is None or not 0 <= action.stage < num_stages:
        return None, None
    first = action.stage - action.stage % stages_per_copy  # the first stage of the action's copy
    source, target = action.stage - direction, action.stage + direction
    return (source if first <= source < first + stages_per_copy else None,
            target if first <= target < first + stages_per_copy else None)


def rank_changes_in_front(placement, stage: int) -> int:
    """How many times a microbatch changes rank (a message between ranks) on its way through its copy's stages
    in front of global ``stage`` to ``stage`` itself."""
    first = stage - stage % placement.stages_per_copy  # the first stage of its copy
    owners = placement.owners[first:stage + 1]
    return sum(here != there for here, there in zip(owners, owners[1:]))


class _MessageNumbers:
    """Numbers the messages between adjacent stages in order of first sight, by (src stage, dst stage, mb)."""

    def __init__(self) -> None:
        self.keys: list[tuple[int, int, int]] = []
        self._numbers: dict[tuple[int, int, int], int] = {}

    def number(self, key: tuple[int, int, int]) -> int:
        """The number of the message ``key``, assigned on first sight."""
        number = self._numbers.get(key)
        if number is None:
            number = self._numbers[key] = len(self.keys)
            self.keys.append(key)
        return number

    def messages(self, owners: tuple[int, ...]) -> tuple[Message, ...]:
        """Number -> message, each with its kind (from the direction) and its two ranks."""
        return tuple(Message(ACTIVATION if dst > src else GRADIENT, src, dst, microbatch, owners[src], owners[dst])
                     for src, dst, microbatch in self.keys)


# --- lowering ---------------------------------------------------------------------------------

@gc_paused
def lower(schedule: Schedule, sent: Optional["SendsOnly"] = None) -> Program:
    """The program of ``schedule``: its messages from stage adjacency, each receive posted where it is due.

    ``sent`` is the schedule's ``sends_only`` where the caller keeps it (``ppctl.pipeline.kept``), else made
    here. Raises ``ScheduleError`` when an action needs a message that no action produces.
    """
    sent = sends_only(schedule) if sent is None else sent
    bare, messages = sent.bare, sent.messages
    slots = _receive_slots(schedule, bare, unit_cost_ends(sent), messages)
    steps = tuple(tuple(map(Step, actions, inputs, local_outputs, sends, rank_slots[1:]))
                  for (inputs, local_outputs, sends), actions, rank_slots in zip(bare, schedule.actions, slots))
    return Program(schedule, messages, tuple(rank_slots[0] for rank_slots in slots), steps)


@dataclass(frozen=True)
class SendsOnly:
    """A schedule's steps with their messages and sends, no receive posted yet: what ``lower`` starts from.

    A replay with buffered sends posts no receive, so it times this as it times the lowered
    ``Program`` (the same makespan), without the cost of placing the receives: the planner
    simulates thousands of candidates this way.
    """

    schedule: Schedule
    messages: tuple[Message, ...]
    bare: list["_Bare"]

    @cached_property
    def graph(self) -> Optional[StepGraph]:
        """The steps as a ``StepGraph`` (None where ``StepGraph.of`` says), made once: the planner times these at
        many costs."""
        return StepGraph.of(self.schedule.actions, self.bare, len(self.messages))

    def timed(self, costs: Costs = Costs(), pairs_as_one: bool = False) -> TimedProgram:
        """The steps against ``costs``, for a buffered replay (``Program.timed``, every receive left out)."""
        return TimedProgram.of(self.schedule, self.messages, [() for _ in self.bare],
                               [(*columns, repeat(())) for columns in self.bare], costs, pairs_as_one)


def unit_cost_ends(sent: SendsOnly) -> list[list[float]]:
    """Per rank, the end of each action that runs in a buffered replay of ``sent`` at unit costs (``Costs()``), where
    ``lower`` places the receives: from the steps' ``StepGraph`` (the planner has made it already, to time the
    schedule), else from the engine (a deadlock: the actions before it)."""
    graph = sent.graph
    if graph is None:
        return run_timed(sent.timed()).ends
    return graph.rank_ends(action_durations(sent.schedule.chunks_per_copy, Costs()), Costs().comm)


@gc_paused
def sends_only(schedule: Schedule) -> SendsOnly:
    """``schedule``'s messages from stage adjacency and each action's inputs, hand-over and sends (``SendsOnly``).

    Raises ``ScheduleError`` when an action needs a message that no action produces.
    """
    numbers = _MessageNumbers()
    bare = [_bare_steps(schedule, rank_actions, numbers) for rank_actions in schedule.actions]
    messages = numbers.messages(schedule.placement.owners)
    _check_produced(schedule, bare, messages)
    return SendsOnly(schedule, messages, bare)


class _Bare(NamedTuple):
    """One rank's actions before receives are placed, as columns of message numbers (one entry per action)."""

    inputs: list[tuple[int, ...]]
    local_outputs: list[Optional[int]]
    sends: list[tuple[int, ...]]


def _bare_steps(schedule: Schedule, rank_actions: tuple[Action, ...], numbers: _MessageNumbers) -> _Bare:
    """Each action's input, and its output as a local hand-over or a send, from stage adjacency."""
    owners, stages_per_copy = schedule.placement.owners, schedule.placement.stages_per_copy
    templates: dict[tuple[str, int], tuple] = {}  # (kind, stage) -> (source, target, local)
    number = numbers.number
    inputs, local_outputs, sends = [], [], []
    for action in rank_actions:
        kind, stage, microbatch = action.kind, action.stage, action.microbatch
        template = templates.get((kind, stage))
        if template is None:
            source, target = adjacent_stages(action, len(owners), stages_per_copy)
            template = templates[kind, stage] = (source, target,
                                                 target is not None and owners[target] == owners[stage])
        source, target, local = template
        inputs.append((number((source, stage, microbatch)),) if source is not None else ())
        output = number((stage, target, microbatch)) if target is not None else None
        local_outputs.append(output if local else None)
        sends.append((output,) if output is not None and not local else ())
    return _Bare(inputs, local_outputs, sends)


def _check_produced(schedule: Schedule, bare: list[_Bare], messages: tuple[Message, ...]) -> None:
    """Every input is some action's output (sent or handed over); else ScheduleError naming the first."""
    produced = bytearray(len(messages))
    for _, local_outputs, sends in bare:
        for number in local_outputs:
            if number is not None:
                produced[number] = 1
        for numbers in sends:
            for number in numbers:
                produced[number] = 1
    if all(produced):
        return
    for rank, (inputs, _, _) in enumerate(bare):
        for action, numbers in zip(schedule.actions[rank], inputs):
            if numbers and not produced[numbers[0]]:
                message = messages[numbers[0]]
                raise ScheduleError(f"rank {rank}: {action} needs {message.kind} of microbatch {action.microbatch} "
                                    f"from stage {message.src_stage}, which no action produces")


def _receive_slots(schedule: Schedule, bare: list[_Bare], unit_ends: list[list[float]],
                   messages: tuple[Message, ...]) -> list[list[tuple[int, ...]]]:
    """Per rank, slot 0 (initial) and slot i + 1 (after action i): the receives posted there.

    A receive goes in the batch the receiver issues when, in the unit-cost replay (``unit_ends``:
    per rank, the end of each action that ran), the sender sends the message; at the latest in
    the batch before the action that needs it. Per sender, slots never decrease along its send order.
    """
    send_time = _send_times(bare, unit_ends, len(messages))
    slots: list[list[list[int]]] = [[[] for _ in range(len(actions) + 1)] for actions in schedule.actions]
    dst_ranks = [message.dst_rank for message in messages]
    sequences = _by_pair(((rank, numbers) for rank, (_, _, sends) in enumerate(bare) for numbers in sends),
                         dst_ranks, sender_known=True)
    needed_at = [{number: index for index, numbers in enumerate(inputs) for number in numbers} for inputs, _, _ in bare]
    for (_, dst_rank), sequence in sequences.items():
        wanted = _wanted_slots(sequence, send_time, unit_ends[dst_rank], needed_at[dst_rank],
                               len(schedule.actions[dst_rank]))
        rank_slots = slots[dst_rank]
        for number, slot in zip(sequence, _suffix_minimum(wanted)):
            rank_slots[slot].append(number)
    # Within one batch: by send time, then sender (stable, so each sender's messages stay in send order).
    return [[tuple(sorted(posted, key=lambda number: (send_time[number], messages[number].src_rank)))
             if len(posted) > 1 else tuple(posted) for posted in rank_slots] for rank_slots in slots]


def _wanted_slots(sequence: list[int], send_time: list[float], receiver_ends: list[float],
                  needed_at: dict[int, int], never: int) -> list[int]:
    """Each message's slot at its receiver: when it is sent, at the latest before the action needing it."""
    wanted = []
    for number in sequence:
        sent = bisect_right(receiver_ends, send_time[number])  # receiver actions done by the send
        needed = needed_at.get(number, never)
        wanted.append(needed if needed < sent else sent)
    return wanted


def _send_times(bare: list[_Bare], ends: list[list[float]], num_messages: int) -> list[float]:
    """Message number -> when the replay's sender finished sending it (infinity: never sent)."""
    send_time = [float("inf")] * num_messages
    for (_, _, sends), rank_ends in zip(bare, ends):
        for numbers, end in zip(sends, rank_ends):  # the actions that ran
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


__all__ = ["ACTIVATION", "GRADIENT", "Message", "Program", "SendsOnly", "Step", "adjacent_stages", "lower",
           "sends_only", "unit_cost_ends"]
