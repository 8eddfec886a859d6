"""Schedule generators, placements and the registry: exact action orders for small cases."""

import pytest

from ppctl.pipeline.schedules import (
    SCHEDULE_SPECS,
    Action,
    Schedule,
    ScheduleError,
    build_schedule,
)
from ppctl.parallel.placement import Placement, v_placement
from ppctl.pipeline.schedules.interleaved import microbatch_groups

ALL_NAMES = ("gpipe", "1f1b", "pipedream_flush", "pipedream_2bw", "interleaved_1f1b", "looped_bfs", "zb_h1", "interleaved_zb",
             "hanayo", "zbv", "v_half", "v_min", "dualpipe", "dualpipev")


def compact(schedule: Schedule, pp_rank: int) -> list[str]:
    """Actions of one rank as short strings: kind, stage, microbatch (``F2.1`` = F of stage 2, mb 1)."""
    return [f"{a.kind}{a.stage}.{a.microbatch}" for a in schedule.actions[pp_rank]]


# --- registry -------------------------------------------------------------------------------

def test_registry_lists_every_schedule_with_its_flags():
    assert set(SCHEDULE_SPECS) == set(ALL_NAMES)
    assert [n for n, s in SCHEDULE_SPECS.items() if s.multi_chunk] == ["interleaved_1f1b", "looped_bfs",
                                                                      "interleaved_zb", "hanayo", "zbv", "v_half",
                                                                      "v_min", "dualpipe", "dualpipev"]
    assert {n for n, s in SCHEDULE_SPECS.items() if s.splits_backward} == {"zb_h1", "interleaved_zb", "zbv", "v_half",
                                                                           "v_min", "dualpipe", "dualpipev"}
    for name, spec in SCHEDULE_SPECS.items():
        assert spec.name == name and spec.description and "\n" not in spec.description


@pytest.mark.parametrize("name", ALL_NAMES)
def test_microbatch_rule_refuses_zero_and_accepts_enough(name):
    spec = SCHEDULE_SPECS[name]
    vpp = 2 if spec.multi_chunk else 1
    enough = 8 if name.startswith("dualpipe") else 4  # DualPipe's need 2*pp
    assert spec.microbatch_error(4, vpp, enough) is None
    message = spec.microbatch_error(4, vpp, 0)
    assert message and "num_microbatches=0" in message and "\n" not in message


@pytest.mark.parametrize("args, message", [
    (("nope", 2, 1, 4), "unknown; choose one of gpipe"),
    (("1f1b", 0, 1, 4), "pp=0"),
    (("interleaved_1f1b", 2, 0, 4), "vpp=0"),
    (("1f1b", 2, 1, 0), "num_microbatches=0"),
    (("gpipe", 2, 2, 4), "vpp=2 must be 1"),
    (("1f1b", 2, 3, 4), "vpp=3 must be 1"),
])
def test_bad_arguments_raise_schedule_error(args, message):
    with pytest.raises(ScheduleError, match=message):
        build_schedule(*args)


def test_pipedream_flush_is_1f1b_by_its_paper_name():
    for pp, num_microbatches in ((1, 3), (2, 4), (4, 8), (4, 3)):
        alias, original = (build_schedule(name, pp, 1, num_microbatches) for name in ("pipedream_flush", "1f1b"))
        assert alias.name == "pipedream_flush" and alias.actions == original.actions
        assert alias.placement == original.placement


# --- the Schedule type ---------------------------------------------------------------------

def test_schedule_answers_stage_and_chunk_questions_through_its_placement():
    schedule = build_schedule("interleaved_1f1b", 3, 2, 3)
    placement = schedule.placement
    assert placement == Placement((0, 1, 2, 0, 1, 2))
    assert placement.num_stages == 6
    assert placement.rank_of(4) == 1
    assert placement.stages_of(1) == (1, 4)
    assert placement.chunk_of(4) == 1 and placement.chunk_of(1) == 0
    assert not schedule.splits_backward and schedule.chunks_per_copy == 2
    v_schedule = Schedule("v", 2, 2, 1, v_placement(2), ((), ()))
    assert v_schedule.placement.stages_of(0) == (0, 3) and v_schedule.placement.chunk_of(3) == 1


def test_action_prints_readably():
    assert str(Action("F", 2, 5)) == "F(stage 2, mb 5)"


# --- generators -----------------------------------------------------------------------------

def test_gpipe_runs_all_forwards_then_all_backwards():
    schedule = build_schedule("gpipe", 2, 1, 3)
    assert compact(schedule, 0) == ["F0.0", "F0.1", "F0.2", "BW0.0", "BW0.1", "BW0.2"]
    assert compact(schedule, 1) == ["F1.0", "F1.1", "F1.2", "BW1.0", "BW1.1", "BW1.2"]
    assert schedule.chunks_per_rank == 1 and schedule.name == "gpipe"


def test_1f1b_warmup_steady_cooldown():
    schedule = build_schedule("1f1b", 4, 1, 6)
    assert compact(schedule, 0) == ["F0.0", "F0.1", "F0.2", "F0.3", "BW0.0", "F0.4", "BW0.1", "F0.5",
                                    "BW0.2", "BW0.3", "BW0.4", "BW0.5"]
    assert compact(schedule, 3) == ["F3.0", "BW3.0", "F3.1", "BW3.1", "F3.2", "BW3.2", "F3.3", "BW3.3",
                                    "F3.4", "BW3.4", "F3.5", "BW3.5"]


def test_1f1b_with_fewer_microbatches_than_ranks():
    schedule = build_schedule("1f1b", 4, 1, 2)
    assert compact(schedule, 0) == ["F0.0", "F0.1", "BW0.0", "BW0.1"]
    assert compact(schedule, 2) == ["F2.0", "F2.1", "BW2.0", "BW2.1"]
    assert compact(schedule, 3) == ["F3.0", "BW3.0", "F3.1", "BW3.1"]


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved_1f1b"])
def test_single_rank_is_gradient_accumulation(name):
    schedule = build_schedule(name, 1, 1, 3)
    expected = (["F0.0", "F0.1", "F0.2", "BW0.0", "BW0.1", "BW0.2"] if name == "gpipe"
                else ["F0.0", "BW0.0", "F0.1", "BW0.1", "F0.2", "BW0.2"])
    assert compact(schedule, 0) == expected


@pytest.mark.parametrize("pp, num_microbatches", [(1, 1), (2, 5), (4, 4), (4, 9), (8, 3)])
def test_interleaved_with_one_chunk_is_1f1b(pp, num_microbatches):
    interleaved = build_schedule("interleaved_1f1b", pp, 1, num_microbatches)
    assert interleaved.actions == build_schedule("1f1b", pp, 1, num_microbatches).actions


def test_interleaved_order_and_warmup_match_megatron():
    schedule = build_schedule("interleaved_1f1b", 2, 2, 4)
    # rank 0 holds stages 0 and 2: warm-up 2*(2-0-1) + (2-1)*2 = 4 forwards, group of 2 per chunk
    assert compact(schedule, 0) == ["F0.0", "F0.1", "F2.0", "F2.1", "F0.2", "BW2.0", "F0.3", "BW2.1",
                                    "F2.2", "BW0.0", "F2.3", "BW0.1", "BW2.2", "BW2.3", "BW0.2", "BW0.3"]
    # rank 1 (stages 1 and 3): warm-up (2-1)*2 = 2 forwards
    assert compact(schedule, 1)[:6] == ["F1.0", "F1.1", "F3.0", "BW3.0", "F3.1", "BW3.1"]
    assert schedule.placement.owners == (0, 1, 0, 1) and schedule.chunks_per_rank == 2


@pytest.mark.parametrize("pp, vpp, num_microbatches", [(4, 2, 8), (3, 3, 7), (4, 4, 2)])
def test_interleaved_warmup_count_per_rank(pp, vpp, num_microbatches):
    schedule = build_schedule("interleaved_1f1b", pp, vpp, num_microbatches)
    first_group = len(microbatch_groups(pp, num_microbatches)[0])
    for pp_rank, rank_actions in enumerate(schedule.actions):
        kinds = [a.kind for a in rank_actions]
        leading_forwards = kinds.index("BW")
        expected = min(2 * (pp - pp_rank - 1) + (vpp - 1) * first_group, vpp * num_microbatches)
        steady_starts = expected < vpp * num_microbatches
        assert leading_forwards == expected + (1 if steady_starts else 0)


def test_microbatch_groups_are_at_least_pp_long():
    assert microbatch_groups(4, 8) == [range(0, 4), range(4, 8)]
    assert microbatch_groups(4, 3) == [range(0, 3)]
    assert microbatch_groups(4, 9) == [range(0, 5), range(5, 9)]
    assert microbatch_groups(4, 14) == [range(0, 5), range(5, 10), range(10, 14)]
    for pp in range(1, 9):
        for num_microbatches in range(pp, 5 * pp):
            groups = microbatch_groups(pp, num_microbatches)
            assert [mb for group in groups for mb in group] == list(range(num_microbatches))
            assert all(len(group) >= pp for group in groups)


def test_describe_prints_one_line_per_rank():
    text = build_schedule("interleaved_1f1b", 2, 2, 2).describe()
    assert text.splitlines()[0].startswith("rank 0: F0c0 F1c0 F0c1")
    assert len(text.splitlines()) == 2
