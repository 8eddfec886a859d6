"""Messages and stage adjacency: the one place that knows where an action's input comes from and its output goes.

Schedules only list computations; every message follows from stage adjacency:

- ``F(s, mb)`` consumes the activation of stage s - 1 and produces the one stage s + 1
  consumes: an ``act`` message goes from stage s to stage s + 1;
- a backward (``B`` or ``BW``) of ``(s, mb)`` consumes the gradient of stage s + 1 and
  produces the one stage s - 1 consumes: a ``grad`` message goes from s to s - 1;
- ``W`` consumes and produces no message (it needs only its own ``B``, on its rank).

Stages are adjacent only within one model copy (``Placement.copies``; one unless the
schedule holds several, as DualPipe holds two): no message crosses from one copy to the
other. The first stage of each copy reads the tokens, so its forward consumes nothing and
its backward produces nothing; the last stage of each copy computes the loss, so its
forward produces nothing and its backward consumes nothing.
"""

from __future__ import annotations

from typing import Iterator, NamedTuple, Optional, Sequence

from .schedules.base import BACKWARD, BACKWARD_INPUT, FORWARD, Action, Schedule

ACTIVATION = "act"
GRADIENT = "grad"

# Where an action's output goes, in stages; its input comes from the other side. W: no message.
_OUTPUT_STEP = {FORWARD: 1, BACKWARD: -1, BACKWARD_INPUT: -1}


class Message(NamedTuple):
    """One tensor handed from one stage to the next (``act``) or the previous (``grad``).

    A named tuple rather than a dataclass: a plan holds one per message (over 100,000
    at pp=64), and tuples are built and hashed several times faster.
    """

    kind: str
    src_stage: int
    dst_stage: int
    microbatch: int
    src_rank: int
    dst_rank: int

    @property
    def local(self) -> bool:
        """True when producer and consumer run on the same rank (no point-to-point message)."""
        return self.src_rank == self.dst_rank

    def __str__(self) -> str:
        return (f"{self.kind} mb {self.microbatch} stage {self.src_stage}->{self.dst_stage} "
                f"(rank {self.src_rank}->{self.dst_rank})")


def adjacent_stages(action: Action, num_stages: int, stages_per_copy: int) -> tuple[Optional[int], Optional[int]]:
    """(the stage ``action``'s input comes from, the stage its output goes to); None where there is none.

    ``num_stages`` global stages form copies of ``stages_per_copy`` consecutive stages
    (one copy: ``stages_per_copy == num_stages``); neighbours lie within the copy.
    """
    direction = _OUTPUT_STEP.get(action.kind)
    if direction is None or not 0 <= action.stage < num_stages:
        return None, None
    first = action.stage - action.stage % stages_per_copy  # the first stage of the action's copy
    source, target = action.stage - direction, action.stage + direction
    return (source if first <= source < first + stages_per_copy else None,
            target if first <= target < first + stages_per_copy else None)


def message_between(placement: tuple[int, ...], src_stage: int, dst_stage: int, microbatch: int) -> Message:
    """The message from ``src_stage`` to the adjacent ``dst_stage`` (its kind follows from the direction)."""
    kind = ACTIVATION if dst_stage > src_stage else GRADIENT
    return _new_message((kind, src_stage, dst_stage, microbatch, placement[src_stage], placement[dst_stage]))


class AdjacentMessages(Sequence[Message]):
    """The messages between adjacent stages under one placement, numbered in order of first sight.

    Each is kept as its key (src stage, dst stage, microbatch); a ``Message`` is
    built only when asked for: checking a schedule needs only the ranks of its messages.
    """

    def __init__(self, placement: tuple[int, ...]):
        self.placement = placement
        self.keys: list[tuple[int, int, int]] = []  # number -> key
        self._numbers: dict[tuple[int, int, int], int] = {}

    def number(self, key: tuple[int, int, int]) -> int:
        """The number of the message ``key``, assigned on first sight."""
        number = self._numbers.get(key)
        if number is None:
            number = self._numbers[key] = len(self.keys)
            self.keys.append(key)
        return number

    def __len__(self) -> int:
        return len(self.keys)

    def __getitem__(self, number: int) -> Message:  # type: ignore[override]  (no slices)
        return message_between(self.placement, *self.keys[number])

    def __iter__(self) -> Iterator[Message]:
        placement = self.placement
        return (message_between(placement, *key) for key in self.keys)

    def src_ranks(self) -> list[int]:
        """Message number -> the rank that sends it."""
        placement = self.placement
        return [placement[key[0]] for key in self.keys]

    def dst_ranks(self) -> list[int]:
        """Message number -> the rank that receives it."""
        placement = self.placement
        return [placement[key[1]] for key in self.keys]


def _new_message(fields: tuple) -> Message:
    """A Message from its six fields, without the keyword-handling constructor (plans build many)."""
    return tuple.__new__(Message, fields)


def input_message(schedule: Schedule, action: Action) -> Optional[Message]:
    """The message ``action`` consumes, or None (first-stage forward, last-stage backward, W)."""
    placement = schedule.placement
    source, _ = adjacent_stages(action, placement.num_stages, placement.stages_per_copy)
    if source is None:
        return None
    return message_between(placement.owners, source, action.stage, action.microbatch)


def output_message(schedule: Schedule, action: Action) -> Optional[Message]:
    """The message ``action`` produces, or None (last-stage forward, first-stage backward, W)."""
    placement = schedule.placement
    _, target = adjacent_stages(action, placement.num_stages, placement.stages_per_copy)
    if target is None:
        return None
    return message_between(placement.owners, action.stage, target, action.microbatch)
