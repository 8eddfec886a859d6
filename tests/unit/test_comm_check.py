"""The communication plan and the checker: derived messages, per-pair order, deadlocks, broken schedules."""

import ast
import re
from pathlib import Path

import pytest

from ppctl.parallel.placement import Placement
from ppctl.pipeline import simulate as simulate_module
from ppctl.pipeline.check import check_pair_order, check_plan, check_schedule
from ppctl.pipeline.comm import (
    NO_MESSAGE,
    ActionStep,
    Message,
    initial_receives,
    number_plan,
    plan_communication,
    plan_numbered,
    planned_sends,
    posted_receives,
    receive_order,
    send_order,
)
from ppctl.pipeline.replay import Costs, action_durations
from ppctl.pipeline.schedules import SCHEDULE_SPECS, Action, Schedule, ScheduleError, build_schedule
from ppctl.pipeline.simulate import replay

ALL_SCHEDULES = list(SCHEDULE_SPECS)


def sweep():
    """(name, pp, vpp, num_microbatches) over pp 1..8, vpp 1..4 (interleaved; a V: 2), several counts.

    Each count its schedule allows; a schedule refusing a single microbatch (DualPipe's need at
    least 2*pp, dualpipe an even count) also gets 2*pp+1 and 2*pp+2, its smallest counts.
    """
    for name in ALL_SCHEDULES:
        spec = SCHEDULE_SPECS[name]
        for pp in range(1, 9):
            vpps = [spec.chunks_per_rank] if spec.chunks_per_rank else range(1, 5) if spec.multi_chunk else [1]
            for vpp in vpps:
                counts = {1, pp, 2 * pp, 3 * pp + 1, 8, 16}
                if spec.microbatch_error(pp, vpp, 1) is not None:
                    counts |= {2 * pp + 1, 2 * pp + 2}
                for num_microbatches in sorted(counts):
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
    assert len(sent) == 8 * 2 * (schedule.placement.num_stages - 1)


def test_plan_refuses_an_input_nobody_produces():
    schedule = build_schedule("1f1b", 2, 1, 2)
    broken = with_actions(schedule, [schedule.actions[0][1:], schedule.actions[1]])  # rank 0 lost F0.0
    with pytest.raises(ScheduleError, match=r"rank 1: F\(stage 1, mb 0\) needs act of microbatch 0 from stage 0"):
        plan_communication(broken)


# --- the checker: the sweep -----------------------------------------------------------------

@pytest.mark.parametrize("name, pp, vpp, num_microbatches", list(sweep()))
def test_every_schedule_passes_the_checker(name, pp, vpp, num_microbatches):
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
    broken = Schedule("x", 2, 1, 2, Placement((0, 0)), schedule.actions)
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


# --- the plan did not change: small plans against frozen ones ----------------------------------

FROZEN_PLANS = {  # recorded from the planner before the module split and the speed-up
    ("1f1b", 4, 1, 8): [
        "F0.0|||act0>1.0@0>1| F0.1|||act0>1.1@0>1| F0.2|||act0>1.2@0>1| F0.3|||act0>1.3@0>1|grad1>0.0@1>0 "
        "BW0.0|grad1>0.0@1>0||| F0.4|||act0>1.4@0>1|grad1>0.1@1>0 BW0.1|grad1>0.1@1>0||| "
        "F0.5|||act0>1.5@0>1|grad1>0.2@1>0 BW0.2|grad1>0.2@1>0||| F0.6|||act0>1.6@0>1|grad1>0.3@1>0 "
        "BW0.3|grad1>0.3@1>0||| F0.7|||act0>1.7@0>1|grad1>0.4@1>0 BW0.4|grad1>0.4@1>0|||grad1>0.5@1>0 "
        "BW0.5|grad1>0.5@1>0|||grad1>0.6@1>0 BW0.6|grad1>0.6@1>0|||grad1>0.7@1>0 BW0.7|grad1>0.7@1>0|||",
        "F1.0|act0>1.0@0>1||act1>2.0@1>2|act0>1.1@0>1 F1.1|act0>1.1@0>1||act1>2.1@1>2|act0>1.2@0>1 "
        "F1.2|act0>1.2@0>1||act1>2.2@1>2|act0>1.3@0>1,grad2>1.0@2>1 BW1.0|grad2>1.0@2>1||grad1>0.0@1>0| "
        "F1.3|act0>1.3@0>1||act1>2.3@1>2|grad2>1.1@2>1 BW1.1|grad2>1.1@2>1||grad1>0.1@1>0|act0>1.4@0>1 "
        "F1.4|act0>1.4@0>1||act1>2.4@1>2|grad2>1.2@2>1 BW1.2|grad2>1.2@2>1||grad1>0.2@1>0|act0>1.5@0>1 "
        "F1.5|act0>1.5@0>1||act1>2.5@1>2|grad2>1.3@2>1 BW1.3|grad2>1.3@2>1||grad1>0.3@1>0|act0>1.6@0>1 "
        "F1.6|act0>1.6@0>1||act1>2.6@1>2|grad2>1.4@2>1 BW1.4|grad2>1.4@2>1||grad1>0.4@1>0|act0>1.7@0>1 "
        "F1.7|act0>1.7@0>1||act1>2.7@1>2|grad2>1.5@2>1 BW1.5|grad2>1.5@2>1||grad1>0.5@1>0|grad2>1.6@2>1 "
        "BW1.6|grad2>1.6@2>1||grad1>0.6@1>0|grad2>1.7@2>1 BW1.7|grad2>1.7@2>1||grad1>0.7@1>0|",
        "F2.0|act1>2.0@1>2||act2>3.0@2>3|act1>2.1@1>2 "
        "F2.1|act1>2.1@1>2||act2>3.1@2>3|act1>2.2@1>2,grad3>2.0@3>2 BW2.0|grad3>2.0@3>2||grad2>1.0@2>1| "
        "F2.2|act1>2.2@1>2||act2>3.2@2>3|grad3>2.1@3>2 BW2.1|grad3>2.1@3>2||grad2>1.1@2>1|act1>2.3@1>2 "
        "F2.3|act1>2.3@1>2||act2>3.3@2>3|grad3>2.2@3>2 BW2.2|grad3>2.2@3>2||grad2>1.2@2>1|act1>2.4@1>2 "
        "F2.4|act1>2.4@1>2||act2>3.4@2>3|grad3>2.3@3>2 BW2.3|grad3>2.3@3>2||grad2>1.3@2>1|act1>2.5@1>2 "
        "F2.5|act1>2.5@1>2||act2>3.5@2>3|grad3>2.4@3>2 BW2.4|grad3>2.4@3>2||grad2>1.4@2>1|act1>2.6@1>2 "
        "F2.6|act1>2.6@1>2||act2>3.6@2>3|grad3>2.5@3>2 BW2.5|grad3>2.5@3>2||grad2>1.5@2>1|act1>2.7@1>2 "
        "F2.7|act1>2.7@1>2||act2>3.7@2>3|grad3>2.6@3>2 BW2.6|grad3>2.6@3>2||grad2>1.6@2>1|grad3>2.7@3>2 "
        "BW2.7|grad3>2.7@3>2||grad2>1.7@2>1|",
        "F3.0|act2>3.0@2>3|||act2>3.1@2>3 BW3.0|||grad3>2.0@3>2| F3.1|act2>3.1@2>3||| "
        "BW3.1|||grad3>2.1@3>2|act2>3.2@2>3 F3.2|act2>3.2@2>3||| BW3.2|||grad3>2.2@3>2|act2>3.3@2>3 "
        "F3.3|act2>3.3@2>3||| BW3.3|||grad3>2.3@3>2|act2>3.4@2>3 F3.4|act2>3.4@2>3||| "
        "BW3.4|||grad3>2.4@3>2|act2>3.5@2>3 F3.5|act2>3.5@2>3||| BW3.5|||grad3>2.5@3>2|act2>3.6@2>3 "
        "F3.6|act2>3.6@2>3||| BW3.6|||grad3>2.6@3>2|act2>3.7@2>3 F3.7|act2>3.7@2>3||| BW3.7|||grad3>2.7@3>2|",
    ],
    ("interleaved_1f1b", 4, 2, 8): [
        "F0.0|||act0>1.0@0>1| F0.1|||act0>1.1@0>1| F0.2|||act0>1.2@0>1| F0.3|||act0>1.3@0>1|act3>4.0@3>0 "
        "F4.0|act3>4.0@3>0||act4>5.0@0>1|act3>4.1@3>0 F4.1|act3>4.1@3>0||act4>5.1@0>1|act3>4.2@3>0 "
        "F4.2|act3>4.2@3>0||act4>5.2@0>1|act3>4.3@3>0 F4.3|act3>4.3@3>0||act4>5.3@0>1| F0.4|||act0>1.4@0>1| "
        "F0.5|||act0>1.5@0>1| F0.6|||act0>1.6@0>1|grad5>4.0@1>0 BW4.0|grad5>4.0@1>0||grad4>3.0@0>3| "
        "F0.7|||act0>1.7@0>1|grad5>4.1@1>0 BW4.1|grad5>4.1@1>0||grad4>3.1@0>3|grad5>4.2@1>0,act3>4.4@3>0 "
        "F4.4|act3>4.4@3>0||act4>5.4@0>1| BW4.2|grad5>4.2@1>0||grad4>3.2@0>3|grad5>4.3@1>0,act3>4.5@3>0 "
        "F4.5|act3>4.5@3>0||act4>5.5@0>1| BW4.3|grad5>4.3@1>0||grad4>3.3@0>3|grad1>0.0@1>0,act3>4.6@3>0 "
        "F4.6|act3>4.6@3>0||act4>5.6@0>1| BW0.0|grad1>0.0@1>0|||grad1>0.1@1>0,act3>4.7@3>0 "
        "F4.7|act3>4.7@3>0||act4>5.7@0>1| BW0.1|grad1>0.1@1>0|||grad1>0.2@1>0 "
        "BW0.2|grad1>0.2@1>0|||grad1>0.3@1>0 BW0.3|grad1>0.3@1>0|||grad5>4.4@1>0 "
        "BW4.4|grad5>4.4@1>0||grad4>3.4@0>3|grad5>4.5@1>0 BW4.5|grad5>4.5@1>0||grad4>3.5@0>3|grad5>4.6@1>0 "
        "BW4.6|grad5>4.6@1>0||grad4>3.6@0>3|grad5>4.7@1>0 BW4.7|grad5>4.7@1>0||grad4>3.7@0>3|grad1>0.4@1>0 "
        "BW0.4|grad1>0.4@1>0|||grad1>0.5@1>0 BW0.5|grad1>0.5@1>0|||grad1>0.6@1>0 "
        "BW0.6|grad1>0.6@1>0|||grad1>0.7@1>0 BW0.7|grad1>0.7@1>0|||",
        "F1.0|act0>1.0@0>1||act1>2.0@1>2|act0>1.1@0>1 F1.1|act0>1.1@0>1||act1>2.1@1>2|act0>1.2@0>1 "
        "F1.2|act0>1.2@0>1||act1>2.2@1>2|act0>1.3@0>1 F1.3|act0>1.3@0>1||act1>2.3@1>2|act4>5.0@0>1 "
        "F5.0|act4>5.0@0>1||act5>6.0@1>2|act4>5.1@0>1 F5.1|act4>5.1@0>1||act5>6.1@1>2|act4>5.2@0>1 "
        "F5.2|act4>5.2@0>1||act5>6.2@1>2|act4>5.3@0>1 F5.3|act4>5.3@0>1||act5>6.3@1>2|act0>1.4@0>1 "
        "F1.4|act0>1.4@0>1||act1>2.4@1>2|act0>1.5@0>1,act0>1.6@0>1,grad6>5.0@2>1 "
        "BW5.0|grad6>5.0@2>1||grad5>4.0@1>0| F1.5|act0>1.5@0>1||act1>2.5@1>2|grad6>5.1@2>1 "
        "BW5.1|grad6>5.1@2>1||grad5>4.1@1>0|act0>1.7@0>1 F1.6|act0>1.6@0>1||act1>2.6@1>2|grad6>5.2@2>1 "
        "BW5.2|grad6>5.2@2>1||grad5>4.2@1>0| F1.7|act0>1.7@0>1||act1>2.7@1>2|act4>5.4@0>1,grad6>5.3@2>1 "
        "BW5.3|grad6>5.3@2>1||grad5>4.3@1>0| F5.4|act4>5.4@0>1||act5>6.4@1>2|act4>5.5@0>1,grad2>1.0@2>1 "
        "BW1.0|grad2>1.0@2>1||grad1>0.0@1>0| F5.5|act4>5.5@0>1||act5>6.5@1>2|act4>5.6@0>1,grad2>1.1@2>1 "
        "BW1.1|grad2>1.1@2>1||grad1>0.1@1>0| F5.6|act4>5.6@0>1||act5>6.6@1>2|act4>5.7@0>1,grad2>1.2@2>1 "
        "BW1.2|grad2>1.2@2>1||grad1>0.2@1>0| F5.7|act4>5.7@0>1||act5>6.7@1>2|grad2>1.3@2>1 "
        "BW1.3|grad2>1.3@2>1||grad1>0.3@1>0|grad6>5.4@2>1 BW5.4|grad6>5.4@2>1||grad5>4.4@1>0|grad6>5.5@2>1 "
        "BW5.5|grad6>5.5@2>1||grad5>4.5@1>0|grad6>5.6@2>1 BW5.6|grad6>5.6@2>1||grad5>4.6@1>0|grad6>5.7@2>1 "
        "BW5.7|grad6>5.7@2>1||grad5>4.7@1>0|grad2>1.4@2>1 BW1.4|grad2>1.4@2>1||grad1>0.4@1>0|grad2>1.5@2>1 "
        "BW1.5|grad2>1.5@2>1||grad1>0.5@1>0|grad2>1.6@2>1 BW1.6|grad2>1.6@2>1||grad1>0.6@1>0|grad2>1.7@2>1 "
        "BW1.7|grad2>1.7@2>1||grad1>0.7@1>0|",
        "F2.0|act1>2.0@1>2||act2>3.0@2>3|act1>2.1@1>2 F2.1|act1>2.1@1>2||act2>3.1@2>3|act1>2.2@1>2 "
        "F2.2|act1>2.2@1>2||act2>3.2@2>3|act1>2.3@1>2 F2.3|act1>2.3@1>2||act2>3.3@2>3|act5>6.0@1>2 "
        "F6.0|act5>6.0@1>2||act6>7.0@2>3|act5>6.1@1>2 F6.1|act5>6.1@1>2||act6>7.1@2>3|act5>6.2@1>2 "
        "F6.2|act5>6.2@1>2||act6>7.2@2>3|act5>6.3@1>2,act1>2.4@1>2,grad7>6.0@3>2 "
        "BW6.0|grad7>6.0@3>2||grad6>5.0@2>1| F6.3|act5>6.3@1>2||act6>7.3@2>3|grad7>6.1@3>2 "
        "BW6.1|grad7>6.1@3>2||grad6>5.1@2>1|act1>2.5@1>2 F2.4|act1>2.4@1>2||act2>3.4@2>3|grad7>6.2@3>2 "
        "BW6.2|grad7>6.2@3>2||grad6>5.2@2>1|act1>2.6@1>2 F2.5|act1>2.5@1>2||act2>3.5@2>3|grad7>6.3@3>2 "
        "BW6.3|grad7>6.3@3>2||grad6>5.3@2>1|act1>2.7@1>2 F2.6|act1>2.6@1>2||act2>3.6@2>3|grad3>2.0@3>2 "
        "BW2.0|grad3>2.0@3>2||grad2>1.0@2>1|act5>6.4@1>2 F2.7|act1>2.7@1>2||act2>3.7@2>3|grad3>2.1@3>2 "
        "BW2.1|grad3>2.1@3>2||grad2>1.1@2>1|act5>6.5@1>2 F6.4|act5>6.4@1>2||act6>7.4@2>3|grad3>2.2@3>2 "
        "BW2.2|grad3>2.2@3>2||grad2>1.2@2>1|act5>6.6@1>2 F6.5|act5>6.5@1>2||act6>7.5@2>3|grad3>2.3@3>2 "
        "BW2.3|grad3>2.3@3>2||grad2>1.3@2>1|act5>6.7@1>2 F6.6|act5>6.6@1>2||act6>7.6@2>3|grad7>6.4@3>2 "
        "BW6.4|grad7>6.4@3>2||grad6>5.4@2>1| F6.7|act5>6.7@1>2||act6>7.7@2>3|grad7>6.5@3>2 "
        "BW6.5|grad7>6.5@3>2||grad6>5.5@2>1|grad7>6.6@3>2 BW6.6|grad7>6.6@3>2||grad6>5.6@2>1|grad7>6.7@3>2 "
        "BW6.7|grad7>6.7@3>2||grad6>5.7@2>1|grad3>2.4@3>2 BW2.4|grad3>2.4@3>2||grad2>1.4@2>1|grad3>2.5@3>2 "
        "BW2.5|grad3>2.5@3>2||grad2>1.5@2>1|grad3>2.6@3>2 BW2.6|grad3>2.6@3>2||grad2>1.6@2>1|grad3>2.7@3>2 "
        "BW2.7|grad3>2.7@3>2||grad2>1.7@2>1|",
        "F3.0|act2>3.0@2>3||act3>4.0@3>0|act2>3.1@2>3 F3.1|act2>3.1@2>3||act3>4.1@3>0|act2>3.2@2>3 "
        "F3.2|act2>3.2@2>3||act3>4.2@3>0|act2>3.3@2>3 F3.3|act2>3.3@2>3||act3>4.3@3>0|act6>7.0@2>3 "
        "F7.0|act6>7.0@2>3|||act6>7.1@2>3,act6>7.2@2>3 BW7.0|||grad7>6.0@3>2| F7.1|act6>7.1@2>3||| "
        "BW7.1|||grad7>6.1@3>2|act6>7.3@2>3 F7.2|act6>7.2@2>3||| "
        "BW7.2|||grad7>6.2@3>2|grad4>3.0@0>3,act2>3.4@2>3 F7.3|act6>7.3@2>3||| "
        "BW7.3|||grad7>6.3@3>2|grad4>3.1@0>3,act2>3.5@2>3 F3.4|act2>3.4@2>3||act3>4.4@3>0| "
        "BW3.0|grad4>3.0@0>3||grad3>2.0@3>2|act2>3.6@2>3 F3.5|act2>3.5@2>3||act3>4.5@3>0|grad4>3.2@0>3 "
        "BW3.1|grad4>3.1@0>3||grad3>2.1@3>2|act2>3.7@2>3 F3.6|act2>3.6@2>3||act3>4.6@3>0|grad4>3.3@0>3 "
        "BW3.2|grad4>3.2@0>3||grad3>2.2@3>2|act6>7.4@2>3 F3.7|act2>3.7@2>3||act3>4.7@3>0| "
        "BW3.3|grad4>3.3@0>3||grad3>2.3@3>2|act6>7.5@2>3 F7.4|act6>7.4@2>3||| "
        "BW7.4|||grad7>6.4@3>2|act6>7.6@2>3 F7.5|act6>7.5@2>3||| BW7.5|||grad7>6.5@3>2|act6>7.7@2>3 "
        "F7.6|act6>7.6@2>3||| BW7.6|||grad7>6.6@3>2|grad4>3.4@0>3 F7.7|act6>7.7@2>3||| "
        "BW7.7|||grad7>6.7@3>2|grad4>3.5@0>3 BW3.4|grad4>3.4@0>3||grad3>2.4@3>2|grad4>3.6@0>3 "
        "BW3.5|grad4>3.5@0>3||grad3>2.5@3>2| BW3.6|grad4>3.6@0>3||grad3>2.6@3>2|grad4>3.7@0>3 "
        "BW3.7|grad4>3.7@0>3||grad3>2.7@3>2|",
    ],
}


def step_text(step: ActionStep) -> str:
    """``F0.3|waits|local inputs|sends|prefetch``, each message as ``act0>1.3@0>1`` (stages.mb@ranks)."""
    def text(messages):
        return ",".join(f"{m.kind}{m.src_stage}>{m.dst_stage}.{m.microbatch}@{m.src_rank}>{m.dst_rank}"
                        for m in messages)
    action = step.action
    return "|".join([f"{action.kind}{action.stage}.{action.microbatch}", text(step.waits),
                     text(step.local_inputs), text(step.sends), text(step.prefetch)])


@pytest.mark.parametrize("case", list(FROZEN_PLANS))
def test_plan_is_the_frozen_one(case):
    plan = plan_communication(build_schedule(*case))
    assert [" ".join(step_text(step) for step in steps) for steps in plan] == FROZEN_PLANS[case]


# --- numbered plans: the planner's and a plan numbered afterwards agree -----------------------------

SMALL_CASES = [("1f1b", 4, 1, 8), ("gpipe", 3, 1, 5), ("interleaved_1f1b", 4, 2, 8), ("interleaved_1f1b", 3, 3, 7),
               ("interleaved_1f1b", 1, 3, 2), ("interleaved_1f1b", 4, 2, 3)]


@pytest.mark.parametrize("name, pp, vpp, num_microbatches", SMALL_CASES)
def test_the_planner_numbered_plan_is_its_plan_numbered(name, pp, vpp, num_microbatches):
    schedule = build_schedule(name, pp, vpp, num_microbatches)
    derived = plan_numbered(schedule)
    plan = derived.message_plan()
    numbered = number_plan(plan, schedule)
    assert numbered.message_plan() == plan
    assert outputs_as_messages(numbered) == outputs_as_messages(derived)
    for pp_rank in range(pp):
        assert derived.as_messages(derived.initial_receives(pp_rank)) == list(initial_receives(plan, pp_rank))
        assert derived.as_messages(derived.posted_receives(pp_rank)) == posted_receives(plan, pp_rank)
        for src_rank in range(pp):
            assert derived.as_messages(derived.send_order(src_rank, pp_rank)) == send_order(plan, src_rank, pp_rank)
    assert {pair: derived.as_messages(numbers) for pair, numbers in derived.planned_sends().items()} == \
        planned_sends(plan)


def outputs_as_messages(numbered):
    """Each step's local hand-over as a Message (None when it has none)."""
    return [[None if number == NO_MESSAGE else numbered.messages[number] for number in rank_outputs]
            for rank_outputs in numbered.local_outputs]


@pytest.mark.parametrize("name, pp, vpp, num_microbatches", SMALL_CASES)
def test_a_plan_posting_each_receive_once_ahead_compiles_as_in_the_general_case(name, pp, vpp, num_microbatches):
    schedule = build_schedule(name, pp, vpp, num_microbatches)
    plan = plan_numbered(schedule)
    durations = action_durations(schedule.chunks_per_rank, Costs(1, 2, 3))
    for pp_rank in range(pp):
        initial = plan.initial_receives(pp_rank)
        assert simulate_module._posts_once_ahead(initial, plan.waits[pp_rank], plan.prefetch[pp_rank])
        general = simulate_module._compiled_steps_posting(plan, pp_rank, set(initial), durations)
        assert simulate_module._compiled_steps(plan, pp_rank, initial, durations) == general


def test_a_plan_posting_a_receive_late_or_twice_takes_the_general_path():
    schedule = build_schedule("1f1b", 2, 1, 2)
    plan = plan_communication(schedule)
    grad_0, grad_1 = Message("grad", 1, 0, 0, 1, 0), Message("grad", 1, 0, 1, 1, 0)
    late = [[plan[0][0], ActionStep(*plan[0][1][:4], ()), ActionStep(*plan[0][2][:4], (grad_0, grad_1)), plan[0][3]],
            plan[1]]
    twice = [[plan[0][0], ActionStep(*plan[0][1][:4], (grad_0, grad_0)), *plan[0][2:]], plan[1]]
    for hand_made in (late, twice):
        numbered = number_plan(hand_made, schedule)
        assert not simulate_module._posts_once_ahead(numbered.initial_receives(0), numbered.waits[0],
                                                     numbered.prefetch[0])
    late_program = simulate_module.compile_plan(schedule, number_plan(late, schedule))
    post_first = [step[4] for step in late_program.steps[0]]  # (inputs, duration, output, sends, post_first, ...)
    assert [[late_program.messages[n] for n in numbers] for numbers in post_first] == [[], [], [grad_0], []]


# --- module structure: no import cycle, nothing low imports something above it --------------------

PIPELINE = Path(__file__).resolve().parents[2] / "ppctl" / "pipeline"
LAYERS = {"schedules": 0, "messages": 1, "replay": 2, "comm": 3, "simulate": 4, "check": 5, "render": 5}


def pipeline_imports() -> dict[str, set[str]]:
    """Module of ppctl/pipeline -> the modules of ppctl/pipeline it imports (anywhere, lazy imports too)."""
    graph: dict[str, set[str]] = {}
    for path in sorted(PIPELINE.rglob("*.py")):
        parts = path.relative_to(PIPELINE).with_suffix("").parts
        if parts == ("__init__",):
            continue
        module = parts[0]
        package = ["ppctl", "pipeline", *parts[:-1]]
        for node in ast.walk(ast.parse(path.read_text())):
            for target in imported_modules(node, package):
                if target != module:
                    graph.setdefault(module, set()).add(target)
        graph.setdefault(module, set())
    return graph


def imported_modules(node: ast.AST, package: list[str]) -> list[str]:
    """The ppctl.pipeline modules (first name under ppctl/pipeline) that an import node names."""
    if isinstance(node, ast.Import):
        names = [alias.name.split(".") for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
        base = package[:len(package) - node.level + 1] if node.level else []
        stem = base + (node.module.split(".") if node.module else [])
        names = [stem] if node.module else [stem + [alias.name] for alias in node.names]
    else:
        return []
    return [name[2] for name in names if name[:2] == ["ppctl", "pipeline"] and len(name) > 2]


def test_pipeline_modules_import_each_other_without_a_cycle():
    graph = pipeline_imports()
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        assert module not in path, f"import cycle: {' -> '.join(path + [module])}"
        if module in done:
            return
        for target in sorted(graph.get(module, ())):
            visit(target, path + [module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])


def test_no_pipeline_module_imports_one_above_it():
    graph = pipeline_imports()
    assert set(LAYERS) <= set(graph)
    for module, targets in graph.items():
        for target in targets:
            if module in LAYERS and target in LAYERS:
                assert LAYERS[target] < LAYERS[module], f"{module} (layer {LAYERS[module]}) imports {target} " \
                                                        f"(layer {LAYERS[target]})"


def test_only_the_messages_module_steps_from_a_stage_to_its_neighbour():
    neighbour = re.compile(r"stage\s*[-+]\s*(1\b|direction)")
    for path in sorted(PIPELINE.rglob("*.py")):
        if path.name != "messages.py":
            assert not neighbour.search(path.read_text()), f"{path.name} derives an adjacent stage itself"

