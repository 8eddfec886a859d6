"""``--calibrate RUN_DIR`` on a run whose files a real run would not write: each refused in one line naming
--calibrate, the file and what is wrong (issue 46), where it used to print a negative makespan, trace back, or
blame ``--out None``. The runs are fabricated as ``ppctl bench`` and ``trainer.trace=true`` write them."""

import json
import math

import pytest

from ppctl.cli.calibrate import calibration_of
from ppctl.resolve import compose_config, to_yaml
from ppctl.pipeline.simulate import Costs
from ppctl.pipeline.trace import chrome_trace
from tests.unit.test_calibrate import made_up_snapshots

ENTRY = {"schedule": "1f1b", "pp": 2, "fitted_costs_ms": {"F": 4.0, "B": 8.0, "W": 0.0, "comm": 0.2},
         "overhead_per_action_ms": 0.5, "makespan_measured_s": 0.1, "bubble_measured": 0.25}


def bench_run(tmp_path, bench, request=None, with_configs=True):
    """A ``ppctl bench`` run directory: ``bench/0_1f1b.yaml``, ``bench_request.json`` and ``bench.json`` (``bench``,
    written as JSON: NaN as Python's json writes it)."""
    if with_configs:
        (tmp_path / "bench").mkdir()
        (tmp_path / "bench/0_1f1b.yaml").write_text(to_yaml(compose_config(["data=synthetic", "parallel.pp=2"])))
    request = {"configs": ["bench/0_1f1b.yaml"]} if request is None else request
    (tmp_path / "bench_request.json").write_text(json.dumps(request))
    (tmp_path / "bench.json").write_text(json.dumps(bench))
    return tmp_path


def refusal(run_dir) -> str:
    with pytest.raises(ValueError) as raised:
        calibration_of(run_dir, "1f1b")
    message = str(raised.value)
    assert "\n" not in message and message.startswith("--calibrate "), message
    return message


def with_fitted(**costs) -> dict:
    return {**ENTRY, "fitted_costs_ms": {**ENTRY["fitted_costs_ms"], **costs}}


def test_the_good_run_the_refusals_spoil_is_read(tmp_path):
    calibration = calibration_of(bench_run(tmp_path, [ENTRY]), "1f1b")
    assert (calibration.costs.F, calibration.costs.comm) == pytest.approx((4.5, 0.2))


@pytest.mark.parametrize("entry, said", [
    (with_fitted(F=math.nan), "fitted_costs_ms.F is nan, where a measured figure is a finite number from 0 to 1e+12"),
    (with_fitted(B=-3.0), "fitted_costs_ms.B is -3.0, where a measured figure is a finite number"),
    (with_fitted(comm=math.inf), "fitted_costs_ms.comm is inf"),
    (with_fitted(W="2"), "fitted_costs_ms.W is '2'"),
    ({**ENTRY, "overhead_per_action_ms": -1.0}, "overhead_per_action_ms is -1.0"),
    ({**ENTRY, "makespan_measured_s": math.nan}, "makespan_measured_s is nan"),
    ({**ENTRY, "bubble_measured": -7.0}, "bubble_measured is -7.0"),
    ({key: value for key, value in ENTRY.items() if key != "fitted_costs_ms"}, "entry 0: no fitted_costs_ms; "),
    ({**ENTRY, "fitted_costs_ms": {"F": 1.0, "B": 1.0, "comm": 0.0}}, "entry 0: no fitted_costs_ms.W; "),
    ({**ENTRY, "fitted_costs_ms": [1, 2, 3]}, "fitted_costs_ms is [1, 2, 3], not what ppctl bench writes there"),
    ({**ENTRY, "pp": "2"}, "pp is '2', not what ppctl bench writes there"),
    ({**ENTRY, "update_s": "slow", "update_parameters": 10}, "its update and collective figures"),
    ({**ENTRY, "world_size": 2, "all_reduce_s": {"1024": 1e-3}, "collective_wait_s": -1.0},
     "collective_wait_s = -1.0"),
])
def test_a_bench_entry_with_a_bad_figure_is_refused_naming_it(tmp_path, entry, said):
    message = refusal(bench_run(tmp_path, [entry]))
    assert message.startswith(f"--calibrate {tmp_path / 'bench.json'}: entry 0") and said in message, message


@pytest.mark.parametrize("bench, said", [
    ({"schedule": "1f1b"}, "holds a JSON dict, not ppctl bench's list of one entry per schedule"),
    ("1f1b", "holds a JSON str, not ppctl bench's list"),
    ([[1, 2]], "entry 0 is a JSON list, not an object"),
    ([], "holds no schedule"),
])
def test_a_bench_json_of_the_wrong_shape_is_refused(tmp_path, bench, said):
    message = refusal(bench_run(tmp_path, bench))
    assert message.startswith(f"--calibrate {tmp_path / 'bench.json'}: ") and said in message, message


def test_a_bench_run_without_its_bench_folder_names_the_missing_config(tmp_path):
    message = refusal(bench_run(tmp_path, [ENTRY], with_configs=False))
    assert message.startswith(f"--calibrate {tmp_path / 'bench' / '0_1f1b.yaml'}: missing; ppctl bench writes"), message


@pytest.mark.parametrize("request_json", [[], {"configs": {}}, {"configs": []}, {"against": "none"}])
def test_a_bench_request_without_the_entry_s_config_is_refused(tmp_path, request_json):
    message = refusal(bench_run(tmp_path, [ENTRY], request=request_json))
    assert message.startswith(f"--calibrate {tmp_path / 'bench_request.json'}: its configs list no config file"), \
        message


def test_a_bench_config_that_is_not_a_config_is_refused(tmp_path):
    run_dir = bench_run(tmp_path, [ENTRY])
    (run_dir / "bench/0_1f1b.yaml").write_text("parallel: [1, 2\n")
    assert "0_1f1b.yaml: not a resolved ppctl config: " in refusal(run_dir)


def trace_run(tmp_path, trace) -> None:
    (tmp_path / "config.yaml").write_text(to_yaml(compose_config(["data=synthetic", "parallel.pp=2",
                                                                   "trainer.global_batch_size=4"])))
    (tmp_path / "trace.json").write_text(json.dumps(trace))


@pytest.mark.parametrize("trace, said", [
    ([1, 2], "not a trace of ppctl's"),
    ({"traceEvents": [{"ph": "X", "args": {"step": 1}}]}, "not a trace of ppctl's"),
    ({"traceEvents": []}, "no traced step"),
])
def test_a_trace_of_the_wrong_shape_is_refused(tmp_path, trace, said):
    trace_run(tmp_path, trace)
    message = refusal(tmp_path)
    assert message.startswith(f"--calibrate {tmp_path / 'trace.json'}: ") and said in message, message


def test_a_trace_whose_times_make_no_cost_is_refused(tmp_path):
    trace = chrome_trace(made_up_snapshots(Costs(F=2, B=4, W=0)), 5)
    for event in trace["traceEvents"]:
        if event.get("cat") == "F":
            event["dur"] = math.nan  # an edited trace
    trace_run(tmp_path, trace)
    assert "step 5 gives F = nan, where a measured figure is a finite number" in refusal(tmp_path)
