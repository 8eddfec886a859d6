"""``ppctl plan`` through the command line, in this process (it starts no worker): the table and the line to
paste, ``--json``'s keys, ``--explain``, ``--calibrate`` from a measured run's files, and its refusals."""

import json

from typer.testing import CliRunner

from ppctl.cli.app import app
from ppctl.resolve import compose_config, to_yaml, validate

BASE = ["model=gpt_small", "data=synthetic", "trainer.global_batch_size=32", "trainer.seq_length=256",
        "model.num_layers=8"]


def invoke(args):
    return CliRunner().invoke(app, args)


def test_plan_prints_the_ranked_table_and_a_command_that_validates():
    result = invoke(["plan", *BASE, "--gpus", "8", "--memory-gb", "80", "--top", "4"])
    assert result.exit_code == 0, result.output
    assert "ppctl plan: 8 devices of 80 GiB" in result.output
    pasted = next(line for line in result.output.splitlines() if line.startswith("the fastest, to paste: "))
    words = pasted.removeprefix("the fastest, to paste: ").split()
    assert words[:2] == ["ppctl", "train"]
    assert validate(compose_config(words[2:])).world_size == 8


def test_plan_json_holds_candidates_and_refusals():
    result = invoke(["plan", *BASE, "--gpus", "16", "--top", "3", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert len(report["candidates"]) == 3 and isinstance(report["refused"], dict)
    first = report["candidates"][0]
    assert set(first) == {"overrides", "step_time_s", "bubble_ratio", "peak_memory_bytes", "memory"}
    assert first["peak_memory_bytes"] == max(rank["total"] for rank in first["memory"])
    times = [candidate["step_time_s"] for candidate in report["candidates"]]
    assert times == sorted(times)


def test_explain_shows_memory_by_part_and_the_timeline():
    result = invoke(["plan", *BASE, "--gpus", "8", "--top", "2", "--explain", "2"])
    assert result.exit_code == 0, result.output
    assert "candidate: ppctl train" in result.output
    assert "predicted memory per pp rank" in result.output and "activations" in result.output
    assert "makespan" in result.output and "bubble ratio" in result.output


def test_calibrate_takes_the_device_figures_from_a_measured_run(tmp_path):
    measured = compose_config(BASE + ["parallel.pp=2", "parallel.dp=1"])
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "0_1f1b.yaml").write_text(to_yaml(measured))
    (tmp_path / "bench_request.json").write_text(json.dumps({"configs": ["bench/0_1f1b.yaml"]}))
    (tmp_path / "bench.json").write_text(json.dumps([{
        "schedule": "1f1b", "pp": 2, "fitted_costs_ms": {"F": 10.0, "B": 20.0, "W": 0.0, "comm": 0.5},
        "overhead_per_action_ms": 0.5, "makespan_measured_s": 0.5, "bubble_measured": 0.2}]))
    result = invoke(["plan", *BASE, "--gpus", "2", "--calibrate", str(tmp_path), "--top", "2"])
    assert result.exit_code == 0, result.output
    assert "calibrated by" in result.output and "0.5 ms per action" in result.output


def test_refusals_are_one_line():
    for args, message in ((["--gpus", "8", "--device", "tpu"], "--device 'tpu'"),
                          (["--gpus", "8", "--explain", "9", "--top", "2"], "--explain 9"),
                          (["--gpus", "8", "--calibrate", "/nonexistent/run"], "--calibrate /nonexistent/run"),
                          (["--gpus", "8", "trainer.seq_length=0"], "trainer.seq_length")):
        result = invoke(["plan", *BASE, *args])
        assert result.exit_code == 2, (args, result.output)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], (args, lines)


def test_a_mixtures_plan_shows_ep_and_pastes_it():
    """A mixture's table has an ep column and its line to paste sets parallel.ep (validated); a dense one has neither."""
    mixture = ["model=mixtral_8x7b", "data=synthetic", "model.num_layers=4"]
    result = invoke(["plan", *mixture, "--gpus", "8", "--top", "3"])
    assert result.exit_code == 0, result.output
    header = next(line for line in result.output.splitlines() if "schedule" in line and "tp" in line)
    assert " ep " in header
    pasted = next(line for line in result.output.splitlines() if line.startswith("the fastest, to paste: "))
    words = pasted.removeprefix("the fastest, to paste: ").split()
    assert any(word.startswith("parallel.ep=") for word in words)
    assert validate(compose_config(words[2:])).world_size == 8
    dense = invoke(["plan", *BASE, "--gpus", "8", "--top", "3"])
    assert " ep " not in dense.output and "parallel.ep" not in dense.output


def test_every_candidate_fits_what_the_reserve_and_fragmentation_leave_of_the_device():
    """``memory_budget``: (memory - reserve) / (1 + fragmentation), 2 GiB and 5% by default; a memory that the
    largest rank's prediction fits whole but not after the reserve refuses that candidate, and ``--reserve-gb 0
    --fragmentation 0`` fits it in the whole device again."""
    whole = json.loads(invoke(["plan", *BASE, "--gpus", "1", "--top", "1", "--json", "--reserve-gb", "0",
                               "--fragmentation", "0"]).output)
    assert whole["memory_budget"]["usable_bytes"] == whole["memory_budget"]["device_bytes"] == 80 * 2 ** 30
    peak_gb = whole["candidates"][0]["peak_memory_bytes"] / 2 ** 30
    tight = ["plan", *BASE, "--gpus", "1", "--top", "1", "--json", "--memory-gb", f"{peak_gb * 1.001 + 2:.6f}"]
    with_margin = json.loads(invoke(tight).output)
    budget = with_margin["memory_budget"]
    assert (budget["reserve_bytes"], budget["fragmentation"]) == (2 * 2 ** 30, 0.05)
    assert budget["usable_bytes"] == (budget["device_bytes"] - budget["reserve_bytes"]) / 1.05
    assert all(candidate["peak_memory_bytes"] <= budget["usable_bytes"] for candidate in with_margin["candidates"])
    assert whole["candidates"][0]["overrides"] not in [c["overrides"] for c in with_margin["candidates"]]
    unreserved = json.loads(invoke([*tight, "--fragmentation", "0"]).output)
    assert unreserved["candidates"][0]["overrides"] == whole["candidates"][0]["overrides"]
    table = " ".join(invoke(["plan", *BASE, "--gpus", "8", "--top", "1"]).output.split())  # the title wraps
    assert "each rank's prediction fits 74.3 GiB (reserved 2 GiB and 5% for fragmentation)" in table


def test_a_reserve_that_leaves_nothing_of_the_device_is_refused_in_one_line():
    result = invoke(["plan", *BASE, "--gpus", "8", "--memory-gb", "2", "--reserve-gb", "2"])
    assert result.exit_code == 2
    assert "--reserve-gb 2 leaves nothing of 2 GiB per device" in result.output
