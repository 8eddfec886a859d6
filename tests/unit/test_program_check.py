"""The lowered program and the checker: derived messages, receive posting, per-pair order, deadlocks."""

import ast
import dataclasses
import json
import random
import re
from pathlib import Path

import pytest

from ppctl.parallel.placement import Placement
from ppctl.pipeline.check import check_program, check_schedule
from ppctl.pipeline.kept import kept_schedule, kept_sends
from ppctl.pipeline.program import Message, Program, Step, lower, sends_only
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


def spelled(program: Program, rank: int) -> list[tuple]:
    """``rank``'s steps with message numbers replaced by messages: (action, inputs, local output, sends, receives)."""
    messages = program.messages
    return [(step.action, tuple(messages[n] for n in step.inputs),
             None if step.local_output is None else messages[step.local_output],
             tuple(messages[n] for n in step.sends), tuple(messages[n] for n in step.receives))
            for step in program.steps[rank]]


def with_receives(program: Program, rank: int, receives: list[tuple[int, ...]], initial=None) -> Program:
    """``program`` with ``rank``'s per-step receives (and initial receives, if given) replaced."""
    steps = list(program.steps)
    steps[rank] = tuple(step._replace(receives=tuple(posted)) for step, posted in zip(steps[rank], receives))
    initials = list(program.initial_receives)
    if initial is not None:
        initials[rank] = tuple(initial)
    return dataclasses.replace(program, steps=tuple(steps), initial_receives=tuple(initials))


# --- the program ----------------------------------------------------------------------------

def test_message_is_local_when_both_stages_share_a_rank():
    assert Message("act", 0, 1, 0, 0, 0).local
    assert not Message("grad", 1, 0, 0, 1, 0).local


def test_program_of_1f1b_on_two_ranks():
    program = lower(build_schedule("1f1b", 2, 1, 2))
    act = {mb: Message("act", 0, 1, mb, 0, 1) for mb in range(2)}
    grad = {mb: Message("grad", 1, 0, mb, 1, 0) for mb in range(2)}
    assert spelled(program, 0) == [
        (Action("F", 0, 0), (), None, (act[0],), ()),
        (Action("F", 0, 1), (), None, (act[1],), (grad[0],)),
        (Action("BW", 0, 0), (grad[0],), None, (), (grad[1],)),
        (Action("BW", 0, 1), (grad[1],), None, (), ()),
    ]
    assert [program.messages[n] for n in program.initial_receives[1]] == [act[0]]
    assert [inputs for _, inputs, _, _, _ in spelled(program, 1)] == [(act[0],), (), (act[1],), ()]
    assert [sends for _, _, _, sends, _ in spelled(program, 1)] == [(), (grad[0],), (), (grad[1],)]
    assert all(isinstance(step, Step) for steps in program.steps for step in steps)


def test_single_rank_messages_are_all_local():
    program = lower(build_schedule("interleaved_1f1b", 1, 3, 2))
    steps = spelled(program, 0)
    assert all(not sends and not receives for _, _, _, sends, receives in steps)
    forward_of_stage_1 = next(step for step in steps if step[0] == Action("F", 1, 0))
    assert forward_of_stage_1[1] == (Message("act", 0, 1, 0, 0, 0),)
    forward_of_stage_0 = next(step for step in steps if step[0] == Action("F", 0, 0))
    assert forward_of_stage_0[2] == Message("act", 0, 1, 0, 0, 0)
    assert program.initial_receives == ((),)


@pytest.mark.parametrize("name, pp, vpp, num_microbatches",
                         [("1f1b", 4, 1, 8), ("gpipe", 3, 1, 5), ("interleaved_1f1b", 4, 2, 8),
                          ("interleaved_1f1b", 3, 3, 7), ("interleaved_1f1b", 4, 2, 3), ("dualpipev", 4, 2, 8)])
def test_receives_are_posted_in_send_order_and_ahead_of_use(name, pp, vpp, num_microbatches):
    program = lower(build_schedule(name, pp, vpp, num_microbatches))
    assert program.receives_by_pair() == program.sends_by_pair()
    for pp_rank, steps in enumerate(program.steps):
        posted = set(program.initial_receives[pp_rank])
        for step in steps:
            remote = {n for n in step.inputs if not program.messages[n].local}
            assert remote <= posted, f"rank {pp_rank} {step.action} waits for an unposted receive"
            posted.update(step.receives)
        assert len(program.posted_receives(pp_rank)) == len(posted)


def test_every_remote_message_is_sent_once_and_received_once():
    schedule = build_schedule("interleaved_1f1b", 4, 2, 8)
    program = lower(schedule)
    sent = [n for steps in program.steps for step in steps for n in step.sends]
    received = [n for pp_rank in range(4) for n in program.posted_receives(pp_rank)]
    assert len(sent) == len(set(sent)) == len(received) and set(sent) == set(received)
    # interleaved: 2 * (stages - 1) messages per microbatch, all remote with pp > 1
    assert len(sent) == len(program.messages) == 8 * 2 * (schedule.placement.num_stages - 1)


def test_lowering_refuses_an_input_nobody_produces():
    schedule = build_schedule("1f1b", 2, 1, 2)
    broken = with_actions(schedule, [schedule.actions[0][1:], schedule.actions[1]])  # rank 0 lost F0.0
    with pytest.raises(ScheduleError, match=r"rank 1: F\(stage 1, mb 0\) needs act of microbatch 0 from stage 0"):
        lower(broken)


def test_the_json_form_names_every_message_and_step():
    program = lower(build_schedule("dualpipev", 2, 2, 4))
    data = json.loads(json.dumps(program.to_json()))
    assert [Message(**message) for message in data["messages"]] == list(program.messages)
    for pp_rank, rank in enumerate(data["ranks"]):
        assert rank["rank"] == pp_rank and tuple(rank["initial_receives"]) == program.initial_receives[pp_rank]
        assert tuple(rank["overlapped"]) == program.schedule.pair_starts(pp_rank)
        steps = tuple(Step(Action(step["kind"], step["stage"], step["microbatch"]), tuple(step["inputs"]),
                           step["local_output"], tuple(step["sends"]), tuple(step["receives"]))
                      for step in rank["steps"])
        assert steps == program.steps[pp_rank]


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


def walked_rank_order_problem(pp_rank, rank_actions):
    """The rank-order check as it walked the actions one by one (before its C loops): the reference; its line or
    None."""
    done, prerequisite = set(), {"BW": "F", "B": "F", "W": "B"}
    for action in rank_actions:
        needed = prerequisite.get(action.kind)
        if needed is not None and (needed, action.stage, action.microbatch) not in done:
            return f"rank {pp_rank}: {action} comes before its {needed} on this rank"
        done.add((action.kind, action.stage, action.microbatch))
    return None


@pytest.mark.parametrize("seed", range(60))
def test_the_rank_order_check_refuses_what_the_walk_refused(seed):
    """Random actions of a few stages and microbatches, repeats and every order included: the same first refusal."""
    from ppctl.pipeline.check import _check_rank_order

    rng = random.Random(seed)
    actions = tuple(Action(rng.choice(["F", "F", "B", "W", "BW"]), rng.randint(0, 2), rng.randint(0, 2))
                    for _ in range(rng.randint(0, 25)))
    expected = walked_rank_order_problem(3, actions)
    if expected is None:
        _check_rank_order(3, actions)
    else:
        with pytest.raises(ScheduleError, match=re.escape(expected) + "$"):
            _check_rank_order(3, actions)


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
    program = lower(build_schedule("gpipe", 2, 1, 3))
    act = {program.messages[n].microbatch: n for n in program.posted_receives(1)}
    assert [step.receives for step in program.steps[1]][:2] == [(act[1],), (act[2],)]
    # rank 1 posts act mb 2 before act mb 1 (both in time), while rank 0 sends them the other way round
    swapped = with_receives(program, 1, [(act[2], act[1])] + [()] * 5)
    with pytest.raises(ScheduleError, match="rank 1 posts receive #1 from rank 0 for act mb 2 .* but rank 0 sends "
                                            "act mb 1"):
        check_program(swapped)


def just_in_time(program: Program) -> Program:
    """Each receive posted only in the batch right before the step that waits for it."""
    for rank, steps in enumerate(program.steps):
        remote = [tuple(n for n in step.inputs if not program.messages[n].local) for step in steps]
        program = with_receives(program, rank, remote[1:] + [()], initial=remote[0] if remote else ())
    return program


def test_nccl_like_hang_is_caught_when_receives_come_too_late():
    late = just_in_time(lower(build_schedule("interleaved_1f1b", 2, 2, 4)))
    assert late.receives_by_pair() == late.sends_by_pair()
    assert not replay(late).deadlocked  # buffered sends: fine
    stuck = replay(late, rendezvous=True)
    assert stuck.deadlocked and stuck.stalled_batches
    with pytest.raises(ScheduleError, match="hangs with NCCL-like blocking sends: deadlock: .*p2p stream blocked "
                                            "on send grad"):
        check_program(late)


def test_the_lowered_program_survives_nccl_like_sends_where_just_in_time_fails():
    program = lower(build_schedule("interleaved_1f1b", 2, 2, 4))
    check_program(program)
    assert not replay(program, rendezvous=True).deadlocked


def test_a_wait_for_a_receive_not_yet_posted_is_refused():
    program = lower(build_schedule("1f1b", 2, 1, 2))
    receives = [step.receives for step in program.steps[0]]
    assert [len(posted) for posted in receives] == [0, 1, 1, 0]
    late = with_receives(program, 0, [(), (), receives[1] + receives[2], ()])  # grad 0 posted after BW0 waits
    with pytest.raises(ScheduleError, match=r"rank 0: BW\(stage 0, mb 0\) waits for grad mb 0 stage 1->0 "
                                            r"\(rank 1->0\), whose receive the rank has not posted before"):
        check_program(late)


def test_a_receive_posted_twice_or_for_another_rank_is_refused():
    program = lower(build_schedule("1f1b", 2, 1, 2))
    receives = [step.receives for step in program.steps[0]]
    with pytest.raises(ScheduleError, match="rank 0 posts a receive twice"):
        check_program(with_receives(program, 0, [(), receives[1] * 2, receives[2], ()]))
    sent_by_rank_0 = program.steps[0][0].sends
    with pytest.raises(ScheduleError, match="rank 0 posts a receive for act mb 0 .* which is not a message from "
                                            "another rank to it"):
        check_program(with_receives(program, 0, receives, initial=sent_by_rank_0))


# --- the program did not change: small programs against frozen ones ----------------------------------

FROZEN_PLANS = {  # recorded from the planner before the module split, the speed-up and the lowering
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


def step_text(program: Program, step: Step) -> str:
    """``F0.3|waits|local inputs|sends|receives``, each message as ``act0>1.3@0>1`` (stages.mb@ranks)."""
    def text(numbers):
        return ",".join(f"{m.kind}{m.src_stage}>{m.dst_stage}.{m.microbatch}@{m.src_rank}>{m.dst_rank}"
                        for m in (program.messages[n] for n in numbers))
    action = step.action
    inputs = [(n, program.messages[n].local) for n in step.inputs]
    return "|".join([f"{action.kind}{action.stage}.{action.microbatch}",
                     text(n for n, local in inputs if not local), text(n for n, local in inputs if local),
                     text(step.sends), text(step.receives)])


@pytest.mark.parametrize("case", list(FROZEN_PLANS))
def test_the_program_is_the_frozen_one(case):
    program = lower(build_schedule(*case))
    assert [" ".join(step_text(program, step) for step in steps) for steps in program.steps] == FROZEN_PLANS[case]


# --- kept schedules and sends: the planner's and validation's shared builder ----------------------

@pytest.mark.parametrize("case", [("1f1b", 4, 1, 8), ("zbv", 4, 2, 9), ("dualpipev", 4, 2, 10),
                                  ("interleaved_1f1b", 2, 2, 5)])
def test_lowering_from_kept_sends_is_the_plain_lowering(case):
    kept_schedule.cache_clear()  # other tests keep sizes too: a schedule evicted and built again is another object
    kept_sends.cache_clear()
    schedule = kept_schedule(*case)
    assert kept_schedule(*case) is schedule and kept_sends(*case).schedule is schedule
    assert schedule == build_schedule(*case)
    assert lower(schedule, kept_sends(*case)) == lower(schedule) == check_schedule(schedule, kept_sends(*case))


def test_a_schedule_lacking_a_message_is_refused_alike_with_or_without_its_sends():
    schedule = build_schedule("1f1b", 2, 1, 2)
    broken = with_actions(schedule, [tuple(a for a in schedule.actions[0] if (a.kind, a.microbatch) != ("F", 1)),
                                     schedule.actions[1]])
    with pytest.raises(ScheduleError) as plain:
        check_schedule(broken)
    with pytest.raises(ScheduleError):
        sends_only(broken)  # so validation passes no sends: the checker's own order names the problem
    assert "forwards, expected exactly 1" in str(plain.value)


def test_kept_sizes_that_cannot_be_built_raise_as_the_builder_does():
    with pytest.raises(ScheduleError) as built:
        build_schedule("dualpipev", 4, 2, 3)
    with pytest.raises(ScheduleError, match=re.escape(str(built.value))):
        kept_sends("dualpipev", 4, 2, 3)


# --- module structure: no import cycle, nothing low imports something above it --------------------

PIPELINE = Path(__file__).resolve().parents[2] / "ppctl" / "pipeline"
LAYERS = {"schedules": 0, "replay": 1, "program": 2, "shared_cores": 2, "simulate": 3, "check": 3, "kept": 3,
          "render": 4}


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


def test_only_the_program_module_steps_from_a_stage_to_its_neighbour():
    neighbour = re.compile(r"stage\s*[-+]\s*(1\b|direction)")
    for path in sorted(PIPELINE.rglob("*.py")):
        if path.name != "program.py":
            assert not neighbour.search(path.read_text()), f"{path.name} derives an adjacent stage itself"

