"""Weight fills (``Schedule.with_weight_fills``): with the expert all-to-alls overlapped, each backward followed on its
rank by an independent W lets that W compute in its exchange waits. The rule, its checks, and when a resolved
config asks for it."""

import dataclasses
import re

import pytest

from ppctl.resolve import compose_config
from ppctl.resolve.resolved import resolve
from ppctl.pipeline.check import check_schedule
from ppctl.pipeline.kept import kept_schedule
from ppctl.pipeline.schedules import BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, ScheduleError

SPLIT_SCHEDULES = [("zb_h1", 4, 1, 8), ("zb_h1", 2, 1, 3), ("zbv", 4, 2, 8), ("zbv", 2, 2, 5), ("dualpipev", 4, 2, 8),
                   ("dualpipe", 4, 2, 8), ("interleaved_zb", 2, 2, 4), ("v_half", 4, 2, 8)]


@pytest.mark.parametrize("name, pp, vpp, microbatches", SPLIT_SCHEDULES)
def test_every_fill_is_a_backward_and_an_independent_w_off_the_first_stages(name, pp, vpp, microbatches):
    schedule = kept_schedule(name, pp, vpp, microbatches).with_weight_fills()
    placement, found = schedule.placement, 0
    for pp_rank, rank_actions in enumerate(schedule.actions):
        starts = schedule.fill_starts(pp_rank)
        paired = {index + half for index in schedule.pair_starts(pp_rank) for half in (0, 1)}
        for index in starts:
            backward, weight = rank_actions[index], rank_actions[index + 1]
            assert backward.kind in (BACKWARD, BACKWARD_INPUT) and weight.kind == BACKWARD_WEIGHT
            assert (backward.stage, backward.microbatch) != (weight.stage, weight.microbatch)
            own_b = rank_actions.index((BACKWARD_INPUT, weight.stage, weight.microbatch))
            assert own_b < index  # its B ran before: the two halves are independent
            assert placement.model_stage(backward.stage) and placement.model_stage(weight.stage)
            assert not {index, index + 1} & paired
        # every adjacent backward and W that may fill is one
        allowed = [index for index in range(len(rank_actions) - 1)
                   if schedule.fills(rank_actions[index], rank_actions[index + 1]) and not {index, index + 1} & paired]
        assert list(starts) == allowed
        found += len(starts)
    assert found > 0
    check_schedule(schedule)
    assert kept_schedule(name, pp, vpp, microbatches).filled == ()  # only when asked


def test_describe_joins_a_fill_with_an_ampersand():
    described = kept_schedule("zb_h1", 2, 1, 4).with_weight_fills().describe()
    assert described.splitlines()[1].startswith("rank 1: F0 B0 F1 B1&W0 F2 B2&W1 F3 B3&W2 W3")


def _refused(schedule, filled, match):
    with pytest.raises(ScheduleError, match=match):
        check_schedule(dataclasses.replace(schedule, filled=filled))


def test_the_checker_refuses_a_fill_that_is_not_independent_or_sits_on_a_first_stage():
    looped = kept_schedule("interleaved_zb", 2, 2, 4)  # rank 0: ... B0c1 W0c1 ...: stage 2's own W
    own_w = looped.actions[0].index((BACKWARD_INPUT, 2, 0))
    assert looped.actions[0][own_w + 1] == (BACKWARD_WEIGHT, 2, 0)
    _refused(looped, ((own_w,), ()), "a fill is a backward followed by the W of another stage or microbatch")
    schedule = kept_schedule("zb_h1", 2, 1, 4)
    rank0 = schedule.actions[0]
    first = next(index for index, action in enumerate(rank0) if action.kind == BACKWARD_INPUT
                 and rank0[index + 1].kind == BACKWARD_WEIGHT)
    _refused(schedule, ((first,), ()), "neither on the first stage of its model copy")
    _refused(schedule, ((), (0,)), "weight fill at action 0 is F")
    filled = schedule.with_weight_fills().filled
    _refused(schedule, ((), filled[1][1:2] + filled[1][:1]), "out of order")
    _refused(schedule, (filled[1],), "lists of weight fills for pp=2")


def test_the_checker_refuses_a_fill_that_shares_an_overlapped_pair():
    schedule = kept_schedule("dualpipev", 2, 2, 8)
    rank = next(rank for rank in range(2) if schedule.pair_starts(rank))
    filled = tuple((schedule.pair_starts(rank)[0] + 1,) if candidate == rank else () for candidate in range(2))
    _refused(schedule, filled, "overlaps another fill or an overlapped pair")


@pytest.mark.parametrize("overrides, fills", [
    (["parallel.overlap_ep_comm=true"], True),
    ([], False),  # not asked for
    (["parallel.overlap_ep_comm=true", "schedule=dualpipev"], True),  # its cool-down's W's
])
def test_a_resolved_config_has_fills_only_where_ws_can_fill_exchange_waits(overrides, fills):
    config = compose_config(["model=mixtral_tiny", "parallel.pp=2", "parallel.dp=2", "parallel.ep=2", "schedule=zbv",
                             "parallel.vpp=2", "data=synthetic", *overrides])
    schedule = resolve(config).schedule
    assert bool(schedule.filled) == fills
    assert any(schedule.fill_starts(rank) for rank in range(2)) == fills


def test_validation_checks_the_fills_a_run_will_carry(monkeypatch):
    """With the overlap at ep > 1, validation runs the fills' checks on the schedule with its fills (the same
    ones the workers run), and refuses the config in one line where they fail."""
    import ppctl.pipeline.check as check
    from ppctl.config import ConfigError
    from ppctl.resolve.validate import _built_schedule_problem, validate

    checked = []
    monkeypatch.setattr(check, "check_weight_fills", lambda schedule: checked.append(schedule.filled))
    _built_schedule_problem.cache_clear()
    overrides = ["model=mixtral_tiny", "parallel.pp=2", "parallel.dp=2", "parallel.ep=2", "schedule=zbv",
                 "parallel.vpp=2", "data=synthetic", "parallel.overlap_ep_comm=true"]
    validate(compose_config(overrides), data=False)
    assert checked and any(checked[0])

    def refuse(schedule):
        raise ScheduleError("rank 1: weight fill at action 5 is wrong")

    monkeypatch.setattr(check, "check_weight_fills", refuse)
    _built_schedule_problem.cache_clear()
    with pytest.raises(ConfigError, match="schedule zbv: rank 1: weight fill at action 5 is wrong"):
        validate(compose_config(overrides), data=False)
    _built_schedule_problem.cache_clear()


@pytest.mark.parametrize("overrides, said", [
    (["parallel.ep=1"], "parallel.overlap_ep_comm=true hides expert all-to-alls behind compute, but parallel.ep=1 "
                        "exchanges none"),
    (["schedule=1f1b", "parallel.vpp=1"], "schedule 1f1b: parallel.overlap_ep_comm=true, but it has neither "
                                          "overlapped pairs (dualpipe, dualpipev) nor a split backward"),
])
def test_an_overlap_that_would_hide_nothing_is_refused_in_one_line(overrides, said):
    from ppctl.config import ConfigError

    config = compose_config(["model=mixtral_tiny", "parallel.pp=2", "parallel.dp=2", "parallel.ep=2", "schedule=zbv",
                             "parallel.vpp=2", "data=synthetic", "parallel.overlap_ep_comm=true", *overrides])
    with pytest.raises(ConfigError, match="^" + re.escape(said)) as error:
        resolve(config)
    assert "\n" not in str(error.value)
