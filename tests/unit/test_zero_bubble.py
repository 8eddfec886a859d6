"""ZB-H1 and ZB-V: checker sweeps, one F/B/W per (stage, microbatch), simulated bubble and memory.

Costs are F=B=W=1 (whole-rank times; a chunk action of a V takes 1/2), where the
paper's formulas are exact. Peak activations count a microbatch from its F to its W
(``simulate.peak_activations``), in whole-rank units.
"""

from collections import Counter

import pytest

from ppctl.pipeline.check import check_schedule
from ppctl.pipeline.schedules import BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, ScheduleError, build_schedule
from ppctl.pipeline.schedules.base import Action
from ppctl.pipeline.simulate import Costs, peak_activations, simulate

UNIT = Costs(F=1, B=1, W=1)
SWEEP = [(pp, m) for pp in range(1, 9) for m in sorted({1, 2, 3, pp - 1, pp, pp + 1, 2 * pp, 3 * pp}) if m >= 1]


def assert_one_f_b_w_each(schedule):
    """Every (stage, microbatch) has one F, one B and one W, on one rank, in that order."""
    for rank_actions in schedule.actions:
        position = {(a.kind, a.stage, a.microbatch): i for i, a in enumerate(rank_actions)}
        for (kind, stage, mb), index in position.items():
            if kind == BACKWARD_WEIGHT:
                assert position[(BACKWARD_INPUT, stage, mb)] < index
            if kind == BACKWARD_INPUT:
                assert position[(FORWARD, stage, mb)] < index
    counts = Counter((a.kind, a.stage, a.microbatch) for rank_actions in schedule.actions for a in rank_actions)
    expected = {(kind, stage, mb) for kind in (FORWARD, BACKWARD_INPUT, BACKWARD_WEIGHT)
                for stage in range(schedule.placement.num_stages) for mb in range(schedule.num_microbatches)}
    assert set(counts) == expected and set(counts.values()) == {1}


@pytest.mark.parametrize("name, vpp", [("zb_h1", 1), ("zbv", 2)])
def test_checker_sweep_over_pp_and_microbatch_counts(name, vpp):
    for pp, num_microbatches in SWEEP:
        schedule = build_schedule(name, pp, vpp, num_microbatches)
        check_schedule(schedule)  # complete, F < B < W, pair order, no deadlock with NCCL-like sends
        assert_one_f_b_w_each(schedule)
        assert schedule.splits_backward


def test_zb_h1_rank_orders_for_pp4():
    schedule = build_schedule("zb_h1", 4, 1, 6)
    text = schedule.describe().splitlines()
    # rank r: 1F1B's warm-up, then F/B pairs with the Ws r microbatches behind, Ws filling the cool-down
    assert text[0] == "rank 0: F0 F1 F2 F3 B0 W0 F4 B1 W1 F5 B2 W2 B3 W3 B4 W4 B5 W5"
    assert text[3] == "rank 3: F0 B0 F1 B1 F2 B2 F3 B3 W0 F4 B4 W1 F5 B5 W2 W3 W4 W5"


@pytest.mark.parametrize("pp, num_microbatches", [(2, 2), (2, 8), (4, 4), (4, 8), (4, 13), (8, 8), (8, 24)])
def test_zb_h1_bubble_is_pp_minus_1_times_f_plus_b_minus_w(pp, num_microbatches):
    """The paper's (pp-1)(F+B-W) with m >= pp, a third of 1F1B's (pp-1)(F+B+W) when F=B=W."""
    for costs in (UNIT, Costs(F=1, B=2, W=1), Costs(F=2, B=2, W=1)):
        result = simulate(build_schedule("zb_h1", pp, 1, num_microbatches), costs)
        work = num_microbatches * (costs.F + costs.B + costs.W)
        assert result.makespan == pytest.approx(work + (pp - 1) * (costs.F + costs.B - costs.W))
        one_f_one_b = simulate(build_schedule("1f1b", pp, 1, num_microbatches), costs)
        assert one_f_one_b.makespan - result.makespan == pytest.approx(2 * (pp - 1) * costs.W)


@pytest.mark.parametrize("pp, num_microbatches", [(2, 4), (4, 8), (8, 3), (8, 16)])
def test_zb_h1_peak_activations_are_1f1b_rank_0s(pp, num_microbatches):
    """Counting each microbatch until its W: every rank holds at most min(pp, m), 1F1B's rank-0 peak."""
    result = simulate(build_schedule("zb_h1", pp, 1, num_microbatches), UNIT)
    one_f_one_b = simulate(build_schedule("1f1b", pp, 1, num_microbatches), UNIT)
    assert result.ranks[0].peak_activations == one_f_one_b.ranks[0].peak_activations == min(pp, num_microbatches)
    assert [rank.peak_activations for rank in result.ranks] == [min(pp, num_microbatches)] * pp


def test_peak_counts_activations_until_w_not_b():
    actions = [Action(FORWARD, 0, 0), Action(BACKWARD_INPUT, 0, 0), Action(FORWARD, 0, 1),
               Action(BACKWARD_WEIGHT, 0, 0), Action(BACKWARD_INPUT, 0, 1), Action(BACKWARD_WEIGHT, 0, 1)]
    assert peak_activations(actions, 1) == 2
    assert peak_activations(actions, 2) == 1


@pytest.mark.parametrize("pp, num_microbatches", [(2, 2), (2, 8), (3, 9), (4, 4), (4, 8), (4, 16), (6, 12),
                                                  (8, 8)])
def test_zbv_reaches_the_warm_up_bound_at_1f1b_memory(pp, num_microbatches):
    """F=B=W: the only idle time left is the last rank's wait for the first microbatch, (pp-1) chunk forwards.

    No schedule that starts every rank together can do better; peaks stay at pp (1F1B's rank 0).
    """
    result = simulate(build_schedule("zbv", pp, 2, num_microbatches), UNIT)
    assert result.makespan == pytest.approx(3 * num_microbatches + (pp - 1) / 2)
    assert max(rank.peak_activations for rank in result.ranks) == pp


def test_zbv_is_a_v_with_both_ends_on_rank_0():
    schedule = build_schedule("zbv", 4, 2, 8)
    assert schedule.placement.owners == (0, 1, 2, 3, 3, 2, 1, 0)
    assert schedule.placement.stages_of(0) == (0, 7)


@pytest.mark.parametrize("args, message", [
    (("zbv", 4, 1, 8), "zbv places exactly 2 chunks on each rank .* vpp=1 must be 2"),
    (("zbv", 4, 3, 8), "vpp=3 must be 2"),
    (("zb_h1", 4, 2, 8), "vpp=2 must be 1"),
    (("zb_h1", 4, 1, 0), "num_microbatches=0"),
    (("zbv", 4, 2, 0), "num_microbatches=0"),
])
def test_bad_sizes_are_refused_in_one_line(args, message):
    with pytest.raises(ScheduleError, match=message):
        build_schedule(*args)
