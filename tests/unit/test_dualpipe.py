"""DualPipe and DualPipeV: phase orders, copies, the checker sweep, and the published bubble and memory.

DualPipe's README table is written per chunk (one stage of PP stages) with B the
whole backward: bubble (PP/2-1)(F&B + B - 3W), activations PP+1 per device, 2x
parameters. ppctl's costs are per microbatch through a rank's layers of one copy
(a DualPipe chunk; two DualPipeV chunks), its B the input-gradient half, so their
B is our B + W, and for dualpipev their PP is 2*pp and their unit half of ours.
"""

from collections import Counter
from dataclasses import replace

import pytest

from ppctl.parallel.placement import v_placement
from ppctl.pipeline.check import check_schedule
from ppctl.pipeline.program import adjacent_stages, lower
from ppctl.pipeline.schedules import (BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, SCHEDULE_SPECS, Action,
                                      ScheduleError, build_schedule)
from ppctl.pipeline.simulate import Costs, simulate


def allowed_sizes():
    """(name, pp, m): every pp 1..8 and the six smallest counts from 2*pp, as each schedule's rule allows."""
    for name in ("dualpipe", "dualpipev"):
        for pp in range(1, 9):
            for num_microbatches in range(2 * pp, 2 * pp + 6):
                if SCHEDULE_SPECS[name].microbatch_error(pp, 2, num_microbatches) is None:
                    yield name, pp, num_microbatches


def their_units(name: str, pp: int) -> tuple[int, int]:
    """(DualPipe's PP, our units per their chunk): dualpipe PP = pp, a chunk is our unit; dualpipev PP = 2 pp, half."""
    return (pp, 1) if name == "dualpipe" else (2 * pp, 2)


def published_bubble(name: str, pp: int, costs: Costs) -> float:
    """(PP/2 - 1)(F&B + B - 3W) in their notation, converted to ours (F&B = F + B + W when FB is None)."""
    stages, per_chunk = their_units(name, pp)
    pair = costs.FB if costs.FB is not None else costs.F + costs.B + costs.W
    return (stages / 2 - 1) * (pair + (costs.B + costs.W) - 3 * costs.W) / per_chunk


# --- the orders, derived by hand from DualPipe's eight phases ---------------------------------------

def test_dualpipev_order_on_two_ranks():
    text = build_schedule("dualpipev", 2, 2, 4).describe().splitlines()
    # rank 0 (far from the turn): 2 F0, F0 F1, B1 W F1, a steady round of two pairs, BW1 + pair, B1 B0, W B0, W
    assert text[0] == ("rank 0: F0c0 F1c0 F2c0 F0c1 B0c1 W0c1 F1c1 F3c0+BW1c1 F2c1+BW0c0 BW2c1 F3c1+BW1c0 "
                       "BW3c1 B2c0 W2c0 B3c0 W3c0")
    # rank 1 (the turn): F0 F1 twice, its first steady forward and backward apart, B1 B0 twice, two Ws
    assert text[1] == ("rank 1: F0c0 F0c1 F1c0 F1c1 F2c0 BW0c1 F2c1+BW0c0 F3c0+BW1c1 F3c1+BW1c0 BW2c1 BW2c0 "
                       "B3c1 B3c0 W3c1 W3c0")


def test_dualpipe_order_on_two_ranks():
    schedule = build_schedule("dualpipe", 2, 2, 4)
    text = schedule.describe().splitlines()
    # rank 0: phase 0 is copy 0 (stage 0, microbatches 0-1), phase 1 copy 1 (stage 3, microbatches 2-3)
    assert text[0] == "rank 0: F0c0 F2c1 F1c0 BW2c1 F3c1+BW0c0 BW3c1 B1c0 W1c0"
    # rank 1: phase 0 is copy 1 (stage 2, entered here), phase 1 copy 0 (stage 1, the loss)
    assert text[1] == "rank 1: F2c1 F0c0 F3c1 BW0c0 F1c0+BW2c1 BW1c0 B3c1 W3c1"
    assert schedule.overlapped == ((4,), (4,))


# --- the representation: two copies on the V placement ------------------------------------------------

def test_dualpipe_holds_two_copies_on_the_v_placement():
    schedule = build_schedule("dualpipe", 4, 2, 8)
    placement = schedule.placement
    assert placement.copies == 2 and schedule.chunks_per_rank == 2 and placement == v_placement(4, copies=2)
    assert placement.owners == v_placement(4).owners
    assert placement.stages_per_copy == 4 and schedule.chunks_per_copy == 1
    assert [placement.model_stage(stage) for stage in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert [placement.rank_of(stage) for stage in range(4, 8)] == [3, 2, 1, 0]  # copy 1 enters at rank pp-1
    assert schedule.microbatches_of_copy(0) == range(0, 4) and schedule.microbatches_of_copy(1) == range(4, 8)
    for rank_actions in schedule.actions:
        assert all(placement.copy_of(a.stage) == a.microbatch // 4 for a in rank_actions)
    dualpipev = build_schedule("dualpipev", 4, 2, 8)
    assert dualpipev.placement == v_placement(4)
    assert dualpipev.placement.stages_per_copy == 8 and dualpipev.chunks_per_copy == 2


def test_registry_entries():
    dualpipe, dualpipev = SCHEDULE_SPECS["dualpipe"], SCHEDULE_SPECS["dualpipev"]
    assert dualpipe.placement(4, 2) == v_placement(4, copies=2) and dualpipev.placement(4, 2) == v_placement(4)
    assert dualpipe.chunks_per_rank == dualpipev.chunks_per_rank == 2
    assert "two copies" in dualpipe.placement_name


def test_no_message_crosses_from_one_copy_to_the_other():
    # the last stage of copy 0 (3) and the first of copy 1 (4) share rank 3, yet are not neighbours
    assert adjacent_stages(Action(FORWARD, 3, 0), 8, 4) == (2, None)
    assert adjacent_stages(Action(FORWARD, 4, 5), 8, 4) == (None, 5)
    assert adjacent_stages(Action(BACKWARD, 4, 5), 8, 4) == (5, None)
    assert adjacent_stages(Action(BACKWARD_INPUT, 3, 0), 8, 4) == (None, 2)
    assert adjacent_stages(Action(FORWARD, 3, 0), 8, 8) == (2, 4)  # one copy: the V goes on
    program = lower(build_schedule("dualpipe", 4, 2, 8))
    assert program.messages and all(m.src_stage // 4 == m.dst_stage // 4 for m in program.messages)
    assert not any(m.local for m in program.messages)  # no two neighbours share a rank


def test_forward_only_drops_pairs_and_keeps_copies():
    schedule = build_schedule("dualpipe", 4, 2, 8).forward_only()
    assert schedule.overlapped == () and schedule.placement.copies == 2
    assert {a.kind for rank_actions in schedule.actions for a in rank_actions} == {FORWARD}
    program = lower(schedule)  # evaluation sends its messages within each copy too
    assert program.messages and all(m.src_stage // 4 == m.dst_stage // 4 for m in program.messages)


# --- validation rules -----------------------------------------------------------------------------

@pytest.mark.parametrize("name, pp, num_microbatches, message", [
    ("dualpipe", 3, 6, "pp=3 must be even"),
    ("dualpipe", 4, 6, "num_microbatches=6 must be even and at least 2\\*pp = 8"),
    ("dualpipe", 4, 9, "num_microbatches=9 must be even and at least 2\\*pp = 8"),
    ("dualpipev", 4, 7, "num_microbatches=7 must be at least 2\\*pp = 8"),
])
def test_refused_sizes_state_the_rule_in_one_line(name, pp, num_microbatches, message):
    error = SCHEDULE_SPECS[name].microbatch_error(pp, 2, num_microbatches)
    assert error is not None and "\n" not in error
    with pytest.raises(ScheduleError, match=f"schedule {name}: {message}"):
        build_schedule(name, pp, 2, num_microbatches)


@pytest.mark.parametrize("name", ["dualpipe", "dualpipev"])
def test_vpp_must_be_two(name):
    with pytest.raises(ScheduleError, match="places exactly 2 chunks on each rank .* vpp=1 must be 2"):
        build_schedule(name, 4, 1, 8)


# --- every allowed size: complete, ordered, deadlock-free ------------------------------------------------

@pytest.mark.parametrize("name, pp, num_microbatches", list(allowed_sizes()))
def test_every_allowed_size_is_complete_and_passes_the_checker(name, pp, num_microbatches):
    schedule = build_schedule(name, pp, 2, num_microbatches)
    check_schedule(schedule)  # complete, F < B < W, pair order, no deadlock with NCCL-like sends
    expected = {(stage, mb) for stage in range(schedule.placement.num_stages)
                for mb in schedule.microbatches_of_copy(schedule.placement.copy_of(stage))}
    counts = Counter((a.kind, a.stage, a.microbatch) for rank_actions in schedule.actions for a in rank_actions)
    assert {(s, mb) for kind, s, mb in counts if kind == FORWARD} == expected
    for stage, mb in expected:  # one backward each: a whole BW, or a B and a later W
        assert counts[(BACKWARD, stage, mb)] + counts[(BACKWARD_INPUT, stage, mb)] == 1
        assert counts[(BACKWARD_INPUT, stage, mb)] == counts[(BACKWARD_WEIGHT, stage, mb)]
    assert set(counts.values()) == {1}
    for pp_rank, rank_actions in enumerate(schedule.actions):
        split = [(a.stage, a.microbatch) for a in rank_actions if a.kind == BACKWARD_INPUT]
        assert [(a.stage, a.microbatch) for a in rank_actions if a.kind == BACKWARD_WEIGHT] == split  # FIFO
        for index in schedule.overlapped[pp_rank]:
            assert (rank_actions[index].kind, rank_actions[index + 1].kind) == (FORWARD, BACKWARD)


def test_each_rank_runs_2n_minus_r_minus_1_zero_bubble_backwards():
    """DualPipeV rank r splits (n - r - 1) backwards in phase 3, r + 1 in phase 6, n - r - 1 in phase 7."""
    schedule = build_schedule("dualpipev", 4, 2, 10)
    assert [sum(a.kind == BACKWARD_INPUT for a in rank_actions) for rank_actions in schedule.actions] == [7, 6, 5, 4]


# --- the checker refuses what breaks the two-copy rules ------------------------------------------------

def test_a_microbatch_of_the_other_copy_is_refused():
    schedule = build_schedule("dualpipe", 2, 2, 4)
    rank_0 = list(schedule.actions[0])
    rank_0[0] = Action(FORWARD, 0, 2)  # microbatch 2 flows through copy 1, not stage 0
    with pytest.raises(ScheduleError, match=r"names a microbatch of another model copy; stage 0 \(copy 0\) runs "
                                            r"microbatches 0..1"):
        check_schedule(replace(schedule, actions=(tuple(rank_0), schedule.actions[1])))


@pytest.mark.parametrize("overlapped, message", [
    (((0,), (4,)), "pair at action 0 is F.* and F.*; a pair is a forward followed by a backward"),
    (((4, 5), (4,)), "pair at action 5 is out of order, overlaps the previous pair"),
    (((8,), (4,)), "pair at action 8 .* runs past the rank's actions"),
    (((4,),), "1 lists of overlapped pairs for pp=2 ranks"),
])
def test_malformed_pairs_are_refused(overlapped, message):
    schedule = build_schedule("dualpipe", 2, 2, 4)
    with pytest.raises(ScheduleError, match=message):
        check_schedule(replace(schedule, overlapped=overlapped))


def test_copies_must_split_the_microbatches():
    schedule = build_schedule("dualpipe", 2, 2, 4)
    with pytest.raises(ScheduleError, match="copies=2 must be at least 1 and divide .*num_microbatches=3"):
        check_schedule(replace(schedule, num_microbatches=3))


# --- the published table: bubble and activations ---------------------------------------------------

SIZES = [(name, pp, m) for name in ("dualpipe", "dualpipev") for pp in (4, 6, 8) for m in (2 * pp, 2 * pp + 2, 4 * pp)]


@pytest.mark.parametrize("name, pp, num_microbatches", SIZES)
@pytest.mark.parametrize("costs", [Costs(F=1, B=1, W=1, FB=3), Costs(F=1, B=1, W=1, FB=2), Costs(F=2, B=2, W=1, FB=3.5),
                                   Costs(F=1, B=1, W=0.5, FB=2.5), Costs(F=2, B=2, W=0, FB=3)])
def test_bubble_is_the_published_formula_when_b_equals_f(name, pp, num_microbatches, costs):
    """The worst rank idles (PP/2-1)(F&B + B - 3W) exactly, for F&B from max(F, B+W) to F+B+W, when B = F.

    (Their figure's proportion: the input-gradient backward as long as the forward.)
    """
    result = simulate(build_schedule(name, pp, 2, num_microbatches), costs)
    assert max(result.idle_times()) == pytest.approx(published_bubble(name, pp, costs))


@pytest.mark.parametrize("name, pp, num_microbatches", SIZES)
def test_bubble_off_the_formula_when_b_differs_from_f(name, pp, num_microbatches):
    """B < F: (PP/2-1)(F - B) more idle than the formula; B > F: one chunk forward less."""
    stages, per_chunk = their_units(name, pp)
    shorter = Costs(F=2, B=1.5, W=1, FB=3)
    result = simulate(build_schedule(name, pp, 2, num_microbatches), shorter)
    extra = (stages / 2 - 1) * (shorter.F - shorter.B) / per_chunk
    assert max(result.idle_times()) == pytest.approx(published_bubble(name, pp, shorter) + extra)
    longer = Costs(F=1, B=2, W=1, FB=4)
    result = simulate(build_schedule(name, pp, 2, num_microbatches), longer)
    assert max(result.idle_times()) == pytest.approx(published_bubble(name, pp, longer) - longer.F / per_chunk)


@pytest.mark.parametrize("name, pp, num_microbatches", SIZES)
def test_pairs_run_as_two_steps_idle_half_the_formula_at_unit_costs(name, pp, num_microbatches):
    """FB unset: the runtime's two plain steps; the forward's output leaves before the paired backward runs.

    At F=B=W=1 the worst rank idles (PP/2-1) chunk forwards, half the formula's 2 (PP/2-1).
    """
    result = simulate(build_schedule(name, pp, 2, num_microbatches), Costs(F=1, B=1, W=1))
    assert max(result.idle_times()) == pytest.approx(published_bubble(name, pp, Costs(F=1, B=1, W=1, FB=3)) / 2)


@pytest.mark.parametrize("name, pp, num_microbatches", SIZES + [("dualpipe", 2, 4), ("dualpipev", 1, 2)])
def test_peak_activations_are_pp_plus_one_chunks(name, pp, num_microbatches):
    """PP + 1 chunk activations per device (counted until each W), on every rank."""
    stages, per_chunk = their_units(name, pp)
    result = simulate(build_schedule(name, pp, 2, num_microbatches))
    assert [rank.peak_activations for rank in result.ranks] == [(stages + 1) / per_chunk] * pp


def test_same_pp_comparison_with_1f1b():
    """At pp=4, m=8, F=B=W=1: dualpipe idles 1 per rank (1f1b 9) holding 2/pp of the model (1f1b 1/pp)."""
    dualpipe = simulate(build_schedule("dualpipe", 4, 2, 8))
    assert dualpipe.makespan == 25 and dualpipe.idle_times() == [1, 1, 1, 1] and dualpipe.copies == 2
    dualpipev = simulate(build_schedule("dualpipev", 4, 2, 8))
    assert dualpipev.makespan == 25.5 and dualpipev.copies == 1


# --- timing an overlapped pair ------------------------------------------------------------------------

def test_a_pair_takes_fb_split_in_proportion():
    schedule = build_schedule("dualpipe", 4, 2, 8)
    result = simulate(schedule, Costs(F=1, B=1, W=1, FB=2.4))
    for timeline in result.ranks:
        actions = timeline.actions
        for forward, backward in zip(actions, actions[1:]):
            if forward.pair is not None and forward.pair == backward.pair:
                assert backward.start == pytest.approx(forward.end)
                assert forward.end - forward.start == pytest.approx(0.8)  # F : BW = 1 : 2 of 2.4
                assert backward.end - backward.start == pytest.approx(1.6)


def test_a_pair_sends_both_outputs_when_it_ends():
    """With FB set a pair is one action: the forward's output leaves with the backward's, at the pair's end."""
    schedule = build_schedule("dualpipe", 4, 2, 8)
    result = simulate(schedule, Costs(F=1, B=1, W=1, FB=3))
    starts = {(a.kind, a.stage, a.microbatch): a.start for timeline in result.ranks for a in timeline.actions}
    checked = 0
    for timeline in result.ranks:
        for forward, backward in zip(timeline.actions, timeline.actions[1:]):
            if forward.pair is None or forward.pair != backward.pair:
                continue
            _, target = adjacent_stages(Action(FORWARD, forward.stage, forward.microbatch), 8, 4)
            if target is not None:
                assert starts[(FORWARD, target, forward.microbatch)] >= backward.end
                checked += 1
    assert checked >= 8


def test_a_pair_with_a_split_backward_takes_fb_less_w():
    from ppctl.pipeline.replay import pair_durations

    costs = Costs(F=1, B=2, W=1, FB=3)
    assert pair_durations(1, costs, BACKWARD) == pytest.approx((0.75, 2.25))
    assert pair_durations(1, costs, BACKWARD_INPUT) == pytest.approx((2 / 3, 4 / 3))  # 3 - W, split 1 : 2
    assert pair_durations(2, costs, BACKWARD) == pytest.approx((0.375, 1.125))
    assert pair_durations(1, Costs(F=1, B=2, W=1), BACKWARD) == (1, 3)  # FB unset: their own times


def test_json_marks_pairs_and_reports_fb_only_when_set():
    plain = simulate(build_schedule("dualpipe", 2, 2, 4)).to_json()
    assert "FB" not in plain["costs"]
    actions = plain["ranks"][0]["actions"]
    paired = [action for action in actions if "pair" in action]
    assert [(a["kind"], a["microbatch"], a["pair"]) for a in paired] == [("F", 3, 0), ("BW", 0, 0)]
    assert simulate(build_schedule("dualpipe", 2, 2, 4), Costs(FB=2.5)).to_json()["costs"]["FB"] == 2.5
