"""``inspect-schedule --calibrate``: costs read back from a run's trace.json or bench.json."""

import json

import pytest

from ppctl.cli.calibrate import calibration_lines, calibration_of
from ppctl.resolve import compose_config, to_yaml
from ppctl.pipeline.program import lower
from ppctl.pipeline.schedules import build_schedule
from ppctl.pipeline.simulate import Costs, simulate
from ppctl.pipeline.trace import (chrome_trace, costs_from_measurement, measured_makespan_and_bubble,
                                  overhead_per_action, rows_from_chrome_trace)

GAP_S = 0.0005  # the runtime's time between two actions in the made-up run


def made_up_snapshots(costs: Costs) -> list[dict]:
    """Per-rank snapshots of a 1f1b run at pp=2 with 4 microbatches whose runtime spends GAP_S seconds after each
    action: the simulator's timeline with the gap inside each action's cost, each action recorded without it, and
    the idle time before an action recorded as a wait."""
    gap_ms = GAP_S * 1e3
    charged = Costs(F=costs.F + gap_ms, B=costs.B + gap_ms, W=costs.W + gap_ms if costs.W else 0.0)
    snapshots = []
    for row in simulate(lower(build_schedule("1f1b", 2, 1, 4)), charged).ranks:
        actions, waits, free = [], [], 0.0
        for action in row.actions:
            if action.start > free:
                waits.append((free / 1e3, action.start / 1e3))
            actions.append((action.kind, action.stage, action.microbatch, action.start / 1e3,
                            (action.end - gap_ms) / 1e3))
            free = action.end
        snapshots.append({"rank": row.rank, "actions": actions, "waits": waits})
    return snapshots


def test_a_trace_file_gives_back_its_last_step():
    early, late = made_up_snapshots(Costs(F=3, B=5, W=0)), made_up_snapshots(Costs(F=2, B=4, W=0))
    trace = {"traceEvents": chrome_trace(early, 1)["traceEvents"] + chrome_trace(late, 2)["traceEvents"]}
    step, rows = rows_from_chrome_trace(trace)
    assert step == 2 and [row.rank for row in rows] == [0, 1]
    assert [(a.kind, a.microbatch) for a in rows[1].actions] == [(a[0], a[2]) for a in late[1]["actions"]]
    fitted = costs_from_measurement(rows, chunks_per_copy=1)
    assert (fitted.F, fitted.B, fitted.W) == pytest.approx((2, 4, 0))
    assert overhead_per_action(rows) > 0
    with pytest.raises(ValueError, match="no traced step"):
        rows_from_chrome_trace({"traceEvents": []})


def write_run(tmp_path, overrides: list[str], files: dict) -> None:
    (tmp_path / "config.yaml").write_text(to_yaml(compose_config(["data=synthetic", *overrides])))
    for name, content in files.items():
        (tmp_path / name).write_text(json.dumps(content))


def test_calibration_from_a_training_trace_charges_the_time_between_actions(tmp_path):
    snapshots = made_up_snapshots(Costs(F=2, B=4, W=0))
    write_run(tmp_path, ["parallel.pp=2", "schedule=1f1b", "trainer.global_batch_size=4"],
              {"trace.json": chrome_trace(snapshots, 5)})
    calibration = calibration_of(tmp_path, "1f1b")
    assert calibration.schedule == "1f1b" and calibration.pp == 2 and not calibration.comm_measured
    assert "(step 5)" in calibration.source
    overhead = calibration.overhead_ms
    assert overhead == pytest.approx(GAP_S * 1e3 * 7 / 8)  # each rank's 8 actions: a gap after all but the last
    assert (calibration.costs.F, calibration.costs.B) == pytest.approx((2 + overhead, 4 + overhead))
    rows = rows_from_chrome_trace(chrome_trace(snapshots, 5))[1]
    assert (calibration.measured_makespan_ms, calibration.measured_bubble) == pytest.approx(
        measured_makespan_and_bubble(rows))
    # the simulated makespan at the calibrated costs is what the made-up run measured, within the gaps' rounding
    simulated = simulate(lower(build_schedule("1f1b", 2, 1, 4)), calibration.costs).makespan
    assert simulated == pytest.approx(calibration.measured_makespan_ms, rel=0.01)
    lines = calibration_lines(calibration.with_overrides({"comm": 0.1}), simulated, "1f1b", 2)
    assert "comm given by --cost" in lines[0] and lines[1].startswith("measured: makespan")
    other = calibration_lines(calibration, simulated, "zbv", 2)
    assert "comm not measured" in other[0] and "no measured timeline of this one" in other[1]


def test_calibration_from_bench_takes_the_entry_of_the_schedule(tmp_path):
    (tmp_path / "bench").mkdir()
    configs = []
    for index, name in enumerate(("1f1b", "zbv")):
        configs.append(f"bench/{index}_{name}.yaml")
        (tmp_path / configs[-1]).write_text(to_yaml(compose_config(["data=synthetic", "parallel.pp=2",
                                                                     f"schedule={name}"])))
    entries = [{"schedule": name, "pp": 2, "fitted_costs_ms": {"F": f, "B": 2 * f, "W": w, "comm": 0.2},
                "overhead_per_action_ms": 0.5, "makespan_measured_s": 0.1, "bubble_measured": 0.25}
               for name, f, w in (("1f1b", 4.0, 0.0), ("zbv", 6.0, 3.0))]
    (tmp_path / "bench.json").write_text(json.dumps(entries))
    (tmp_path / "bench_request.json").write_text(json.dumps({"configs": configs}))
    zbv = calibration_of(tmp_path, "zbv")  # two chunks per rank: two actions' overhead per rank's layers
    assert (zbv.costs.F, zbv.costs.B, zbv.costs.W, zbv.costs.comm) == pytest.approx((7.0, 13.0, 4.0, 0.2))
    assert zbv.comm_measured and zbv.measured_makespan_ms == pytest.approx(100.0)
    assert zbv.bubble_at_measured_compute(100.0) == pytest.approx(0.25)
    first = calibration_of(tmp_path, "gpipe")  # not benched: the first entry
    assert first.schedule == "1f1b" and (first.costs.F, first.costs.W) == pytest.approx((4.5, 0.0))


def test_bench_figures_beyond_the_pipeline_calibrate_the_update_and_the_ring(tmp_path):
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench/0_1f1b.yaml").write_text(to_yaml(compose_config(["data=synthetic", "parallel.pp=2"])))
    step_s, bandwidth, ranks = 2e-4, 1e9, 2  # a ring all-reduce: 2(n - 1) steps, 2(n - 1)/n of the bytes moved
    ring = {str(numel): 2 * (ranks - 1) * step_s + (ranks - 1) / ranks * 2 * 4 * numel / bandwidth
            for numel in (1024, 1 << 20)}
    entry = {"schedule": "1f1b", "pp": 2, "fitted_costs_ms": {"F": 4.0, "B": 8.0, "W": 0.0, "comm": 0.2},
             "overhead_per_action_ms": 0.5, "makespan_measured_s": 0.1, "bubble_measured": 0.25,
             "update_s": 0.03, "update_parameters": 1_000_000, "all_reduce_s": ring, "world_size": ranks,
             "collective_wait_s": 4e-4}
    (tmp_path / "bench.json").write_text(json.dumps([entry]))
    (tmp_path / "bench_request.json").write_text(json.dumps({"configs": ["bench/0_1f1b.yaml"]}))
    calibration = calibration_of(tmp_path, "1f1b")
    assert calibration.update_s_per_parameter == pytest.approx(3e-8)
    assert (calibration.ring_step_s, calibration.bus_bandwidth) == pytest.approx((step_s, bandwidth))
    assert calibration.collective_wait_s == pytest.approx(4e-4)
    del entry["collective_wait_s"]  # a bench from before the wait was measured: ring figures, no wait
    (tmp_path / "bench.json").write_text(json.dumps([entry]))
    assert calibration_of(tmp_path, "1f1b").collective_wait_s is None
    del entry["update_s"], entry["update_parameters"], entry["all_reduce_s"], entry["world_size"]  # an older bench
    (tmp_path / "bench.json").write_text(json.dumps([entry]))
    older = calibration_of(tmp_path, "1f1b")
    assert older.update_s_per_parameter is None and older.ring_step_s is None and older.bus_bandwidth is None
    assert older.collective_wait_s is None


def test_a_bench_whose_workers_outnumbered_the_cores_says_so(tmp_path):
    """Four workers on two cores: the calibration keeps the cores and the actions' mean share on a core; two
    workers on two cores (a core each) and a bench from before ``cores`` was written keep neither."""
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench/0_1f1b.yaml").write_text(to_yaml(compose_config(["data=synthetic", "parallel.pp=4"])))
    (tmp_path / "bench_request.json").write_text(json.dumps({"configs": ["bench/0_1f1b.yaml"]}))
    entry = {"schedule": "1f1b", "pp": 4, "fitted_costs_ms": {"F": 4.0, "B": 8.0, "W": 0.0, "comm": 0.2},
             "overhead_per_action_ms": 0.5, "makespan_measured_s": 0.1, "bubble_measured": 0.25, "world_size": 4,
             "cores": 2, "on_core_share": {"actions": [0.7, 0.6, 0.6, 0.7], "between": [0.5, 0.1, 0.1, 1.0]}}

    def calibrated(**changed):
        (tmp_path / "bench.json").write_text(json.dumps([{**entry, **changed}]))
        calibration = calibration_of(tmp_path, "1f1b")
        return calibration.cores, calibration.on_core_share

    assert calibrated() == (2, pytest.approx(0.65))
    assert calibrated(world_size=2) == (None, None)
    assert calibrated(cores=None) == (None, None)


def test_calibration_refusals_name_the_directory(tmp_path):
    with pytest.raises(ValueError, match="no such run directory"):
        calibration_of(tmp_path / "missing", "1f1b")
    with pytest.raises(ValueError, match="neither bench.json"):
        calibration_of(tmp_path, "1f1b")
    (tmp_path / "trace.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot read"):
        calibration_of(tmp_path, "1f1b")


def test_posting_costs_fitted_to_the_gaps_give_the_measured_makespan_back():
    """A made-up run whose runtime spends 0.01 ms after each action and 0.3 ms per point-to-point operation it
    posts: the fit finds both, and the simulator charging them reproduces the run's makespan."""
    from ppctl.pipeline.replay import run_timed
    from ppctl.pipeline.simulate import RankTimeline, TimedAction
    from ppctl.pipeline.trace import PostingCosts, posting_fit, simulate_with_posting

    program, costs, posting = lower(build_schedule("1f1b", 2, 1, 4)), Costs(F=2.0, B=4.0, W=0.0, comm=0.1), \
        PostingCosts(per_action=0.01, per_operation=0.3)
    made_up, _ = simulate_with_posting(program, costs, posting)
    timed = program.timed(costs)
    durations = [[step[1] for step in rank_steps] for rank_steps in timed.steps]
    for rank_steps, initial in zip(timed.steps, program.initial_receives):  # as simulate_with_posting charges
        for index, (inputs, duration, output, sends, receives) in enumerate(rank_steps):
            posted = len(sends) + len(receives) + (len(initial) if index == 0 else 0)
            rank_steps[index] = (inputs, duration + 0.01 + 0.3 * posted, output, sends, receives)
    replayed = run_timed(timed, costs.comm)
    rows = []
    for rank, (starts, ends, rank_durations) in enumerate(zip(replayed.starts, replayed.ends, durations)):
        starts = [starts[0] + 0.3 * len(program.initial_receives[rank]), *starts[1:]]  # posted before action 0
        actions = [TimedAction(step.action.kind, step.action.stage, step.action.microbatch, start, start + duration)
                   for step, start, duration in zip(program.steps[rank], starts, rank_durations)]
        waits = [(end, start) for end, start in zip(ends, starts[1:]) if start > end]  # idle: waiting for a message
        rows.append(RankTimeline(rank, actions, 0.0, waits))
    fitted = posting_fit(rows, program)
    assert (fitted.per_action, fitted.per_operation) == pytest.approx((0.01, 0.3))
    assert max(ends[-1] for ends in replayed.ends) == pytest.approx(made_up)
    assert simulate_with_posting(program, costs, fitted)[0] == pytest.approx(made_up)


def test_the_tracer_tells_time_on_a_core_from_time_waiting_for_one():
    """A busy action spends its wall time on the CPU, a sleeping one (as a thread waiting for a core) does not,
    and so for the time between actions; the shares and the trace's ``cpu_ms`` say so."""
    import time

    from ppctl.pipeline.schedules import Action
    from ppctl.pipeline.trace import Tracer, on_core_shares

    def busy(seconds):  # on a core for ``seconds`` of CPU time, however loaded the machine
        spent = time.thread_time() + seconds
        while time.thread_time() < spent:
            pass

    tracer = Tracer(rank=3)
    for kind, work in (("F", lambda: busy(0.01)), ("B", lambda: time.sleep(0.02)), ("W", lambda: busy(0.01))):
        started = tracer.mark()
        work()
        tracer.action(Action(kind, 0, 0), started)
        time.sleep(0.01) if kind == "F" else busy(0.005)  # off the core after F, on it after B
    snapshot = tracer.snapshot()
    durations = [end - start for start, end in snapshot["cpu_spans"]]
    assert durations[0] >= 0.01 and durations[1] < 0.005 and durations[2] >= 0.01
    shares = on_core_shares(snapshot)
    assert 0 < shares["actions"] < 1 and 0 < shares["between"] < 1
    first_two = {**snapshot, "actions": snapshot["actions"][:2], "cpu_spans": snapshot["cpu_spans"][:2]}
    # the sleep alone, then with the busy gap
    assert on_core_shares(first_two)["between"] < 0.1 and on_core_shares(first_two)["between"] < shares["between"]
    assert on_core_shares({**snapshot, "cpu_spans": []}) is None
    events = [event for event in chrome_trace([snapshot], 1)["traceEvents"] if event["ph"] == "X"]
    assert [event["args"]["cpu_ms"] for event in events] == [round(duration * 1e3, 4) for duration in durations]
    tracer.start_step()
    assert tracer.snapshot()["cpu_spans"] == []
