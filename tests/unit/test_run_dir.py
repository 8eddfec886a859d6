"""What may go into a run directory, asked before anything starts: a path the file system can hold, no other
command's run replaced by ``bench`` or ``check-cluster``, and a directory (and checkpoints folder) that can be
written."""

import errno
import os

import pytest

from ppctl.run import rundir
from ppctl.run.rundir import (other_run_problem, path_length_problem, recorded_task, run_dir_problem,
                              writable_problem)

# --- a path the file system cannot hold ------------------------------------------------------------------

def test_a_name_longer_than_name_max_is_refused_naming_the_limit(tmp_path):
    name_max = os.pathconf(tmp_path, "PC_NAME_MAX")
    problem = path_length_problem(tmp_path / ("a" * 300) / "run")
    assert problem.startswith(f"trainer.out_dir={str(tmp_path)[:50]}")
    assert f"in it is 300 bytes long; this file system takes names of at most {name_max} bytes (NAME_MAX): " \
           "choose a shorter trainer.out_dir" in problem and "\n" not in problem
    assert path_length_problem(tmp_path / ("a" * name_max)) is None


def test_a_path_longer_than_path_max_less_the_runs_own_files_is_refused(tmp_path):
    path_max = os.pathconf(tmp_path, "PC_PATH_MAX")
    deep = tmp_path.joinpath(*["b" * 200] * 22)  # 4,400 characters and more, each name within NAME_MAX
    problem = path_length_problem(deep)
    limit = path_max - 1 - rundir.RUN_FILES_ROOM
    assert f"its absolute path is {len(str(deep)):,} bytes long; a run directory may take at most {limit:,} " \
           f"(PATH_MAX={path_max:,}, less {rundir.RUN_FILES_ROOM} for the files a run writes in it)" in problem
    assert len(problem) < 400, "the path is shown by its ends"
    fits = str(tmp_path)
    while len(fits) < limit:
        fits += "/" + "c" * min(200, limit - len(fits) - 1)
    assert len(fits) == limit and path_length_problem(fits) is None
    assert path_length_problem(fits + "c") is not None


def test_a_relative_run_directory_is_measured_as_the_absolute_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert path_length_problem(rundir.default_run_dir()) is None
    assert "bytes long" in path_length_problem("x" * 300)


# --- another command's run ---------------------------------------------------------------------------------

def training_run(run_dir):
    """A training run's directory as ``ppctl train`` leaves it (written before the task record existed)."""
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "config.yaml").write_text("trainer: {max_steps: 7}\n")
    return run_dir


@pytest.mark.parametrize("task", ["bench", "check-cluster"])
def test_bench_and_check_cluster_refuse_a_training_runs_directory(tmp_path, task):
    run_dir = training_run(tmp_path / "run")
    assert run_dir_problem(run_dir, task) == (
        f"trainer.out_dir={run_dir} holds a training run (config.yaml, checkpoints); ppctl {task} would replace its "
        f"config.yaml: choose another trainer.out_dir, or leave it unset for a new runs/<timestamp>")
    assert run_dir_problem(run_dir, "train") is None  # train has its own rule: no checkpoint committed here


def test_a_submitted_jobs_directory_is_a_training_run(tmp_path):
    (tmp_path / "config.yaml").write_text("x")
    (tmp_path / "job.json").write_text("{}")
    assert "holds a training run (config.yaml, job.json)" in other_run_problem(tmp_path, "bench")


def test_a_command_may_reuse_its_own_earlier_directory_and_an_empty_one(tmp_path):
    (tmp_path / "config.yaml").write_text("x")
    (tmp_path / rundir.TASK_RECORD).write_text("check-cluster\n")
    assert other_run_problem(tmp_path, "check-cluster") is None
    assert "holds a ppctl check-cluster run (config.yaml)" in other_run_problem(tmp_path, "bench")
    assert other_run_problem(tmp_path / "new", "bench") is None and other_run_problem(tmp_path / "new", "train") is None


def test_the_command_of_a_directory_without_a_record_is_read_from_its_files(tmp_path):
    assert recorded_task(tmp_path) is None
    (tmp_path / "config.yaml").write_text("x")
    assert recorded_task(tmp_path) == "train"
    (tmp_path / "bench_request.json").write_text("{}")
    assert recorded_task(tmp_path) == "bench" and other_run_problem(tmp_path, "bench") is None


# --- a run directory that cannot be written ------------------------------------------------------------------

def test_a_writable_run_directory_passes_and_keeps_no_probe(tmp_path):
    (tmp_path / "checkpoints").mkdir()
    assert writable_problem(tmp_path, with_checkpoints=True) is None
    assert sorted(path.name for path in tmp_path.rglob("*")) == ["checkpoints"]


def test_a_checkpoints_folder_that_cannot_be_written_is_refused_naming_it_and_why(tmp_path, monkeypatch):
    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    real_mkstemp = rundir.tempfile.mkstemp

    def read_only_checkpoints(prefix, dir):
        if dir == checkpoints:
            raise PermissionError(errno.EACCES, "Permission denied", str(dir / f"{prefix}x"))
        return real_mkstemp(prefix=prefix, dir=dir)

    monkeypatch.setattr(rundir.tempfile, "mkstemp", read_only_checkpoints)
    assert writable_problem(tmp_path, with_checkpoints=True) == (
        f"trainer.out_dir={tmp_path}: cannot write into {checkpoints}: Permission denied; the run writes its "
        f"checkpoints there: make it writable, or choose another trainer.out_dir")
    assert writable_problem(tmp_path, with_checkpoints=False) is None  # bench and check-cluster save none


def test_a_checkpoints_folder_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "checkpoints").write_text("not a folder")
    assert writable_problem(tmp_path, with_checkpoints=True).startswith(
        f"trainer.out_dir={tmp_path}: cannot write into {tmp_path / 'checkpoints'}: Not a directory; ")


def test_a_read_only_run_directory_is_refused(tmp_path):
    tmp_path.chmod(0o555)
    try:
        if os.access(tmp_path, os.W_OK):
            pytest.skip("this user writes into read-only folders (root)")
        assert writable_problem(tmp_path, with_checkpoints=True) == (
            f"trainer.out_dir={tmp_path}: cannot write into {tmp_path}: Permission denied; the run writes its files "
            f"there: make it writable, or choose another trainer.out_dir")
    finally:
        tmp_path.chmod(0o755)
