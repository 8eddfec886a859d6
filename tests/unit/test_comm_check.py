"""The communication plan and the checker: derived messages, per-pair order, deadlocks, broken schedules."""

import pytest

from ppctl.pipeline.check import check_pair_order, check_plan, check_schedule
from ppctl.pipeline.comm import (
    ActionStep,
    Message,
    initial_receives,
    plan_communication,
    posted_receives,
    receive_order,
    send_order,
)
from ppctl.pipeline.schedules import SCHEDULE_SPECS, Action, Schedule, ScheduleError, build_schedule
from ppctl.pipeline.simulate import replay

IMPLEMENTED = [name for name, spec in SCHEDULE_SPECS.items() if spec.implemented]


def sweep():
    """(name, pp, vpp, num_microbatches) over pp 1..8, vpp 1..4 (interleaved only), several counts."""
    for name in IMPLEMENTED:
        for pp in range(1, 9):
            for vpp in (range(1, 5) if SCHEDULE_SPECS[name].multi_chunk else [1]):
                for num_microbatches in sorted({1, pp, 2 * pp, 3 * pp + 1, 8, 16}):
                    if SCHEDULE_SPECS[name].microbatch_error(pp, vpp, num_microbatches) is None:
                        yield name, pp, vpp, num_microbatches


def with_actions(schedule: Schedule, actions) -> Schedule:
    return Schedule(schedule.name, schedule.pp, schedule.chunks_per_rank, schedule.num_microbatches,
                    schedule.placement, tuple(tuple(rank_actions) for rank_actions in actions))


def parse(text: str) -> list[Action]:
    """``"F0.1 BW0.0"`` -> [Action("F", 0, 1), Action("BW", 0, 0)]."""
    actions = []
    for item in text.split():
        kind = item.rstrip("0123456789.")
        stage, microbatch = item[len(kind):].split(".")
        actions.append(Action(kind, int(stage), int(microbatch)))
    return actions


# --- the plan -------------------------------------------------------------------------------

def test_message_is_local_when_both_stages_share_a_rank():
    assert Message("act", 0, 1, 0, 0, 0).local
    assert not Message("grad", 1, 0, 0, 1, 0).local


def test_plan_of_1f1b_on_two_ranks():
    schedule = build_schedule("1f1b", 2, 1, 2)
    plan = plan_communication(schedule)
    act = {mb: Message("act", 0, 1, mb, 0, 1) for mb in range(2)}
    grad = {mb: Message("grad", 1, 0, mb, 1, 0) for mb in range(2)}
    assert plan[0] == [
        ActionStep(Action("F", 0, 0), (), (), (act[0],), ()),
        ActionStep(Action("F", 0, 1), (), (), (act[1],), (grad[0],)),
        ActionStep(Action("BW", 0, 0), (grad[0],), (), (), (grad[1],)),
        ActionStep(Action("BW", 0, 1), (grad[1],), (), (), ()),
    ]
    assert initial_receives(plan, 1) == (act[0],)
    assert [step.waits for step in plan[1]] == [(act[0],), (), (act[1],), ()]
    assert [step.sends for step in plan[1]] == [(), (grad[0],), (), (grad[1],)]


def test_single_rank_messages_are_all_local():
    plan = plan_communication(build_schedule("interleaved_1f1b", 1, 3, 2))
    steps = plan[0]
    assert all(not step.waits and not step.sends and not step.prefetch for step in steps)
    forward_of_stage_1 = next(step for step in steps if step.action == Action("F", 1, 0))
    assert forward_of_stage_1.local_inputs == (Message("act", 0, 1, 0, 0, 0),)
    assert initial_receives(plan, 0) == ()


@pytest.mark.parametrize("name, pp, vpp, num_microbatches",
                         [("1f1b", 4, 1, 8), ("gpipe", 3, 1, 5), ("interleaved_1f1b", 4, 2, 8),
                          ("interleaved_1f1b", 3, 3, 7), ("interleaved_1f1b", 4, 2, 3)])
def test_receives_are_posted_in_send_order_and_ahead_of_use(name, pp, vpp, num_microbatches):
    plan = plan_communication(build_schedule(name, pp, vpp, num_microbatches))
    for src in range(pp):
        for dst in range(pp):
            assert receive_order(plan, dst, src) == send_order(plan, src, dst)
    for pp_rank, steps in enumerate(plan):
        posted = set(initial_receives(plan, pp_rank))
        for step in steps:
            assert set(step.waits) <= posted, f"rank {pp_rank} {step.action} waits for an unposted receive"
            posted.update(step.prefetch)
        assert len(posted_receives(plan, pp_rank)) == len(posted)


def test_every_remote_message_is_sent_once_and_received_once():
    schedule = build_schedule("interleaved_1f1b", 4, 2, 8)
    plan = plan_communication(schedule)
    sent = [m for steps in plan for step in steps for m in step.sends]
    received = [m for pp_rank in range(4) for m in posted_receives(plan, pp_rank)]
    assert len(sent) == len(set(sent)) == len(received) and set(sent) == set(received)
    # interleaved: 2 * (stages - 1) messages per microbatch, all remote with pp > 1
    assert len(sent) == 8 * 2 * (schedule.num_stages - 1)


def test_plan_refuses_an_input_nobody_produces():
    schedule = build_schedule("1f1b", 2, 1, 2)
    broken = with_actions(schedule, [schedule.actions[0][1:], schedule.actions[1]])  # rank 0 lost F0.0
    with pytest.raises(ScheduleError, match=r"rank 1: F\(stage 1, mb 0\) needs act of microbatch 0 from stage 0"):
        plan_communication(broken)


# --- the checker: the sweep -----------------------------------------------------------------

@pytest.mark.parametrize("name, pp, vpp, num_microbatches", list(sweep()))
def test_every_implemented_schedule_passes_the_checker(name, pp, vpp, num_microbatches):
    check_schedule(build_schedule(name, pp, vpp, num_microbatches))


def test_interleaved_passes_for_every_microbatch_count_up_to_5pp():
    for pp in (2, 3, 5):
        for vpp in (2, 3):
            for num_microbatches in range(1, 5 * pp + 1):
                check_schedule(build_schedule("interleaved_1f1b", pp, vpp, num_microbatches))


# --- the checker: broken schedules --------------------------------------------------------

def two_rank_1f1b() -> Schedule:
    return build_schedule("1f1b", 2, 1, 2)


def test_missing_forward_is_reported():
    schedule = two_rank_1f1b()
    broken = with_actions(schedule, [parse("F0.0 BW0.0 BW0.1"), schedule.actions[1]])
    with pytest.raises(ScheduleError, match=r"stage 0 \(rank 0\) microbatch 1 has 0 forwards, expected exactly 1"):
        check_schedule(broken)


def test_duplicate_backward_is_reported():
    schedule = two_rank_1f1b()
    broken = with_actions(schedule, [parse("F0.0 F0.1 BW0.0 BW0.1 BW0.1"), schedule.actions[1]])
    with pytest.raises(ScheduleError, match="stage 0 .* microbatch 1 has 2 backwards, expected exactly 1"):
        check_schedule(broken)


def test_mixed_split_and_unsplit_backward_is_reported():
    schedule = two_rank_1f1b()
    broken = with_actions(schedule, [parse("F0.0 F0.1 BW0.0 B0.1 W0.1 BW0.1"), schedule.actions[1]])
    with pytest.raises(ScheduleError, match="mixes an unsplit BW with split B/W"):
        check_schedule(broken)


def test_backward_before_forward_is_reported():
    schedule = two_rank_1f1b()
    broken = with_actions(schedule, [schedule.actions[0], parse("F1.0 BW1.1 BW1.0 F1.1")])
    with pytest.raises(ScheduleError, match=r"rank 1: BW\(stage 1, mb 1\) comes before its F on this rank"):
        check_schedule(broken)


def test_weight_gradient_before_input_gradient_is_reported():
    schedule = build_schedule("1f1b", 1, 1, 1)
    broken = with_actions(schedule, [parse("F0.0 W0.0 B0.0")])
    with pytest.raises(ScheduleError, match=r"W\(stage 0, mb 0\) comes before its B"):
        check_schedule(broken)


def test_action_on_the_wrong_rank_is_reported():
    schedule = two_rank_1f1b()
    broken = with_actions(schedule, [parse("F0.0 F0.1 F1.0 BW0.0 BW0.1"), parse("F1.1 BW1.0 BW1.1")])
    with pytest.raises(ScheduleError, match=r"rank 0: F\(stage 1, mb 0\) belongs on rank 1"):
        check_schedule(broken)


def test_bad_placement_is_reported():
    schedule = two_rank_1f1b()
    broken = Schedule("x", 2, 1, 2, (0, 0), schedule.actions)
    with pytest.raises(ScheduleError, match="rank 0 holds 2 stages, expected chunks_per_rank = 1"):
        check_schedule(broken)


def test_cross_rank_cycle_is_a_deadlock_naming_each_stuck_rank():
    schedule = two_rank_1f1b()
    # rank 0 waits for the gradient of mb 0 before sending mb 1; rank 1 wants mb 1 first.
    broken = with_actions(schedule, [parse("F0.0 BW0.0 F0.1 BW0.1"), parse("F1.1 F1.0 BW1.0 BW1.1")])
    with pytest.raises(ScheduleError) as error:
        check_schedule(broken)
    message = str(error.value)
    assert "deadlock" in message and "\n" not in message
    assert r"rank 0 stuck at BW(stage 0, mb 0) waiting for grad mb 0" in message
    assert r"rank 1 stuck at F(stage 1, mb 1) waiting for act mb 1" in message


def test_mismatched_pair_order_is_reported():
    plan = plan_communication(build_schedule("gpipe", 2, 1, 3))
    receiver = plan[1]
    # rank 1 posts act mb 2 before act mb 1, while rank 0 sends them the other way round
    index_1 = next(i for i, step in enumerate(receiver) if any(m.microbatch == 1 for m in step.prefetch))
    index_2 = next(i for i, step in enumerate(receiver) if any(m.microbatch == 2 for m in step.prefetch))
    swapped = list(receiver)
    swapped[index_1] = ActionStep(**{**vars_of(receiver[index_1]), "prefetch": receiver[index_2].prefetch})
    swapped[index_2] = ActionStep(**{**vars_of(receiver[index_2]), "prefetch": receiver[index_1].prefetch})
    with pytest.raises(ScheduleError, match="rank 1 posts receive #1 from rank 0 for act mb 2 .* but rank 0 sends "
                                            "act mb 1"):
        check_pair_order([plan[0], swapped])


def vars_of(step: ActionStep) -> dict:
    return {"action": step.action, "waits": step.waits, "local_inputs": step.local_inputs, "sends": step.sends,
            "prefetch": step.prefetch}


def just_in_time(plan):
    """Each receive posted only in the batch right before the action that waits for it."""
    return [[ActionStep(step.action, step.waits, step.local_inputs, step.sends,
                        steps[index + 1].waits if index + 1 < len(steps) else ())
             for index, step in enumerate(steps)] for steps in plan]


def test_nccl_like_hang_is_caught_when_receives_come_too_late():
    schedule = build_schedule("interleaved_1f1b", 2, 2, 4)
    late = just_in_time(plan_communication(schedule))
    check_pair_order(late)
    assert not replay(schedule, late).deadlocked  # buffered sends: fine
    stuck = replay(schedule, late, rendezvous=True)
    assert stuck.deadlocked and stuck.stalled_batches
    with pytest.raises(ScheduleError, match="hangs with NCCL-like blocking sends: deadlock: .*p2p stream blocked "
                                            "on send grad"):
        check_plan(schedule, late)


def test_the_derived_plan_survives_nccl_like_sends_where_just_in_time_fails():
    schedule = build_schedule("interleaved_1f1b", 2, 2, 4)
    check_plan(schedule, plan_communication(schedule))
    assert not replay(schedule, plan_communication(schedule), rendezvous=True).deadlocked


def test_a_receive_prefetched_too_late_is_posted_before_its_wait():
    schedule = build_schedule("1f1b", 2, 1, 2)
    plan = plan_communication(schedule)
    grad_0, grad_1 = Message("grad", 1, 0, 0, 1, 0), Message("grad", 1, 0, 1, 1, 0)
    assert plan[0][1].prefetch == (grad_0,) and plan[0][2].prefetch == (grad_1,)
    late = [[plan[0][0], ActionStep(**{**vars_of(plan[0][1]), "prefetch": ()}),
             ActionStep(**{**vars_of(plan[0][2]), "prefetch": (grad_0, grad_1)}), plan[0][3]], plan[1]]
    assert posted_receives(late, 0) == [grad_0, grad_1]  # the runtime posts grad 0 before BW0 waits
    check_plan(schedule, late)
