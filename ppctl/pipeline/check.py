"""The schedule checker: refuse a schedule that is incomplete, misplaced, misordered or deadlocks.

``check_schedule`` runs, in order:

1. placement: every stage sits on a valid rank, every rank holds ``chunks_per_rank`` stages,
   the model copies split the stages and the microbatches evenly;
2. actions: each names a known kind, a valid stage and microbatch (one that flows through
   the stage's model copy), on the rank owning its stage;
3. completeness: every (stage, microbatch of its copy) has exactly one F and exactly one
   backward (one BW, or one B and one W; never both forms);
4. order on a rank: F before its B/BW, B before its W; each overlapped pair is an F
   followed by a backward; each weight fill a backward followed by an independent W, neither
   on the first stage of its copy;
5. the lowered program (``ppctl.pipeline.program``): each receive posted once, before
   the step that waits for it; for every pair of ranks, receives posted in send order;
6. progress: the program replayed with NCCL-like sends must finish: each rank's batches
   run one after another and a send completes only once the peer posted its receive.
   When it does not, a replay with buffered sends tells a real dependency cycle
   ("deadlock: rank r stuck at ... waiting for ...") from a hang that only blocking
   sends cause ("hangs with NCCL-like blocking sends: ...");
7. the interleave: the pieces of overlapped pairs and weight fills, run one at a time and switching at each
   exchange (``ppctl.pipeline.interleave``), cannot hang for any count of exchanges (on 2 EP ranks).

Each failure raises ``ScheduleError`` with one line naming the rank, stage and microbatch.
"""

from __future__ import annotations

import functools
from collections import Counter
from itertools import count, repeat
from operator import gt
from typing import Optional

from .interleave import prove_interleave_for_every_count
from .program import Message, Program, SendsOnly, lower
from .replay import gc_paused, run_timed
from .schedules.base import (ACTION_KINDS, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, Action,
                             Schedule, ScheduleError)


@gc_paused
def check_schedule(schedule: Schedule, sent: Optional[SendsOnly] = None) -> Program:
    """The lowered program of ``schedule``; ``ScheduleError`` (one line) unless it is complete, well placed and runs.

    ``sent``: the schedule's ``sends_only`` where the caller keeps it (``lower`` makes it otherwise).
    """
    check_placement(schedule)
    check_actions(schedule)
    program = lower(schedule, sent)
    check_program(program)
    check_interleave(schedule)
    return program


def check_placement(schedule: Schedule) -> None:
    """The placement fits the schedule (``Placement.problem``) and its model copies split the microbatches."""
    problem = schedule.placement.problem(schedule.pp, schedule.chunks_per_rank)
    if problem is not None:
        raise ScheduleError(f"{schedule.name}: {problem}")
    copies = schedule.placement.copies
    if schedule.num_microbatches % copies:
        raise ScheduleError(f"{schedule.name}: copies={copies} must be at least 1 and divide chunks_per_rank="
                            f"{schedule.chunks_per_rank} and num_microbatches={schedule.num_microbatches}")


def check_actions(schedule: Schedule) -> None:
    """Valid actions on the right ranks, each (stage, microbatch) complete, F before B before W, pairs well formed."""
    if len(schedule.actions) != schedule.pp:
        raise ScheduleError(f"{schedule.name}: {len(schedule.actions)} action lists for pp={schedule.pp} ranks")
    for pp_rank, rank_actions in enumerate(schedule.actions):
        if not _all_valid(schedule, pp_rank, rank_actions):  # the common case, in a few set operations
            for action in rank_actions:
                _check_action(schedule, pp_rank, action)
    _check_complete(schedule)
    for pp_rank, rank_actions in enumerate(schedule.actions):
        _check_rank_order(pp_rank, rank_actions)
    _check_overlapped(schedule)
    _check_filled(schedule)


def _all_valid(schedule: Schedule, pp_rank: int, rank_actions: tuple[Action, ...]) -> bool:
    """Whether every action has a known kind, a microbatch of its stage's copy and a stage that ``pp_rank`` holds."""
    stages = schedule.placement.stages_of(pp_rank)
    if not ({action.kind for action in rank_actions} <= set(ACTION_KINDS)
            and {action.stage for action in rank_actions} <= set(stages)):
        return False
    if schedule.placement.copies == 1:
        return {action.microbatch for action in rank_actions} <= set(range(schedule.num_microbatches))
    microbatches = {stage: set(_microbatches_through(schedule, stage)) for stage in stages}
    return all(action.microbatch in microbatches[action.stage] for action in rank_actions)


def _microbatches_through(schedule: Schedule, stage: int) -> range:
    """The microbatches that flow through ``stage``: those of its model copy."""
    return schedule.microbatches_of_copy(schedule.placement.copy_of(stage))


def _check_action(schedule: Schedule, pp_rank: int, action: Action) -> None:
    """``action`` has a known kind, a stage and microbatch in range, and runs on the rank holding its stage."""
    if action.kind not in ACTION_KINDS:
        raise ScheduleError(f"rank {pp_rank}: action kind {action.kind!r} must be one of {', '.join(ACTION_KINDS)}")
    if not 0 <= action.stage < schedule.placement.num_stages:
        raise ScheduleError(f"rank {pp_rank}: {action} names a stage outside "
                            f"0..{schedule.placement.num_stages - 1}")
    if not 0 <= action.microbatch < schedule.num_microbatches:
        raise ScheduleError(f"rank {pp_rank}: {action} names a microbatch outside "
                            f"0..{schedule.num_microbatches - 1}")
    owner = schedule.placement.rank_of(action.stage)
    if owner != pp_rank:
        raise ScheduleError(f"rank {pp_rank}: {action} belongs on rank {owner}, "
                            f"which holds stage {action.stage}")
    through = _microbatches_through(schedule, action.stage)
    if action.microbatch not in through:
        raise ScheduleError(f"rank {pp_rank}: {action} names a microbatch of another model copy; stage "
                            f"{action.stage} (copy {schedule.placement.copy_of(action.stage)}) runs microbatches "
                            f"{through.start}..{through.stop - 1}")


def _check_complete(schedule: Schedule) -> None:
    """Each (stage, microbatch) has one F, and one BW or one B and one W; else the first that has not."""
    by_kind: dict[str, list[tuple[int, int]]] = {kind: [] for kind in ACTION_KINDS}
    for rank_actions in schedule.actions:
        for a in rank_actions:
            by_kind[a.kind].append((a.stage, a.microbatch))
    placement = schedule.placement
    expected = placement.num_stages * schedule.num_microbatches // placement.copies  # each stage: its copy's
    if _each_complete_once(by_kind, expected):
        return  # the common case, in a few set operations; else find the first incomplete one below
    counts = Counter((stage, mb, kind) for kind, keys in by_kind.items() for stage, mb in keys)
    for stage in range(placement.num_stages):
        for mb in _microbatches_through(schedule, stage):
            _check_one_of_each(schedule, stage, mb, {k: counts[(stage, mb, k)] for k in ACTION_KINDS})


def _each_complete_once(by_kind: dict[str, list[tuple[int, int]]], expected: int) -> bool:
    """Whether each of the ``expected`` (stage, microbatch) has one F and one BW, or one B and one W.

    ``by_kind`` holds the (stage, microbatch) of valid actions (stages in range,
    microbatches of the stage's copy), so ``expected`` distinct forwards are all of them.
    """
    forwards, whole, inputs, weights = (set(by_kind[kind]) for kind in (FORWARD, BACKWARD, BACKWARD_INPUT,
                                                                         BACKWARD_WEIGHT))
    if sum(map(len, (forwards, whole, inputs, weights))) != sum(map(len, by_kind.values())):
        return False  # some action twice
    return (len(forwards) == expected and inputs == weights and whole.isdisjoint(inputs)
            and len(whole) + len(inputs) == expected)


def _check_one_of_each(schedule: Schedule, stage: int, mb: int, count: dict[str, int]) -> None:
    """The counts of each action kind of one (stage, microbatch) are complete."""
    where = f"stage {stage} (rank {schedule.placement.rank_of(stage)}) microbatch {mb}"
    if count[FORWARD] != 1:
        raise ScheduleError(f"{where} has {count[FORWARD]} forwards, expected exactly 1")
    split = count[BACKWARD_INPUT] + count[BACKWARD_WEIGHT]
    if count[BACKWARD] and split:
        raise ScheduleError(f"{where} mixes an unsplit BW with split B/W backwards; use one form")
    if split and (count[BACKWARD_INPUT] != 1 or count[BACKWARD_WEIGHT] != 1):
        raise ScheduleError(f"{where} has {count[BACKWARD_INPUT]} B and {count[BACKWARD_WEIGHT]} W, "
                            f"expected exactly one of each")
    if not split and count[BACKWARD] != 1:
        raise ScheduleError(f"{where} has {count[BACKWARD]} backwards, expected exactly 1")


# The action each kind needs before it on its rank (of the same stage and microbatch).
PREREQUISITE = {BACKWARD: FORWARD, BACKWARD_INPUT: FORWARD, BACKWARD_WEIGHT: BACKWARD_INPUT}


def _check_rank_order(pp_rank: int, rank_actions: tuple[Action, ...]) -> None:
    """On ``pp_rank``, each B/BW comes after its F and each W after its B: the first that does not is refused.

    In C loops (a large schedule has hundreds of thousands of actions): where each action first occurs on the rank,
    then for each action where its prerequisite first does; an action that needs none looks itself up (it occurs
    no later than itself), one whose prerequisite is missing gets the end of the rank.
    """
    if not rank_actions:
        return
    first = dict(zip(reversed(rank_actions), range(len(rank_actions) - 1, -1, -1)))  # the earliest index wins
    kinds, stages, microbatches = zip(*rank_actions)  # an Action is a (kind, stage, microbatch) tuple
    needed = map(PREREQUISITE.get, kinds, kinds)
    late = list(map(gt, map(first.get, zip(needed, stages, microbatches), repeat(len(rank_actions))), count()))
    if True in late:
        action = rank_actions[late.index(True)]
        raise ScheduleError(f"rank {pp_rank}: {action} comes before its {PREREQUISITE[action.kind]} on this rank")


def _check_overlapped(schedule: Schedule) -> None:
    """Each overlapped pair: one list per rank, sorted indices, an F then a backward, no action in two pairs."""
    if not schedule.overlapped:
        return
    if len(schedule.overlapped) != schedule.pp:
        raise ScheduleError(f"{schedule.name}: {len(schedule.overlapped)} lists of overlapped pairs for "
                            f"pp={schedule.pp} ranks")
    for pp_rank, starts in enumerate(schedule.overlapped):
        rank_actions = schedule.actions[pp_rank]
        for previous, index in zip((-2,) + tuple(starts), starts):
            if index < previous + 2 or not 0 <= index < len(rank_actions) - 1:
                raise ScheduleError(f"rank {pp_rank}: overlapped pair at action {index} is out of order, "
                                    f"overlaps the previous pair or runs past the rank's actions")
            forward, backward = rank_actions[index], rank_actions[index + 1]
            if forward.kind != FORWARD or backward.kind not in (BACKWARD, BACKWARD_INPUT):
                raise ScheduleError(f"rank {pp_rank}: overlapped pair at action {index} is {forward} and "
                                    f"{backward}; a pair is a forward followed by a backward (BW or B)")


def check_weight_fills(schedule: Schedule) -> None:
    """The checks of ``check_schedule`` that its weight fills add (``Schedule.with_weight_fills``; the program is the
    same with or without them): each fill well formed, and the interleave proved."""
    _check_filled(schedule)
    check_interleave(schedule)


def check_interleave(schedule: Schedule) -> None:
    """A schedule with overlapped pairs or weight fills: their halves' pieces, run interleaved
    (``parallel.overlap_ep_comm``), cannot hang for any count of exchanges in either half, on 2 EP ranks
    (``prove_interleave_for_every_count``; proved once per process)."""
    if any(schedule.overlapped):
        _prove_interleave(local_backward=False)
    if any(schedule.filled):
        _prove_interleave(local_backward=True)


@functools.cache
def _prove_interleave(local_backward: bool) -> None:
    prove_interleave_for_every_count(2, local_backward)


def _check_filled(schedule: Schedule) -> None:
    """Each weight fill (``Schedule.with_weight_fills``): one list per rank, sorted, a backward followed by the W of
    another (stage, microbatch), neither on the first stage of its copy, no action in an overlapped pair too."""
    if not schedule.filled:
        return
    if len(schedule.filled) != schedule.pp:
        raise ScheduleError(f"{schedule.name}: {len(schedule.filled)} lists of weight fills for pp={schedule.pp} ranks")
    for pp_rank, starts in enumerate(schedule.filled):
        rank_actions, paired = schedule.actions[pp_rank], set(schedule.pair_starts(pp_rank))
        for previous, index in zip((-2,) + tuple(starts), starts):
            shares_pair = {index - 1, index, index + 1} & paired
            if index < previous + 2 or not 0 <= index < len(rank_actions) - 1 or shares_pair:
                raise ScheduleError(f"rank {pp_rank}: weight fill at action {index} is out of order, overlaps "
                                    f"another fill or an overlapped pair, or runs past the rank's actions")
            backward, weight = rank_actions[index], rank_actions[index + 1]
            if not schedule.fills(backward, weight):
                raise ScheduleError(f"rank {pp_rank}: weight fill at action {index} is {backward} and {weight}; a "
                                    f"fill is a backward followed by the W of another stage or microbatch, neither "
                                    f"on the first stage of its model copy")


@gc_paused
def check_program(program: Program) -> None:
    """Receives posted once and before their wait, per-pair message order, progress under both transports."""
    _check_posting(program)
    _check_pair_order(program)
    timed = program.timed()
    nccl_like = run_timed(timed, rendezvous=True)
    if not nccl_like.deadlocked:
        return  # buffered sends make messages available no later, so that replay would finish too
    buffered = run_timed(timed)
    name = program.schedule.name
    if buffered.deadlocked:
        raise ScheduleError(f"{name}: {buffered.deadlock_message()}")
    raise ScheduleError(f"{name} hangs with NCCL-like blocking sends: {nccl_like.deadlock_message()}")


def _check_posting(program: Program) -> None:
    """Each rank posts a receive once, for a message sent to it by another rank, before any step waits for it."""
    messages, src_ranks, dst_ranks = program.messages, program.src_ranks, program.dst_ranks
    for rank, steps in enumerate(program.steps):
        posted = set(program.initial_receives[rank])
        count = len(program.initial_receives[rank])
        for action, inputs, _, _, receives in steps:
            for number in inputs:
                if number not in posted and src_ranks[number] != dst_ranks[number]:
                    raise ScheduleError(f"rank {rank}: {action} waits for {messages[number]}, "
                                        f"whose receive the rank has not posted before")
            if receives:
                posted.update(receives)
                count += len(receives)
        if len(posted) != count:
            raise ScheduleError(f"rank {rank} posts a receive twice")
        strays = [number for number in posted if dst_ranks[number] != rank or src_ranks[number] == rank]
        if strays:
            raise ScheduleError(f"rank {rank} posts a receive for {messages[strays[0]]}, "
                                f"which is not a message from another rank to it")


def _check_pair_order(program: Program) -> None:
    """For each pair (src -> dst), dst posts its receives in exactly the order src posts its sends."""
    sent_by_pair, received_by_pair = program.sends_by_pair(), program.receives_by_pair()
    for src_rank, dst_rank in sorted(set(sent_by_pair) | set(received_by_pair)):
        sent = sent_by_pair.get((src_rank, dst_rank), [])
        received = received_by_pair.get((src_rank, dst_rank), [])
        if sent != received:
            raise ScheduleError(_order_mismatch(src_rank, dst_rank, [program.messages[n] for n in sent],
                                                [program.messages[n] for n in received]))


def _order_mismatch(src_rank: int, dst_rank: int, sent: list[Message], received: list[Message]) -> str:
    """The line for a pair whose send and receive orders differ: the first difference, or the counts."""
    for index, (sent_message, received_message) in enumerate(zip(sent, received)):
        if sent_message != received_message:
            return (f"rank {dst_rank} posts receive #{index} from rank {src_rank} for {received_message}, "
                    f"but rank {src_rank} sends {sent_message} there")
    return (f"rank {src_rank} sends {len(sent)} messages to rank {dst_rank}, "
            f"which posts {len(received)} receives from it")
