"""``ppctl plan`` and ``ppctl inspect-schedule`` refusing bad inputs through the command line, in this process (issue
46): one line on stderr naming the option and the rule, exit 2, in seconds; a plan that finds nothing says why on
stdout, one line on stderr, exit 1."""

import json
import math

from typer.testing import CliRunner

from ppctl.cli.app import app
from ppctl.resolve import compose_config, to_yaml


def invoke(args):
    return CliRunner().invoke(app, args)


def one_line(result, code: int) -> str:
    """The one stderr line of a command that exited with ``code``."""
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == code, (result.exit_code, result.stdout, result.stderr, result.exception)
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


def test_gpus_out_of_range_or_not_a_whole_number_is_one_line():
    for gpus, said in (("99999999999999999999999", "more devices than ppctl plan searches"),
                       ("1e7", "not a whole number of devices"), ("0", "a plan needs at least 1 device"),
                       ("-3", "a plan needs at least 1 device")):
        line = one_line(invoke(["plan", "data=synthetic", "--gpus", gpus]), 2)
        assert line == f"error: --gpus {gpus}: {said}; give --gpus a whole number from 1 to 1,048,576 (2**20)"


def test_a_plan_that_finds_nothing_says_why_and_exits_1():
    result = invoke(["plan", "data=synthetic", "--gpus", "7"])
    assert one_line(result, 1) == "error: no layout of --gpus 7 fits: each was left out for a reason counted above"
    assert "left out 72: pp x vpp outnumbers model.num_layers=4 (a stage would hold no layer)" in result.stdout
    assert ("left out 24: dp x the micro-batch size does not divide trainer.global_batch_size=8"
            in result.stdout)
    as_json = invoke(["plan", "data=synthetic", "--gpus", "1000000", "--json"])
    assert one_line(as_json, 1).endswith("counted in refused")
    report = json.loads(as_json.stdout)
    assert report["candidates"] == [] and sum(report["refused"].values()) > 0


def test_steps_and_cost_refusals_are_one_line():
    for args, line in (
            (["--steps", "0"], "error: --steps 0: simulates at least 1 step; give --steps 1 or more"),
            (["--steps", "abc"], "error: --steps abc: not a whole number of steps; give --steps 1 or more"),
            (["--steps", "100000"], "error: --steps 100000: 100,000 steps of 1f1b at pp=2 are 3,200,000 actions"),
            (["--cost", "F=nan"], "error: --cost F=nan: F=nan is not a finite number from 0 to 1e+12"),
            (["--cost", "F=inf"], "error: --cost F=inf: F=inf is not a finite number"),
            (["--cost", "F=1e308"], "error: --cost F=1e308: F=1e308 is not a finite number"),
            (["--cost", "B=-1"], "error: --cost B=-1: B=-1 is not a finite number")):
        assert one_line(invoke(["inspect-schedule", "data=synthetic", "parallel.pp=2", *args]), 2).startswith(line)


def bench_run(run_dir, fitted: dict, bench_folder: bool = True):
    """A ``ppctl bench`` run's files, with these fitted costs."""
    if bench_folder:
        (run_dir / "bench").mkdir()
        (run_dir / "bench/0_1f1b.yaml").write_text(to_yaml(compose_config(["data=synthetic", "parallel.pp=2"])))
    (run_dir / "bench_request.json").write_text(json.dumps({"configs": ["bench/0_1f1b.yaml"]}))
    (run_dir / "bench.json").write_text(json.dumps([{
        "schedule": "1f1b", "pp": 2, "fitted_costs_ms": fitted, "overhead_per_action_ms": 0.5,
        "makespan_measured_s": 0.1, "bubble_measured": 0.25}]))
    return str(run_dir)


def test_calibrate_from_a_bad_bench_run_is_one_line_naming_the_file(tmp_path):
    (tmp_path / "nan").mkdir()
    (tmp_path / "bare").mkdir()
    nan = bench_run(tmp_path / "nan", {"F": math.nan, "B": -8.0, "W": 0.0, "comm": 0.2})
    bare = bench_run(tmp_path / "bare", {"F": 4.0, "B": 8.0, "W": 0.0, "comm": 0.2}, bench_folder=False)
    for command in (["inspect-schedule", "data=synthetic", "parallel.pp=2"], ["plan", "data=synthetic", "--gpus", "2"]):
        line = one_line(invoke([*command, "--calibrate", nan]), 2)
        assert line.startswith(f"error: --calibrate {nan}/bench.json: entry 0: fitted_costs_ms.F is nan, where a "
                               "measured figure is a finite number from 0 to 1e+12"), line
        line = one_line(invoke([*command, "--calibrate", bare]), 2)
        assert line.startswith(f"error: --calibrate {bare}/bench/0_1f1b.yaml: missing; ppctl bench writes each "
                               "schedule's resolved config there"), line  # it blamed "--out None"
