"""The simulator against the published results: makespans, bubbles, peak activations, latency."""

import itertools
import json

import pytest

from ppctl.pipeline.program import lower
from ppctl.pipeline.schedules import SCHEDULE_SPECS, ScheduleError, build_schedule
from ppctl.pipeline.schedules.base import Action, Schedule
from ppctl.pipeline.simulate import Costs, parse_costs, replay, simulate


# --- costs ---------------------------------------------------------------------------------

def test_parse_costs_reads_any_subset_in_any_order():
    assert parse_costs("F=1,B=2,W=1,comm=0.1") == Costs(1.0, 2.0, 1.0, 0.1)
    assert parse_costs(" comm=0.5 , F=2 ") == Costs(F=2.0, comm=0.5)
    assert parse_costs("") == Costs()
    assert parse_costs("FB=2.5,F=1") == Costs(F=1.0, FB=2.5) and Costs().FB is None


@pytest.mark.parametrize("text, message", [
    ("F=1,X=2", "'X=2' is not KEY=NUMBER with KEY one of F, B, W, FB, A2A, A2A_SPLIT, comm"),
    ("F1", "'F1' is not KEY=NUMBER"),
    ("B=fast", "B='fast' is not a number"),
    ("W=-1", r"W=-1 is not a finite number from 0 to 1e\+12"),
    ("F=nan", r"F=nan is not a finite number from 0 to 1e\+12 \(a time; the sums of a timeline's times must stay"),
    ("comm=inf", "comm=inf is not a finite number"),
    ("F=1,B=1e308", "B=1e308 is not a finite number"),
    ("FB=-0.5", "FB=-0.5 is not a finite number"),
])
def test_parse_costs_refuses_bad_text_in_one_line(text, message):
    with pytest.raises(ValueError, match=message):
        parse_costs(text)


# --- published results -----------------------------------------------------------------------

@pytest.mark.parametrize("pp, num_microbatches", [(2, 2), (4, 4), (4, 8), (4, 13), (8, 16), (3, 32)])
def test_1f1b_makespan_and_bubble_with_equal_costs(pp, num_microbatches):
    result = simulate(build_schedule("1f1b", pp, 1, num_microbatches), Costs(F=1, B=1, W=1))
    assert result.makespan == pytest.approx((num_microbatches + pp - 1) * 3)
    assert result.bubble_ratio == pytest.approx((pp - 1) / num_microbatches)


@pytest.mark.parametrize("costs", [Costs(1, 1, 1), Costs(1, 2, 0), Costs(2, 3, 1)])
def test_1f1b_bubble_holds_for_unequal_forward_and_backward(costs):
    result = simulate(build_schedule("1f1b", 4, 1, 8), costs)
    assert result.bubble_ratio == pytest.approx(3 / 8)


@pytest.mark.parametrize("pp, vpp, num_microbatches", [(2, 2, 4), (4, 2, 8), (4, 4, 8), (4, 2, 16), (8, 2, 16),
                                                       (3, 3, 9), (8, 4, 32)])
@pytest.mark.parametrize("costs", [Costs(1, 1, 1), Costs(1, 2, 0)])
def test_interleaved_bubble_is_divided_by_vpp(pp, vpp, num_microbatches, costs):
    result = simulate(build_schedule("interleaved_1f1b", pp, vpp, num_microbatches), costs)
    assert result.bubble_ratio == pytest.approx((pp - 1) / (vpp * num_microbatches))
    per_microbatch = costs.F + costs.B + costs.W
    assert result.makespan == pytest.approx(per_microbatch * (num_microbatches + (pp - 1) / vpp))


def test_gpipe_bubble_and_peak_activations():
    result = simulate(build_schedule("gpipe", 4, 1, 8))
    assert result.bubble_ratio == pytest.approx(3 / 8)
    assert [rank.peak_activations for rank in result.ranks] == [8, 8, 8, 8]


@pytest.mark.parametrize("pp, num_microbatches", [(4, 4), (4, 8), (8, 32), (2, 3)])
def test_1f1b_peak_activations_are_pp_minus_rank(pp, num_microbatches):
    result = simulate(build_schedule("1f1b", pp, 1, num_microbatches))
    assert [rank.peak_activations for rank in result.ranks] == [pp - r for r in range(pp)]


def test_1f1b_peak_is_capped_by_the_microbatch_count():
    result = simulate(build_schedule("1f1b", 8, 1, 3))
    assert result.ranks[0].peak_activations == 3
    assert result.ranks[7].peak_activations == 1


def test_interleaved_peak_counts_chunk_activations_as_fractions():
    pp, vpp = 4, 2
    result = simulate(build_schedule("interleaved_1f1b", pp, vpp, 16))
    # rank 0: 2*(pp-1) + (vpp-1)*pp warm-up chunk forwards, then one more before the first backward
    assert result.ranks[0].peak_activations == pytest.approx((2 * (pp - 1) + (vpp - 1) * pp + 1) / vpp)
    assert result.ranks[0].peak_activations == pytest.approx(pp * (1 + (pp - 1) / (pp * vpp)))


def test_chunk_actions_cost_a_fraction_of_the_rank():
    result = simulate(build_schedule("interleaved_1f1b", 2, 4, 4), Costs(F=2, B=3, W=1))
    durations = {(a.kind, round(a.end - a.start, 9)) for rank in result.ranks for a in rank.actions}
    assert durations == {("F", 0.5), ("BW", 1.0)}


def test_single_rank_has_no_bubble():
    result = simulate(build_schedule("1f1b", 1, 1, 5), Costs(F=1, B=2, W=1))
    assert result.makespan == 20 and result.bubble_ratio == 0


# --- latency -------------------------------------------------------------------------------

def test_comm_latency_on_two_ranks_one_microbatch():
    result = simulate(build_schedule("1f1b", 2, 1, 1), Costs(F=1, B=1, W=1, comm=0.25))
    rank_0, rank_1 = result.ranks
    assert [(a.kind, a.start, a.end) for a in rank_1.actions] == [("F", 1.25, 2.25), ("BW", 2.25, 4.25)]
    assert [(a.kind, a.start, a.end) for a in rank_0.actions] == [("F", 0.0, 1.0), ("BW", 4.5, 6.5)]
    assert result.makespan == 6.5


@pytest.mark.parametrize("name", ["1f1b", "gpipe"])
@pytest.mark.parametrize("pp", [2, 3, 4, 8])
def test_one_microbatch_pays_latency_at_every_stage_boundary_both_ways(name, pp):
    comm = 0.1
    result = simulate(build_schedule(name, pp, 1, 1), Costs(comm=comm))
    assert result.makespan == pytest.approx(pp * 3 + 2 * (pp - 1) * comm)


def test_gpipe_with_latency_adds_one_round_trip_through_the_pipeline():
    comm, pp, num_microbatches = 0.1, 4, 8
    result = simulate(build_schedule("gpipe", pp, 1, num_microbatches), Costs(comm=comm))
    assert result.makespan == pytest.approx((num_microbatches + pp - 1) * 3 + 2 * (pp - 1) * comm)


def test_comm_latency_in_the_steady_state_costs_more_than_one_round_trip():
    free = simulate(build_schedule("1f1b", 4, 1, 8)).makespan
    slow = simulate(build_schedule("1f1b", 4, 1, 8), Costs(comm=0.1)).makespan
    assert slow > free + 2 * 3 * 0.1


def test_local_messages_pay_no_latency():
    result = simulate(build_schedule("interleaved_1f1b", 1, 2, 2), Costs(comm=5))
    assert result.makespan == 6


# --- results and errors -------------------------------------------------------------------------

def test_to_json_has_the_documented_keys():
    result = simulate(build_schedule("interleaved_1f1b", 2, 2, 4), Costs(F=1, B=2, W=0, comm=0.1))
    data = json.loads(json.dumps(result.to_json()))
    assert list(data) == ["schedule", "pp", "vpp", "microbatches", "costs", "makespan", "bubble_ratio", "steps",
                          "step_ends", "steady_step_time", "steady_bubble_ratio", "weight_versions", "ranks",
                          "program"]
    assert data["steps"] == 1 and data["step_ends"] == [data["makespan"]] and data["weight_versions"] == 1
    assert (data["steady_step_time"], data["steady_bubble_ratio"]) == (data["makespan"], data["bubble_ratio"])
    assert data["schedule"] == "interleaved_1f1b" and data["vpp"] == 2 and data["microbatches"] == 4
    assert data["costs"] == {"F": 1.0, "B": 2.0, "W": 0.0, "comm": 0.1}
    assert [rank["rank"] for rank in data["ranks"]] == [0, 1]
    assert list(data["ranks"][0]) == ["rank", "peak_activations", "actions"]
    assert list(data["ranks"][0]["actions"][0]) == ["kind", "stage", "microbatch", "start", "end"]
    assert len(data["ranks"][0]["actions"]) == 2 * 2 * 4
    assert data["program"] == result.program.to_json()  # the lowered program the timeline replays
    assert list(data["program"]) == ["placement", "messages", "ranks"]
    assert list(data["program"]["ranks"][0]) == ["rank", "initial_receives", "overlapped", "filled", "steps"]
    assert list(data["program"]["ranks"][0]["steps"][0]) == ["kind", "stage", "microbatch", "inputs", "local_output",
                                                             "sends", "receives"]


def test_timed_actions_follow_the_schedule_order():
    schedule = build_schedule("1f1b", 3, 1, 5)
    result = simulate(schedule)
    for pp_rank, timeline in enumerate(result.ranks):
        assert [Action(a.kind, a.stage, a.microbatch) for a in timeline.actions] == list(schedule.actions[pp_rank])
        assert all(a.start >= b.end for b, a in zip(timeline.actions, timeline.actions[1:]))


def test_a_deadlocked_schedule_cannot_be_simulated():
    schedule = build_schedule("1f1b", 2, 1, 2)
    cycle = Schedule("cycle", 2, 1, 2, schedule.placement,
                     ((Action("F", 0, 0), Action("BW", 0, 0), Action("F", 0, 1), Action("BW", 0, 1)),
                      (Action("F", 1, 1), Action("F", 1, 0), Action("BW", 1, 0), Action("BW", 1, 1))))
    with pytest.raises(ScheduleError, match="cycle: deadlock: rank 0 stuck at BW"):
        simulate(cycle)
    assert replay(lower(cycle)).deadlocked


@pytest.mark.parametrize("name, pp, vpp, num_microbatches", [("1f1b", 4, 1, 8), ("gpipe", 3, 1, 5),
                                                             ("interleaved_1f1b", 4, 2, 8),
                                                             ("interleaved_1f1b", 2, 3, 4), ("dualpipev", 4, 2, 8)])
def test_the_timeline_is_the_replay_of_the_lowered_program(name, pp, vpp, num_microbatches):
    program = lower(build_schedule(name, pp, vpp, num_microbatches))
    costs = Costs(F=1, B=2, W=1, comm=0.25)
    timeline, replayed = simulate(program, costs), replay(program, costs, pairs_as_one=True)
    assert [[(a.start, a.end) for a in rank.actions] for rank in timeline.ranks] == \
        [list(zip(starts, ends)) for starts, ends in zip(replayed.starts, replayed.ends)]
    assert timeline.program is program and not replayed.deadlocked


@pytest.mark.parametrize("pp", [2, 4, 8])
def test_beyond_the_fill_is_what_no_order_removes_taken_off_the_idle_time(pp):
    """1F1B idles (pp-1)(F+B+W); the fill, (pp-1)F, is the last rank's wait for its first input, and 1F1B's
    drain of whole backwards, (pp-1)(B+W), is beyond it. ZB-H1 at F=B=W leaves only the fill."""
    costs = Costs(F=1, B=1, W=1)
    assert simulate(build_schedule("1f1b", pp, 1, 2 * pp), costs).beyond_the_fill() == (pp - 1, 2 * (pp - 1))
    assert simulate(build_schedule("zb_h1", pp, 1, 2 * pp), costs).beyond_the_fill() == (pp - 1, 0)


# --- the planner's makespan: the timelines left out, the receives never placed -----------------

PLANNED = [("1f1b", 1), ("gpipe", 1), ("interleaved_1f1b", 2), ("zb_h1", 1), ("zbv", 2), ("dualpipev", 2)]


@pytest.mark.parametrize("name,vpp", PLANNED)
@pytest.mark.parametrize("pp,microbatches", [(2, 4), (4, 8), (4, 13), (8, 16)])
@pytest.mark.parametrize("costs", [Costs(), Costs(F=1.3, B=1.9, W=0.7, comm=0.3), Costs(F=0.2, B=0.5, W=0.2, comm=2.0)])
def test_simulate_makespan_of_the_sends_only_equals_simulate(name, vpp, pp, microbatches, costs):
    from ppctl.pipeline.program import sends_only
    from ppctl.pipeline.simulate import simulate_makespan

    try:
        schedule = build_schedule(name, pp, vpp, microbatches)
    except ScheduleError:
        pytest.skip(f"{name} refuses pp={pp} with {microbatches} microbatches")
    full = simulate(schedule, costs)
    assert simulate_makespan(sends_only(schedule), costs) == (full.makespan, full.bubble_ratio)
    assert simulate_makespan(lower(schedule), costs) == (full.makespan, full.bubble_ratio)


def test_lower_numbers_messages_as_sends_only_does():
    from ppctl.pipeline.program import sends_only

    schedule = build_schedule("zbv", 4, 2, 8)
    program, sent = lower(schedule), sends_only(schedule)
    assert program.messages == sent.messages
    assert [[step.inputs for step in steps] for steps in program.steps] == [bare.inputs for bare in sent.bare]


@pytest.mark.parametrize("name,vpp", PLANNED)
@pytest.mark.parametrize("pp,microbatches", [(1, 3), (4, 8), (8, 19)])
@pytest.mark.parametrize("comm", [0.0, 0.3, 7.0])
def test_the_step_graph_gives_the_engines_finish_times(name, vpp, pp, microbatches, comm):
    from ppctl.pipeline.program import sends_only
    from ppctl.pipeline.replay import action_durations, run_timed

    try:
        schedule = build_schedule(name, pp, vpp, microbatches)
    except ScheduleError:
        pytest.skip(f"{name} refuses pp={pp} with {microbatches} microbatches")
    costs = Costs(F=1.3, B=1.9, W=0.7, comm=comm)
    sent = sends_only(schedule)
    engine = [ends[-1] for ends in run_timed(sent.timed(costs, pairs_as_one=True), comm).ends]
    durations = action_durations(schedule.chunks_per_copy, costs)
    assert sent.graph.finish_times(durations, comm) == engine == lower(schedule).graph.finish_times(durations, comm)


@pytest.mark.parametrize("name,vpp", PLANNED)
@pytest.mark.parametrize("pp,microbatches", [(1, 3), (4, 8), (8, 19)])
def test_the_unit_cost_ends_of_the_step_graph_are_the_engines(name, vpp, pp, microbatches):
    """``lower`` places the receives at the ends of a unit-cost replay, which it reads from the step graph."""
    from ppctl.pipeline.program import sends_only, unit_cost_ends
    from ppctl.pipeline.replay import run_timed

    try:
        schedule = build_schedule(name, pp, vpp, microbatches)
    except ScheduleError:
        pytest.skip(f"{name} refuses pp={pp} with {microbatches} microbatches")
    sent = sends_only(schedule)
    assert sent.graph is not None and unit_cost_ends(sent) == run_timed(sent.timed()).ends


def test_a_deadlock_has_no_step_graph_and_the_makespan_names_it():
    from ppctl.pipeline.program import sends_only, unit_cost_ends
    from ppctl.pipeline.replay import run_timed
    from ppctl.pipeline.simulate import simulate_makespan

    schedule = build_schedule("1f1b", 2, 1, 2)
    swapped = Schedule(schedule.name, 2, 1, 2, schedule.placement,
                       (tuple(sorted(schedule.actions[0], key=lambda a: a.kind != "BW")), schedule.actions[1]))
    assert sends_only(swapped).graph is None
    with pytest.raises(ScheduleError, match="deadlock: rank 0 stuck at BW"):
        simulate_makespan(sends_only(swapped))
    sent = sends_only(swapped)
    assert unit_cost_ends(sent) == run_timed(sent.timed()).ends  # the engine's, as far as the ranks got


def test_overlapped_pairs_run_as_one_are_left_to_the_engine():
    from ppctl.pipeline.program import sends_only
    from ppctl.pipeline.simulate import simulate_makespan

    schedule = build_schedule("dualpipev", 4, 2, 8)
    costs = Costs(F=1.3, B=1.9, W=0.7, FB=2.9, comm=0.3)
    full = simulate(schedule, costs)
    assert simulate_makespan(sends_only(schedule), costs) == (full.makespan, full.bubble_ratio)


FLOOR_COSTS = [Costs(), Costs(F=1.3, B=1.9, W=0.7, comm=0.3), Costs(F=0.2, B=0.5, W=0.2, comm=2.0),
               Costs(F=1.0, B=2.0, W=0.0, comm=0.05), Costs(F=0.0, B=0.0, W=0.0, comm=1.0)]


@pytest.mark.parametrize("name", sorted(SCHEDULE_SPECS))
def test_no_schedule_runs_below_the_makespan_floor(name):
    """``makespan_floor`` (built from the placement alone, for the planner) is at or below the simulated makespan of
    every registered schedule, at every size and cost tried: slow compute, slow messages, no W, free compute."""
    from ppctl.pipeline.program import sends_only
    from ppctl.pipeline.simulate import makespan_floor, simulate_makespan

    tried = 0
    for pp, vpp, microbatches in itertools.product((1, 2, 3, 4, 6, 8), (1, 2, 3), (1, 2, 3, 4, 6, 8, 12, 16)):
        try:
            schedule = build_schedule(name, pp, vpp, microbatches)
        except ScheduleError:
            continue
        sent = sends_only(schedule)
        for costs in FLOOR_COSTS:
            floor = makespan_floor(schedule.placement, microbatches, costs)
            assert floor <= simulate_makespan(sent, costs)[0] * (1 + 1e-12), (pp, vpp, microbatches, costs)
        tried += 1
    assert tried >= 8  # every schedule builds at several sizes (DualPipe: even pp, enough microbatches)


@pytest.mark.parametrize("name", ["1f1b", "gpipe"])
@pytest.mark.parametrize("pp,microbatches", [(1, 3), (2, 4), (4, 8), (4, 3), (8, 16)])
def test_the_floor_is_the_makespan_of_a_pipeline_that_runs_without_gaps(name, pp, microbatches):
    """Without messages or a W, GPipe and 1F1B take (m + pp - 1)(F + B): the floor's fill and drain, exactly."""
    from ppctl.pipeline.simulate import makespan_floor

    costs = Costs(F=1.0, B=2.0, W=0.0)
    schedule = build_schedule(name, pp, 1, microbatches)
    assert makespan_floor(schedule.placement, microbatches, costs) == simulate(schedule, costs).makespan
