"""The processor-sharing replay (``ppctl.pipeline.shared_cores``): the step graph's own times when every process
has a core, hand-computed times when they share one, and waits that take no core."""

import pytest

from ppctl.pipeline.program import sends_only
from ppctl.pipeline.replay import Costs, action_durations
from ppctl.pipeline.schedules import build_schedule
from ppctl.pipeline.shared_cores import shared_finish_times


def graph_and_durations(name, pp, vpp, microbatches, costs):
    schedule = build_schedule(name, pp, vpp, microbatches)
    return sends_only(schedule).graph, action_durations(schedule.chunks_per_copy, costs)


NO_WAITS = {kind: 0.0 for kind in ("F", "B", "W", "BW")}


@pytest.mark.parametrize("name,pp,vpp,microbatches", [("1f1b", 4, 1, 8), ("gpipe", 3, 1, 5), ("zb_h1", 4, 1, 6),
                                                      ("interleaved_1f1b", 2, 2, 4), ("zbv", 3, 2, 6),
                                                      ("dualpipev", 2, 2, 4)])
@pytest.mark.parametrize("costs", [Costs(F=1.0, B=2.0, W=1.0, comm=0.25), Costs(F=0.3, B=0.5, W=0.0, comm=2.0)])
def test_with_a_core_per_process_the_times_are_the_step_graphs(name, pp, vpp, microbatches, costs):
    graph, durations = graph_and_durations(name, pp, vpp, microbatches, costs)
    waits = {kind: 0.1 * duration for kind, duration in durations.items()}
    together = {kind: durations[kind] + waits[kind] for kind in durations}
    expected = graph.finish_times(together, costs.comm)
    assert shared_finish_times(graph, durations, waits, costs.comm, cores=pp * 2, processes_per_rank=2) == \
        pytest.approx(expected, rel=1e-12)


def test_gpipe_on_one_core_by_hand():
    """GPipe, pp=2, two microbatches, F=1 and BW=2 on one core: rank 0's second F and rank 1's first run at half
    speed (1 to 3), rank 1 then runs alone (F to 4, BW to 6), both BW at half speed (6 to 10), rank 0's last alone."""
    graph, durations = graph_and_durations("gpipe", 2, 1, 2, Costs(F=1.0, B=2.0, W=0.0))
    assert shared_finish_times(graph, durations, NO_WAITS, 0.0, cores=1) == [12.0, 10.0]
    assert graph.finish_times(durations, 0.0) == [9.0, 7.0]  # a core each


def test_replicas_share_the_cores_and_waits_take_none():
    """One pipeline rank standing for four processes on two cores computes at half speed; its waits pass at the
    clock's pace."""
    graph, durations = graph_and_durations("1f1b", 1, 1, 3, Costs(F=1.0, B=2.0, W=0.0))
    computing = 3 * (1.0 + 2.0)
    assert shared_finish_times(graph, durations, NO_WAITS, 0.0, cores=2, processes_per_rank=4) == [2 * computing]
    waits = {**NO_WAITS, "F": 0.5}
    assert shared_finish_times(graph, durations, waits, 0.0, cores=2, processes_per_rank=4) == \
        pytest.approx([2 * computing + 3 * 0.5])


@pytest.mark.parametrize("cores", [1, 2, 3])
def test_sharing_never_ends_a_step_sooner(cores):
    """Fewer cores only slow steps down: every rank ends no sooner than with a core each, and on one core no sooner
    than its whole pipeline's compute run one step at a time."""
    costs = Costs(F=1.0, B=1.5, W=0.5, comm=0.1)
    graph, durations = graph_and_durations("zb_h1", 4, 1, 8, costs)
    alone = graph.finish_times(durations, costs.comm)
    shared = shared_finish_times(graph, durations, NO_WAITS, costs.comm, cores=cores)
    assert all(s >= a - 1e-9 for s, a in zip(shared, alone))
    if cores == 1:
        total = sum(durations[kind] for kinds in graph.rank_kinds for kind in kinds)
        assert max(shared) >= total - 1e-9


def test_the_simulators_shared_makespan_is_its_makespan_with_a_core_each_and_never_below_it():
    from ppctl.pipeline.simulate import simulate_makespan, simulate_shared_makespan

    sent = sends_only(build_schedule("zbv", 3, 2, 6))
    costs, waits = Costs(F=1.0, B=2.0, W=1.0, comm=0.25), Costs(F=0.2, B=0.2, W=0.0)
    alone = simulate_makespan(sent, costs)
    assert simulate_shared_makespan(sent, costs, waits, cores=6, processes_per_rank=2) == pytest.approx(alone)
    shared, bubble = simulate_shared_makespan(sent, costs, waits, cores=2, processes_per_rank=2)
    assert shared > alone[0] and bubble > alone[1]
