"""Activation memory over time (``ppctl.plan.memory.activation_bytes_over_time``): the memory model's walk of a rank's
actions laid on the simulated timeline, its peak the model's, and how ``inspect-schedule`` draws it (pure: no torch)."""

import pytest

from ppctl.cli.schedule_report import column_peaks, sparkline
from ppctl.resolve import compose_config
from ppctl.resolve.resolved import resolve
from ppctl.plan.memory import (activation_bytes_over_time, config_activation_tables, config_activation_timelines,
                               config_kept_peaks, config_memory, peak_in_flight_bytes)
from ppctl.pipeline.simulate import Costs, TimedAction, simulate, simulate_steps

SCHEDULES = ["1f1b", "gpipe", "interleaved_1f1b", "zb_h1", "zbv", "dualpipev"]
TWO_CHUNKS = {"interleaved_1f1b", "zbv", "dualpipev"}


def config_of(name: str, pp: int, *extra: str):
    """A resolved config of schedule ``name`` at ``pp`` whose layers split: two per stage, m = 2 pp."""
    chunks = 2 if name in TWO_CHUNKS else 1
    return resolve(compose_config([f"schedule={name}", f"parallel.pp={pp}", f"parallel.vpp={chunks}",
                                   f"model.num_layers={2 * pp * chunks}", f"trainer.global_batch_size={2 * pp}",
                                   "data=synthetic", *extra]))


def held(points) -> list[int]:
    return [count for _, count in points]


@pytest.mark.parametrize("recompute", [False, True], ids=["kept", "recompute full"])
@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize("name", SCHEDULES)
def test_the_timeline_peaks_at_the_memory_models_in_flight_activations(name, pp, recompute):
    config = config_of(name, pp, *(["model.recompute=full"] if recompute else []))
    result = simulate(config.schedule, Costs(F=1, B=1.5, W=0.5, comm=0.1))
    timelines = config_activation_timelines(config, result)
    tables, memory, kept_peaks = config_activation_tables(config), config_memory(config), config_kept_peaks(config)
    assert len(timelines) == pp
    for pp_rank, (points, table, parts) in enumerate(zip(timelines, tables, memory)):
        actions = [(action.kind, action.stage) for action in config.schedule.actions[pp_rank]]
        peak = peak_in_flight_bytes(actions, table.kept, table.stash)
        assert max(held(points)) == peak == kept_peaks[pp_rank] > 0
        assert parts.activations >= peak
        assert points[0] == (0.0, 0) and points[-1][1] == 0  # the step frees all it kept
        times = [time for time, _ in points]
        assert times == sorted(times) and times[-1] <= result.makespan
        # a split backward's B rebuilds a group into its stash, which the kept peak counts already (``rebuilt`` is
        # what a rebuild holds beyond it, on this tiny model's split ranks nothing)
        rebuilt = max(table.rebuilt.values())
        assert rebuilt > 0 if recompute and not config.schedule.splits_backward else rebuilt >= 0
        assert recompute or rebuilt == 0


def test_a_b_that_stashes_more_than_its_forward_kept_raises_the_peak():
    """With recomputation a B rebuilds a group and stashes what W needs: more than the group's input it kept."""
    kept, stash = {1: 10}, {1: 40}
    actions = [("F", 1), ("F", 1), ("B", 1), ("B", 1), ("W", 1), ("W", 1)]
    assert peak_in_flight_bytes(actions, kept, stash) == 80  # two stashes, where the forwards kept 20


def test_forwards_count_from_their_start_and_the_rest_at_their_end():
    kept, stash = {0: 100}, {0: 40}
    actions = [TimedAction("F", 0, 0, 1.0, 2.0), TimedAction("B", 0, 0, 3.0, 4.0),
               TimedAction("W", 0, 0, 6.0, 7.0)]
    assert activation_bytes_over_time(actions, kept, stash) == [(0.0, 0), (1.0, 100), (4.0, 40), (7.0, 0)]
    spike = [TimedAction("F", 0, 0, 1.0, 1.0), TimedAction("BW", 0, 0, 1.0, 1.0)]  # zero-length: kept as a spike
    assert activation_bytes_over_time(spike, kept, stash) == [(0.0, 0), (1.0, 100), (1.0, 0)]


@pytest.mark.parametrize("pp", [2, 4])
def test_gpipe_rises_through_every_forward_then_falls(pp):
    config = config_of("gpipe", pp)
    result = simulate(config.schedule)
    microbatches = 2 * pp
    for points, table in zip(config_activation_timelines(config, result), config_activation_tables(config)):
        counts = held(points)[1:]
        (kept,) = table.kept.values()
        assert counts == [kept * n for n in range(1, microbatches + 1)] + [kept * n for n in
                                                                           range(microbatches - 1, -1, -1)]


def bytes_at(points, time: float) -> int:
    """The bytes the step function of ``points`` holds at ``time``."""
    return [count for start, count in points if start <= time][-1]


@pytest.mark.parametrize("name", ["zb_h1", "zbv"])
def test_a_zero_bubble_b_keeps_the_stash_until_its_w(name):
    config = config_of(name, 4)
    result = simulate(config.schedule)
    for timeline, points, table in zip(result.ranks, config_activation_timelines(config, result),
                                       config_activation_tables(config)):
        weights = {(action.stage, action.microbatch): action for action in timeline.actions if action.kind == "W"}
        for action in timeline.actions:
            if action.kind != "B":
                continue
            weight, stash = weights[action.stage, action.microbatch], table.stash[action.stage]
            assert stash > 0 and weight.start >= action.end
            assert all(bytes_at(points, time) >= stash for time, _ in points if action.end <= time < weight.end)
            assert bytes_at(points, action.end) >= stash
            if stash != table.kept[action.stage]:  # else the first stage's B, which defers its whole backward
                assert (action.end, bytes_at(points, action.end)) in points
    last = config_activation_tables(config)[-1]
    if name == "zb_h1":  # the last stage's B frees the loss's softmax: part of what F kept (ZB-V's last rank holds
        # middle stages, whose B keeps about what F kept, and the gradient it received, for W)
        assert all(last.stash[stage] < last.kept[stage] for stage in last.kept)


def test_several_steps_repeat_the_step_and_free_between_them():
    config = config_of("1f1b", 2)
    one, three = simulate_steps(config.schedule, 1), simulate_steps(config.schedule, 3)
    for first, all_steps in zip(config_activation_timelines(config, one),
                                config_activation_timelines(config, three)):
        assert held(all_steps) == held(first) + 2 * held(first)[1:]
        assert max(held(all_steps)) == max(held(first))
        assert all_steps[-1][0] <= three.makespan


def test_a_config_whose_layers_do_not_split_resolves_without_a_layer_map_and_says_why():
    from ppctl.config import ConfigError

    config = compose_config(["schedule=dualpipev", "parallel.pp=4"])  # 4 layers, 8 stages
    with pytest.raises(ConfigError, match="num_layers=4"):
        resolve(config)
    run = resolve(compose_config(["schedule=dualpipev", "parallel.pp=4"]), layer_split=False)
    assert not run.layer_map and "num_layers=4" in run.split_problem


def test_the_sparkline_shows_each_columns_most_on_one_scale():
    points = [(0.0, 0), (1.0, 8), (1.5, 2), (3.0, 4), (4.0, 0)]
    assert column_peaks(points, 4.0, 4) == [0, 8, 2, 4]
    assert column_peaks(points, 4.0, 8) == [0, 0, 8, 2, 2, 2, 4, 4]
    assert sparkline(points, 4.0, 8, columns=4) == " █▂▄"
    assert sparkline(points, 4.0, 16, levels="_.-=+*#@", columns=4) == " =_."
    assert sparkline([(0.0, 0), (1.0, 5), (2.0, 1)], 4.0, 5, columns=2) == "█▂"  # the 5 ends where column 1 starts
