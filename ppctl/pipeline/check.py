"""The schedule checker: refuse a schedule that is incomplete, misplaced, misordered or deadlocks.

``check_schedule`` runs, in order:

1. placement: every stage sits on a valid rank, every rank holds ``chunks_per_rank`` stages;
2. actions: each names a known kind, a valid stage and microbatch, on the rank owning its stage;
3. completeness: every (stage, microbatch) has exactly one F and exactly one backward
   (one BW, or one B and one W; never both forms);
4. order on a rank: F before its B/BW, B before its W;
5. the communication plan: for every pair of ranks, receives are posted in send order;
6. progress: the plan replayed with NCCL-like sends must finish: each rank's batches
   run one after another and a send completes only once the peer posted its receive.
   When it does not, a replay with buffered sends tells a real dependency cycle
   ("deadlock: rank r stuck at ... waiting for ...") from a hang that only blocking
   sends cause ("hangs with NCCL-like blocking sends: ...").

Each failure raises ``ScheduleError`` with one line naming the rank, stage and microbatch.
"""

from __future__ import annotations

from collections import Counter

from .comm import CommPlan, Message, NumberedPlan, number_plan, plan_numbered
from .replay import gc_paused, run
from .schedules.base import (ACTION_KINDS, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, Action,
                             Schedule, ScheduleError)
from .simulate import compile_plan


@gc_paused
def check_schedule(schedule: Schedule) -> None:
    """Raise ``ScheduleError`` (one line) unless ``schedule`` is complete, well placed and runs to the end."""
    check_placement(schedule)
    check_actions(schedule)
    _check_numbered_plan(schedule, plan_numbered(schedule))


def check_placement(schedule: Schedule) -> None:
    """Every stage on a valid rank, and every rank holding ``chunks_per_rank`` stages."""
    expected = schedule.pp * schedule.chunks_per_rank
    if len(schedule.placement) != expected:
        raise ScheduleError(f"{schedule.name}: placement has {len(schedule.placement)} stages, "
                            f"expected pp*chunks_per_rank = {expected}")
    for stage, pp_rank in enumerate(schedule.placement):
        if not 0 <= pp_rank < schedule.pp:
            raise ScheduleError(f"{schedule.name}: stage {stage} is placed on rank {pp_rank}, "
                                f"outside 0..{schedule.pp - 1}")
    for pp_rank, count in sorted(Counter(schedule.placement).items()):
        if count != schedule.chunks_per_rank:
            raise ScheduleError(f"{schedule.name}: rank {pp_rank} holds {count} stages, "
                                f"expected chunks_per_rank = {schedule.chunks_per_rank}")
    if len(set(schedule.placement)) != schedule.pp:
        missing = sorted(set(range(schedule.pp)) - set(schedule.placement))
        raise ScheduleError(f"{schedule.name}: ranks {missing} hold no stage")


def check_actions(schedule: Schedule) -> None:
    """Valid actions on the right ranks, each (stage, microbatch) complete, F before B before W."""
    if len(schedule.actions) != schedule.pp:
        raise ScheduleError(f"{schedule.name}: {len(schedule.actions)} action lists for pp={schedule.pp} ranks")
    for pp_rank, rank_actions in enumerate(schedule.actions):
        if not _all_valid(schedule, pp_rank, rank_actions):  # the common case, in a few set operations
            for action in rank_actions:
                _check_action(schedule, pp_rank, action)
    _check_complete(schedule)
    for pp_rank, rank_actions in enumerate(schedule.actions):
        _check_rank_order(pp_rank, rank_actions)


def _all_valid(schedule: Schedule, pp_rank: int, rank_actions: tuple[Action, ...]) -> bool:
    """Whether every action has a known kind, a microbatch in range and a stage that ``pp_rank`` holds."""
    return ({action.kind for action in rank_actions} <= set(ACTION_KINDS)
            and {action.stage for action in rank_actions} <= set(schedule.stages_of(pp_rank))
            and {action.microbatch for action in rank_actions} <= set(range(schedule.num_microbatches)))


def _check_action(schedule: Schedule, pp_rank: int, action: Action) -> None:
    """``action`` has a known kind, a stage and microbatch in range, and runs on the rank holding its stage."""
    if action.kind not in ACTION_KINDS:
        raise ScheduleError(f"rank {pp_rank}: action kind {action.kind!r} must be one of {', '.join(ACTION_KINDS)}")
    if not 0 <= action.stage < schedule.num_stages:
        raise ScheduleError(f"rank {pp_rank}: {action} names a stage outside 0..{schedule.num_stages - 1}")
    if not 0 <= action.microbatch < schedule.num_microbatches:
        raise ScheduleError(f"rank {pp_rank}: {action} names a microbatch outside "
                            f"0..{schedule.num_microbatches - 1}")
    if schedule.rank_of(action.stage) != pp_rank:
        raise ScheduleError(f"rank {pp_rank}: {action} belongs on rank {schedule.rank_of(action.stage)}, "
                            f"which holds stage {action.stage}")


def _check_complete(schedule: Schedule) -> None:
    """Each (stage, microbatch, step) has one F, and one BW or one B and one W; else the first that has not."""
    by_kind: dict[str, list[tuple[int, int, int]]] = {kind: [] for kind in ACTION_KINDS}
    for rank_actions in schedule.actions:
        for a in rank_actions:
            by_kind[a.kind].append((a.stage, a.microbatch, a.step))
    steps = sorted({step for keys in by_kind.values() for (_, _, step) in keys}) or [0]
    if _each_complete_once(by_kind, len(steps) * schedule.num_stages * schedule.num_microbatches):
        return  # the common case, in a few set operations; else find the first incomplete one below
    counts = Counter((stage, mb, step, kind) for kind, keys in by_kind.items() for stage, mb, step in keys)
    for step in steps:
        for stage in range(schedule.num_stages):
            for mb in range(schedule.num_microbatches):
                _check_one_of_each(schedule, stage, mb, {k: counts[(stage, mb, step, k)] for k in ACTION_KINDS})


def _each_complete_once(by_kind: dict[str, list[tuple[int, int, int]]], expected: int) -> bool:
    """Whether each of the ``expected`` (stage, microbatch, step) has one F and one BW, or one B and one W.

    ``by_kind`` holds the (stage, microbatch, step) of valid actions (stages and
    microbatches in range), so ``expected`` distinct forwards are all of them.
    """
    forwards, whole, inputs, weights = (set(by_kind[kind]) for kind in (FORWARD, BACKWARD, BACKWARD_INPUT,
                                                                         BACKWARD_WEIGHT))
    if sum(map(len, (forwards, whole, inputs, weights))) != sum(map(len, by_kind.values())):
        return False  # some action twice
    return (len(forwards) == expected and inputs == weights and whole.isdisjoint(inputs)
            and len(whole) + len(inputs) == expected)


def _check_one_of_each(schedule: Schedule, stage: int, mb: int, count: dict[str, int]) -> None:
    """The counts of each action kind of one (stage, microbatch) are complete."""
    where = f"stage {stage} (rank {schedule.rank_of(stage)}) microbatch {mb}"
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


def _check_rank_order(pp_rank: int, rank_actions: tuple[Action, ...]) -> None:
    """On ``pp_rank``, each B/BW comes after its F and each W after its B."""
    done: set[tuple[str, int, int, int]] = set()
    prerequisite = {BACKWARD: FORWARD, BACKWARD_INPUT: FORWARD, BACKWARD_WEIGHT: BACKWARD_INPUT}
    for action in rank_actions:
        needed = prerequisite.get(action.kind)
        if needed is not None and (needed, action.stage, action.microbatch, action.step) not in done:
            raise ScheduleError(f"rank {pp_rank}: {action} comes before its {needed} on this rank")
        done.add((action.kind, action.stage, action.microbatch, action.step))


@gc_paused
def check_plan(schedule: Schedule, plan: CommPlan) -> None:
    """Per-pair message order, then progress under buffered and under NCCL-like sends."""
    _check_numbered_plan(schedule, number_plan(plan, schedule))


def _check_numbered_plan(schedule: Schedule, plan: NumberedPlan) -> None:
    """``check_plan`` on a plan whose messages are numbers."""
    _check_numbered_pair_order(plan)
    program = compile_plan(schedule, plan)
    nccl_like = run(program, rendezvous=True)
    if not nccl_like.deadlocked:
        return  # buffered sends make messages available no later, so that replay would finish too
    buffered = run(program)
    if buffered.deadlocked:
        raise ScheduleError(f"{schedule.name}: {buffered.deadlock_message()}")
    raise ScheduleError(f"{schedule.name} hangs with NCCL-like blocking sends: {nccl_like.deadlock_message()}")


def check_pair_order(plan: CommPlan) -> None:
    """For each pair (src -> dst), dst posts its receives in exactly the order src posts its sends."""
    _check_numbered_pair_order(number_plan(plan))


def _check_numbered_pair_order(plan: NumberedPlan) -> None:
    """``check_pair_order`` on a plan whose messages are numbers (equal numbers: equal messages)."""
    sent_by_pair = plan.planned_sends()
    received_by_pair: dict[tuple[int, int], list[int]] = {}
    src_ranks = plan.src_ranks
    for dst_rank in range(plan.num_ranks):
        for number in plan.posted_receives(dst_rank):
            pair = (src_ranks[number], dst_rank)
            received = received_by_pair.get(pair)
            if received is None:
                received = received_by_pair[pair] = []
            received.append(number)
    for src_rank, dst_rank in sorted(set(sent_by_pair) | set(received_by_pair)):
        sent = sent_by_pair.get((src_rank, dst_rank), [])
        received = received_by_pair.get((src_rank, dst_rank), [])
        if sent != received:
            raise ScheduleError(_order_mismatch(src_rank, dst_rank, plan.as_messages(sent),
                                                plan.as_messages(received)))


def _order_mismatch(src_rank: int, dst_rank: int, sent: list[Message], received: list[Message]) -> str:
    for index, (sent_message, received_message) in enumerate(zip(sent, received)):
        if sent_message != received_message:
            return (f"rank {dst_rank} posts receive #{index} from rank {src_rank} for {received_message}, "
                    f"but rank {src_rank} sends {sent_message} there")
    return (f"rank {src_rank} sends {len(sent)} messages to rank {dst_rank}, "
            f"which posts {len(received)} receives from it")
