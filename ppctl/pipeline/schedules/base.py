"""Schedules as data: the action type, the schedule type and the registry's entry type.

A schedule is plain data: for each pipeline rank, the ordered list of computations
it runs in one step. Nothing here knows about processes or tensors; sends and
receives are derived from the actions when ``ppctl.pipeline.program`` lowers it.

Stages are *global virtual stages*: the model is cut into ``num_stages`` pieces,
stage 0 holds the embedding and the last stage the loss. The schedule's placement
(``ppctl.parallel.placement``, shared with the layout) maps each stage to the
pipeline rank that runs it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, NamedTuple, Optional

from ppctl.parallel.placement import Placement, looped_placement, v_placement

FORWARD = "F"
BACKWARD_INPUT = "B"  # input-gradient half of a split backward
BACKWARD_WEIGHT = "W"  # weight-gradient half of a split backward
BACKWARD = "BW"  # whole backward (input and weight gradients together)
ACTION_KINDS = (FORWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, BACKWARD)


class ScheduleError(ValueError):
    """A schedule that cannot be built or cannot run; the message is one line."""


class Action(NamedTuple):
    """One computation on one stage for one microbatch.

    ``kind`` is ``F`` (forward), ``B`` (input-gradient backward of a split backward),
    ``W`` (weight-gradient backward) or ``BW`` (whole backward). ``stage`` is the
    global virtual stage.

    A named tuple, not a frozen dataclass: a planner builds millions of them, and a tuple
    is made in half the time (the same fields, equality, hash and repr).
    """

    kind: str
    stage: int
    microbatch: int

    def __str__(self) -> str:
        return f"{self.kind}(stage {self.stage}, mb {self.microbatch})"


@dataclass(frozen=True)
class Schedule:
    """Per-rank ordered action lists plus the placement of stages on ranks.

    ``placement`` puts the ``pp * chunks_per_rank`` global stages on the ranks and cuts
    them into its ``copies`` model copies (DualPipe holds 2; see ``Placement``). The
    microbatches are split the same way, in ``copies`` consecutive equal runs, and a
    microbatch flows through the stages of its copy only: the last stage of each copy
    computes the loss, the first reads the tokens.

    ``overlapped[rank]`` lists, sorted, the indices i such that ``actions[rank][i]`` (an F)
    and ``actions[rank][i + 1]`` (a backward) form one overlapped forward-backward pair
    (DualPipe's F&B): shown and timed as one composite action, run as two steps.

    ``filled[rank]`` lists, sorted, the indices i such that ``actions[rank][i]`` (a backward, B or BW) and
    ``actions[rank][i + 1]`` (the W of another stage or microbatch) form one weight fill: the W computes while
    the backward waits for its expert all-to-alls (``with_weight_fills``; none unless asked for).
    """

    name: str
    pp: int
    chunks_per_rank: int
    num_microbatches: int
    placement: Placement
    actions: tuple[tuple[Action, ...], ...]
    overlapped: tuple[tuple[int, ...], ...] = ()
    filled: tuple[tuple[int, ...], ...] = ()

    @property
    def chunks_per_copy(self) -> int:
        """A rank's chunks of one model copy: the chunks one microbatch passes through on its rank.

        The cost and activation unit is one microbatch through these (``chunks_per_rank``
        with one copy; 1 for DualPipe, whose two chunks per rank belong to different copies).
        """
        return self.chunks_per_rank // self.placement.copies

    def microbatches_of_copy(self, copy: int) -> range:
        """The microbatches that flow through ``copy``: a consecutive run of ``num_microbatches / copies``."""
        per_copy = self.num_microbatches // self.placement.copies
        return range(copy * per_copy, (copy + 1) * per_copy)

    @property
    def splits_backward(self) -> bool:
        """Whether the backward is split into B (input gradient) and W (weight gradient)."""
        return any(action.kind in (BACKWARD_INPUT, BACKWARD_WEIGHT) for rank_actions in self.actions
                   for action in rank_actions)

    def pair_starts(self, pp_rank: int) -> tuple[int, ...]:
        """The indices of ``pp_rank``'s actions that start an overlapped pair (none without pairs)."""
        return self.overlapped[pp_rank] if self.overlapped else ()

    def fill_starts(self, pp_rank: int) -> tuple[int, ...]:
        """The indices of ``pp_rank``'s actions that start a weight fill (none without fills)."""
        return self.filled[pp_rank] if self.filled else ()

    def with_weight_fills(self) -> "Schedule":
        """The same schedule with every weight fill its order allows (``parallel.overlap_ep_comm``): a backward
        followed on its rank by a W of another (stage, microbatch), neither on the first stage of its model copy
        (whose B computes nothing and whose W runs the whole backward, exchanges included), neither in an
        overlapped pair. The W's own B ran earlier (the order ``check_schedule`` proves), so the two are
        independent: the W fills the backward's all-to-all waits."""
        filled = []
        for pp_rank, rank_actions in enumerate(self.actions):
            paired = _paired(self.pair_starts(pp_rank))
            filled.append(tuple(index for index in range(len(rank_actions) - 1)
                                if self.fills(rank_actions[index], rank_actions[index + 1])
                                and not {index, index + 1} & paired))
        return replace(self, filled=tuple(filled))  # a W starts no fill: no two fills share an action

    def fills(self, backward: Action, weight: Action) -> bool:
        """Whether ``weight`` may fill ``backward``'s exchange waits (``with_weight_fills``)."""
        return (backward.kind in (BACKWARD, BACKWARD_INPUT) and weight.kind == BACKWARD_WEIGHT
                and backward[1:] != weight[1:] and self.placement.model_stage(backward.stage) != 0
                and self.placement.model_stage(weight.stage) != 0)

    def forward_only(self) -> "Schedule":
        """The same schedule with its forwards only, in the same order (evaluation: no backward, no pairs)."""
        actions = tuple(tuple(action for action in rank_actions if action.kind == FORWARD)
                        for rank_actions in self.actions)
        return Schedule(f"{self.name} (forward only)", self.pp, self.chunks_per_rank, self.num_microbatches,
                        self.placement, actions)

    def describe(self) -> str:
        """One line per rank, actions written compactly (``F3`` forward mb 3, ``c1`` chunk 1).

        An overlapped pair is one cell, its halves joined by ``+`` (``F3c0+BW1c1``); a weight fill by ``&``
        (``B3c1&W2c0``).
        """
        lines = []
        for pp_rank, rank_actions in enumerate(self.actions):
            cells = [self._cell(action) for action in rank_actions]
            joined = [(index, "+") for index in self.pair_starts(pp_rank)]
            joined += [(index, "&") for index in self.fill_starts(pp_rank)]
            for index, joint in sorted(joined, reverse=True):
                cells[index:index + 2] = [joint.join(cells[index:index + 2])]
            lines.append(f"rank {pp_rank}: " + " ".join(cells))
        return "\n".join(lines)

    def _cell(self, action: Action) -> str:
        """``action`` written compactly: kind, microbatch, and its chunk when the rank holds several."""
        chunk = f"c{self.placement.chunk_of(action.stage)}" if self.chunks_per_rank > 1 else ""
        return f"{action.kind}{action.microbatch}{chunk}"


def _paired(starts: tuple[int, ...]) -> set[int]:
    """The indices of the actions in the pairs starting at ``starts``."""
    return {index + half for index in starts for half in (0, 1)}


# --- the registry's entry type -------------------------------------------------------

MicrobatchRule = Callable[[int, int, int], Optional[str]]


@dataclass(frozen=True)
class ScheduleSpec:
    """What config validation and the CLI need to know about a schedule by name.

    ``microbatch_error(pp, vpp, num_microbatches)`` returns None when the count is
    allowed, else a one-line message that states the rule. ``multi_chunk`` says
    whether the schedule may hold several chunks per rank (``vpp > 1``).
    ``generate(pp, vpp, num_microbatches)`` builds the schedule.
    ``placement(pp, chunks_per_rank)`` builds the placement of stages on ranks and
    their model copies (DualPipe holds 2); the layout (layer map, embedding group,
    data and logging ranks) and the schedule share it. ``chunks_per_rank`` is set
    when the placement fixes it (a V holds exactly 2); ``placement_name`` describes it.
    ``chunks_per_wave`` is set when ``parallel.waves`` decides the chunks per rank
    (Hanayo: 2 per wave). ``streams_steps``: consecutive steps run as one continuous
    stream of ``steps * num_microbatches`` microbatches, each rank updating its weights
    after its last backward of a step with no flush (PipeDream-2BW); ``generate`` with
    that many microbatches builds the stream.
    """

    name: str
    multi_chunk: bool
    splits_backward: bool
    description: str
    microbatch_error: MicrobatchRule
    generate: Callable[[int, int, int], Schedule]
    placement: Callable[[int, int], Placement] = looped_placement
    chunks_per_rank: Optional[int] = None
    placement_name: str = "looped: rank r holds stages r, r+pp, ..."
    chunks_per_wave: Optional[int] = None
    streams_steps: bool = False


def at_least_one_microbatch(pp: int, vpp: int, num_microbatches: int) -> Optional[str]:
    """The rule every schedule shares: a step has at least one microbatch."""
    if num_microbatches < 1:
        return f"num_microbatches={num_microbatches} must be at least 1"
    return None


def single_chunk_only(name: str, vpp: int) -> None:
    """Refuse ``vpp > 1`` for a schedule that holds one chunk per rank."""
    if vpp != 1:
        raise ScheduleError(f"schedule {name} holds one chunk per rank; vpp={vpp} must be 1 "
                            f"(use interleaved_1f1b for vpp > 1)")


V_PLACEMENT_NAME = "a V: rank r holds stages r and 2*pp-1-r"


def v_placement_of_spec(pp: int, chunks_per_rank: int) -> Placement:
    """The V placement (one model copy) in the registry's ``(pp, chunks_per_rank)`` form (a V always has 2 chunks)."""
    return v_placement(pp)


def two_chunks_only(name: str, vpp: int) -> None:
    """Refuse ``vpp != 2`` for a schedule on the V placement."""
    if vpp != 2:
        raise ScheduleError(f"schedule {name} places exactly 2 chunks on each rank ({V_PLACEMENT_NAME}); "
                            f"vpp={vpp} must be 2")
