"""``schedule=custom``: a schedule read from torch's compute-only CSV or ppctl's JSON, checked before anything starts.

Every built-in schedule written to a file and read back is the same schedule (actions,
placement, model copies, overlapped pairs) and lowers to the same program; a file torch
writes for its own schedules reads as ppctl's; a broken file is refused in one line that
names the rank, the action and the rule.
"""

import json
import os
import re

import pytest

from ppctl.config import ConfigError
from ppctl.resolve import compose_config, validate
from ppctl.pipeline.program import lower
from ppctl.pipeline.schedules import SCHEDULE_SPECS, ScheduleError, build_schedule, read_schedule_file, schedule_csv
from ppctl.pipeline.simulate import simulate

SIZES = [(2, 4), (3, 6), (4, 8), (4, 9)]  # (pp, microbatches)


def built_in_cases():
    """(name, pp, vpp, microbatches): every schedule at a few sizes it allows."""
    for name, spec in SCHEDULE_SPECS.items():
        for pp, num_microbatches in SIZES:
            for vpp in ([spec.chunks_per_rank] if spec.chunks_per_rank else [1, 2] if spec.multi_chunk else [1]):
                if spec.microbatch_error(pp, vpp, num_microbatches) is None:
                    yield name, pp, vpp, num_microbatches


def same_schedule(read, built) -> None:
    assert read.name == "custom"
    assert (read.pp, read.chunks_per_rank, read.num_microbatches) == (built.pp, built.chunks_per_rank,
                                                                       built.num_microbatches)
    assert read.placement == built.placement and read.actions == built.actions
    assert read.overlapped == built.overlapped
    program, expected = lower(read), lower(built)
    assert (program.messages, program.initial_receives, program.steps) == (expected.messages,
                                                                           expected.initial_receives, expected.steps)


@pytest.mark.parametrize("name, pp, vpp, num_microbatches", list(built_in_cases()))
def test_every_built_in_schedule_round_trips_through_both_files(tmp_path, name, pp, vpp, num_microbatches):
    built = build_schedule(name, pp, vpp, num_microbatches)
    as_json = tmp_path / "schedule.json"
    as_json.write_text(json.dumps(simulate(built).to_json()))  # what inspect-schedule --json prints
    same_schedule(read_schedule_file(as_json), built)
    if built.placement.copies == 1:  # torch's CSV knows one model copy; DualPipe's two need the JSON
        as_csv = tmp_path / "schedule.csv"
        as_csv.write_text(schedule_csv(built))
        same_schedule(read_schedule_file(as_csv), built)


def test_a_csv_torch_writes_reads_as_the_same_schedule(tmp_path):
    """torch's own ``_dump_csv`` cells (``str`` of its actions, idle slots empty) for its interleaved zero bubble."""
    from tests.unit.test_looped_schedules import torch_order_actions

    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    rows = [[str(action) if action is not None else "" for action in
             torch_order_actions(schedules.ScheduleInterleavedZeroBubble, 4, 2, 8, pp_rank)] for pp_rank in range(4)]
    path = tmp_path / "torch.csv"
    path.write_text("\n".join(",".join(row) for row in rows) + "\n")
    same_schedule(read_schedule_file(path), build_schedule("interleaved_zb", 4, 2, 8))


def write(tmp_path, text: str, suffix: str = ".csv"):
    path = tmp_path / f"schedule{suffix}"
    path.write_text(text)
    return path


@pytest.mark.parametrize("text, message", [
    ("0F0,0F1\n1F0,1F1\n", r"stage 0 \(rank 0\) microbatch 0 has 0 backwards, expected exactly 1"),
    ("0F0,0W0,0I0,0F1,0I1,0W1\n1F0,1I0,1W0,1F1,1I1,1W1\n", r"rank 0: W\(stage 0, mb 0\) comes before its B"),
    ("0F0,0B0\n0F0,1B0\n", "stage 0 runs on rank 0 and on rank 1"),
    ("0F0,0F1,2F0,2F1,2B0,2B1,0B0,0B1\n1F0,1F1,1B0,1B1\n", "placement has 3 stages, expected pp.chunks_per_rank = 2"),
    ("0F0,0SEND_F0,0B0\n", "'0SEND_F0' is not a compute action"),
    ("0F0,x,0B0\n", "row 1 .* 'x' is not a compute action"),
    ("0F0,0B0\n2F0,2B0\n", "stage 1 has no action"),
    ("0F0,0B0,0F1,0B1\n1F1,1F0,1B0,1B1\n", r"deadlock: rank 0 stuck at BW\(stage 0, mb 0\)"),
])
def test_a_broken_csv_is_refused_in_one_line(tmp_path, text, message):
    with pytest.raises(ConfigError) as error:
        validate(compose_config(["schedule=custom", f"schedule.file={write(tmp_path, text)}", "parallel.pp=2",
                                 "model.num_layers=2", "trainer.global_batch_size=2", "trainer.micro_batch_size=1"]))
    assert "\n" not in str(error.value)
    assert re.search(message, str(error.value)), str(error.value)


def test_a_file_at_other_sizes_than_the_config_is_refused(tmp_path):
    path = write(tmp_path, schedule_csv(build_schedule("1f1b", 2, 1, 4)))
    base = ["schedule=custom", f"schedule.file={path}", "model.num_layers=2", "trainer.micro_batch_size=1"]
    validate(compose_config(base + ["parallel.pp=2", "trainer.global_batch_size=4"]))
    with pytest.raises(ConfigError, match="has 2 ranks; set parallel.pp=2"):
        validate(compose_config(base + ["parallel.pp=4", "trainer.global_batch_size=4"]))
    with pytest.raises(ConfigError, match="runs 4 microbatches, the config 8"):
        validate(compose_config(base + ["parallel.pp=2", "trainer.global_batch_size=8"]))
    with pytest.raises(ConfigError, match="schedule=custom needs schedule.file=PATH"):
        validate(compose_config(["schedule=custom"]))
    with pytest.raises(ConfigError, match="read only with schedule=custom"):
        validate(compose_config([f"schedule.file={path}"]))


@pytest.mark.parametrize("name, text, message", [
    ("s.txt", "0F0", "ends in .csv .* or .json"),
    ("s.json", "{nope", "not JSON"),
    ("s.json", '{"ranks": 3}', "not a ppctl schedule"),
    ("missing.csv", None, "cannot read it"),
    ("deep.json", "[" * 200_000 + "]" * 200_000, "nested too deeply to be a ppctl schedule"),
    ("deep2.json", '{"a":' * 100_000 + "1" + "}" * 100_000, "nested too deeply"),
])
def test_an_unreadable_file_is_named(tmp_path, name, text, message):
    path = tmp_path / name
    if text is not None:
        path.write_text(text)
    with pytest.raises(ScheduleError, match=message) as refused:
        read_schedule_file(path)
    assert str(path) in str(refused.value) and "\n" not in str(refused.value)


@pytest.mark.parametrize("kind", ["fifo", "folder"])
def test_a_file_that_is_not_regular_is_refused_at_once(tmp_path, kind):
    """A FIFO would block the read for ever (no writer ever comes); a folder is no file either."""
    path = tmp_path / "s.json"
    os.mkfifo(path) if kind == "fifo" else path.mkdir()
    with pytest.raises(ConfigError, match=rf"^schedule.file {path}: not a regular file"):
        validate(compose_config(["schedule=custom", f"schedule.file={path}"]))


def test_vpp_follows_the_file(tmp_path):
    path = write(tmp_path, schedule_csv(build_schedule("interleaved_1f1b", 2, 3, 4)))
    config = compose_config(["schedule=custom", f"schedule.file={path}", "parallel.pp=2", "model.num_layers=6",
                             "trainer.global_batch_size=4", "trainer.micro_batch_size=1"])
    assert config.parallel.vpp == 3
    validate(config)
