"""Bad inputs the commands close with one line on stderr and a non-zero exit, nothing lost or left behind.

The Typer app runs in this process (nothing here starts a worker: each case is refused before that),
so every case costs a config composition, not a ppctl and torchrun start.
"""

import json
import os
import socket
import threading
import time

import pytest
from typer.testing import CliRunner

from ppctl.checkpoint.files import checkpoints_dir, commit, temporary_dir
from ppctl.cli.app import app
from ppctl.run.rundir import RunDirLock

TINY = ["data=synthetic", "parallel.pp=2", "trainer.max_steps=2", "trainer.tensorboard=false",
        "trainer.eval_every=0", "launcher.backend=gloo"]  # gloo: ppctl need not import torch to choose


def invoke(args: list[str]):
    """Run the CLI in this process; returns the result (exit code, stdout, stderr apart)."""
    return CliRunner().invoke(app, args)


def assert_one_line(result, code: int, start: str) -> str:
    """The exit status and the one stderr line (which starts with ``start``); returns that line."""
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == code, (result.stdout, result.stderr, result.exception)
    assert len(lines) == 1 and lines[0].startswith(start), result.stderr
    return lines[0]


def test_a_second_run_into_a_live_run_directory_is_refused_naming_its_pid(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("the live run's\n")
    with RunDirLock(run_dir):  # the live run (this process holds its lock)
        result = invoke(["train", *TINY, f"trainer.out_dir={run_dir}"])
    line = assert_one_line(result, 2, f"error: trainer.out_dir={run_dir}: another run is using this run directory")
    assert f"(ppctl pid {os.getpid()}, lock {run_dir / 'ppctl.lock'})" in line
    assert (run_dir / "config.yaml").read_text() == "the live run's\n"  # nothing of the live run touched
    assert sorted(path.name for path in run_dir.iterdir()) == ["config.yaml", "ppctl.lock"]


def test_an_explicit_rendezvous_port_already_taken_is_refused(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        result = invoke(["train", *TINY, f"launcher.rdzv_endpoint=127.0.0.1:{port}", f"trainer.out_dir={tmp_path}/r"])
    assert_one_line(result, 2, f"error: launcher.rdzv_endpoint=127.0.0.1:{port}: port {port} is already in use on "
                               "this machine")
    assert not (tmp_path / "r").exists()


@pytest.mark.timeout(60)
def test_an_endpoint_that_is_no_rendezvous_fails_within_the_timeout(tmp_path):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(4)
    held = []
    threading.Thread(target=lambda: held.append(server.accept()[0]), daemon=True).start()
    endpoint = f"127.0.0.1:{server.getsockname()[1]}"
    started = time.monotonic()
    try:
        result = invoke(["train", *TINY, "launcher.nnodes=2", "launcher.node_rank=1", f"launcher.rdzv_endpoint={endpoint}",
                         "launcher.timeout_s=1", f"trainer.out_dir={tmp_path}/r"])
    finally:
        server.close()
        for connection in held:
            connection.close()
    assert_one_line(result, 2, f"error: launcher.rdzv_endpoint={endpoint}: something accepts connections there but "
                               "does not answer as a torch rendezvous within launcher.timeout_s=1 s")
    assert time.monotonic() - started < 1 + 5  # the limit, and composing the config
    assert not (tmp_path / "r").exists()


def test_inspect_schedule_creates_the_folders_of_its_picture_or_says_why_not(tmp_path):
    picture = tmp_path / "does" / "not" / "exist" / "x.svg"
    result = invoke(["inspect-schedule", "--out", str(picture)])
    assert result.exit_code == 0, result.stderr
    assert picture.is_file() and f"timeline written to {picture}" in result.stdout
    (tmp_path / "file").write_text("in the way")
    blocked = tmp_path / "file" / "x.svg"
    assert_one_line(invoke(["inspect-schedule", "--out", str(blocked)]), 2,
                    f"error: --out {blocked}: cannot write the picture: Not a directory")


def test_inspect_schedule_piped_prints_a_plain_grid_of_labelled_cells():
    result = invoke(["inspect-schedule", "parallel.pp=2", "trainer.global_batch_size=4"])  # stdout: no terminal
    assert result.exit_code == 0, result.stderr
    rows = {line.split()[1]: line.split()[2:] for line in result.stdout.splitlines() if line.startswith("rank ")}
    assert rows["0"][:6] == ["F0", "F1", ".", ".", "BW0", "-"] and rows["1"][:3] == [".", "F0", "BW0"]
    assert "\x1b[" not in result.stdout and "bubble ratio" in result.stdout


def test_inspect_schedule_shows_each_ranks_activation_memory_over_time():
    from ppctl.resolve import compose_config
    from ppctl.resolve.resolved import resolve
    from ppctl.plan.memory import config_memory

    shape = ["schedule=zb_h1", "parallel.pp=2", "trainer.global_batch_size=4"]
    text = invoke(["inspect-schedule", *shape])  # piped: ASCII levels, as the plain grid
    assert text.exit_code == 0, text.stderr
    lines = text.stdout.splitlines()
    heading = next(index for index, line in enumerate(lines) if line.startswith("activation memory per rank"))
    predicted = [parts.activations for parts in config_memory(resolve(compose_config(shape)))]  # no recomputation
    for pp_rank, line in enumerate(lines[heading + 1:heading + 3]):
        word, label, value, unit, spark = line.split(maxsplit=4)
        assert (word, label, value, unit) == ("rank", str(pp_rank), f"{predicted[pp_rank] / 2**20:.1f}", "MiB")
        assert spark.strip() and set(spark) <= set(" _.-=+*#@")
    report = json.loads(invoke(["inspect-schedule", *shape, "--steps", "2", "--json"]).stdout)
    for rank, activations in zip(report["ranks"], predicted):
        over_time = rank["activation_bytes_over_time"]
        assert rank["activation_bytes"] == activations == max(held for _, held in over_time)
        assert over_time[0] == [0, 0] and over_time[-1][1] == 0 and over_time[-1][0] <= report["makespan"]
        assert [held for _, held in over_time].count(0) == 3  # the start, and the end of each of the two steps


@pytest.mark.timeout(60)
@pytest.mark.parametrize("as_json", [True, False])
def test_inspect_layout_of_ten_million_dp_ranks_is_summarised_at_once(as_json):
    started = time.monotonic()
    result = invoke(["inspect-layout", "parallel.dp=10000000", "trainer.global_batch_size=10000000",
                     *(["--json"] if as_json else [])])
    assert result.exit_code == 0, result.stderr
    assert time.monotonic() - started < 5 and len(result.stdout) < 64 << 10  # composing the config included
    if as_json:
        report = json.loads(result.stdout)
        assert report["ranks"]["count"] == 20_000_000 and report["groups"]["dp"]["size"] == 10_000_000
    else:
        assert "process groups (summarised)" in result.stdout


def test_prepare_data_of_an_empty_jsonl_says_it_holds_no_records(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    result = invoke(["prepare-data", "data=text", f"data.path={empty}", f"data.cache_dir={tmp_path / 'cache'}"])
    assert_one_line(result, 2, f"error: data.path={empty}: empty.jsonl holds no records")


def committed_run(run_dir):
    """A run directory with one committed checkpoint (files as the ranks would write them)."""
    partial = temporary_dir(run_dir, 3)
    partial.mkdir(parents=True)
    (partial / ".metadata").write_bytes(b"metadata")
    index = {"layout": {"tp": 1, "pp": 2, "vpp": 1, "dp": 1, "cp": 1, "schedule": "1f1b",
                        "distributed_optimizer": False}, "precision": "fp32", "reason": "end",
             "model": {}, "data": {}}
    return commit(run_dir, 3, index, keep_last=2)


def test_a_tampered_index_and_a_latest_pointer_out_of_the_run_are_refused(tmp_path):
    run_dir = tmp_path / "run"
    checkpoint = committed_run(run_dir)
    index = json.loads((checkpoint / "ppctl.json").read_text())
    index["step"] = 1  # resume from another place than the one saved
    (checkpoint / "ppctl.json").write_text(json.dumps(index))
    assert_one_line(invoke(["train", *TINY, f"trainer.resume_from={run_dir}"]), 2,
                    f"error: checkpoint {checkpoint} refused: ppctl.json is corrupt")
    (checkpoints_dir(run_dir) / "latest").write_text("../../elsewhere\n")
    pointer = checkpoints_dir(run_dir) / "latest"
    assert_one_line(invoke(["train", *TINY, f"trainer.resume_from={run_dir}"]), 2,
                    f"error: {pointer} names '../../elsewhere', which leaves {checkpoints_dir(run_dir)}: refused")
    assert_one_line(invoke(["checkpoints", str(run_dir)]), 2, f"error: {pointer} names '../../elsewhere'")


def test_inspect_schedule_calibrated_from_a_traced_run(tmp_path):
    from ppctl.resolve import compose_config, to_yaml
    from ppctl.pipeline.simulate import Costs
    from ppctl.pipeline.trace import chrome_trace
    from tests.unit.test_calibrate import made_up_snapshots

    shape = ["parallel.pp=2", "schedule=1f1b", "trainer.global_batch_size=4"]
    (tmp_path / "config.yaml").write_text(to_yaml(compose_config(["data=synthetic", *shape])))
    (tmp_path / "trace.json").write_text(json.dumps(chrome_trace(made_up_snapshots(Costs(F=2, B=4, W=0)), 3)))
    text = invoke(["inspect-schedule", *shape, "--calibrate", str(tmp_path), "--cost", "comm=0"])
    assert text.exit_code == 0, text.stderr
    assert "comm given by --cost" in text.stdout and "measured: makespan" in text.stdout
    report = json.loads(invoke(["inspect-schedule", *shape, "--calibrate", str(tmp_path), "--json"]).stdout)
    calibration = report["calibration"]
    assert calibration["schedule"] == "1f1b" and report["costs"] == calibration["costs"]
    assert report["makespan"] == pytest.approx(calibration["measured_makespan_ms"], rel=0.01)
    assert json.loads(invoke(["inspect-schedule", *shape, "--json"]).stdout)["calibration"] is None
    assert_one_line(invoke(["inspect-schedule", "--calibrate", str(tmp_path / "none")]), 2,
                    f"error: --calibrate {tmp_path / 'none'}: no such run directory")
