"""The launch's run directory and rendezvous, refused in one line before any worker starts and before anything in
the directory changes: another command's run under ``bench`` or ``check-cluster``, a directory or checkpoints
folder that cannot be written, a path the file system cannot hold, a rendezvous host that does not resolve.

The Typer app runs in this process, as in ``test_cli_refusals.py``, whose helpers these are.
"""

import errno
import time

import pytest

from ppctl.checkpoint.files import DATA_KEYS, MODEL_KEYS, checkpoints_dir, commit, temporary_dir
from ppctl.resolve import compose_config
from ppctl.run import rundir
from tests.cli.test_cli_refusals import TINY, assert_one_line, committed_run, invoke


def files_of(folder) -> dict[str, bytes]:
    """Every file below ``folder`` (relative name -> bytes): what a refusal must leave as it was."""
    return {str(path.relative_to(folder)): path.read_bytes() for path in sorted(folder.rglob("*")) if path.is_file()}


@pytest.mark.parametrize("command", [["bench", "--steps", "1", "--repeats", "1"], ["check-cluster"]])
def test_bench_and_check_cluster_refuse_a_training_runs_directory(tmp_path, command):
    run_dir = tmp_path / "run"
    committed_run(run_dir)
    (run_dir / "config.yaml").write_text("trainer: {max_steps: 7}  # what ppctl status and the Slurm job read\n")
    before = files_of(run_dir)
    result = invoke([*command, *TINY, f"trainer.out_dir={run_dir}"])
    assert_one_line(result, 2, f"error: trainer.out_dir={run_dir} holds a training run (config.yaml, checkpoints); "
                               f"ppctl {command[0]} would replace its config.yaml: choose another trainer.out_dir, or "
                               f"leave it unset for a new runs/<timestamp>")
    assert files_of(run_dir) == before


def test_check_cluster_may_reuse_its_own_earlier_directory(tmp_path):
    (tmp_path / "config.yaml").write_text("x")
    (tmp_path / "cluster.json").write_text("{}")  # an earlier check-cluster's, written before the task record
    result = invoke(["check-cluster", *TINY, f"trainer.out_dir={tmp_path}", "--dry-run"])
    assert result.exit_code == 0 and result.stdout.startswith(f"run directory: {tmp_path}"), result.stderr


def resumable_run(run_dir, step: int = 3):
    """A run directory whose checkpoint at ``step`` a ``TINY`` run may resume from (files as the ranks write them)."""
    config = compose_config(TINY)
    partial = temporary_dir(run_dir, step)
    partial.mkdir(parents=True)
    (partial / ".metadata").write_bytes(b"metadata")
    index = {"layout": {"tp": 1, "pp": 2, "vpp": 1, "dp": 1, "cp": 1, "schedule": "1f1b",
                        "distributed_optimizer": False}, "precision": config.trainer.precision, "reason": "end",
             "model": {key: getattr(config.model, key) for key in MODEL_KEYS},
             "data": {key: getattr(config.trainer, key) for key in DATA_KEYS}}
    return commit(run_dir, step, index, keep_last=2)


def test_a_resume_whose_checkpoints_folder_cannot_be_written_is_refused_before_any_step(tmp_path, monkeypatch):
    """As on a read-only mount or folder (root writes into a read-only folder, so the write is made to fail)."""
    run_dir = tmp_path / "run"
    resumable_run(run_dir)
    (run_dir / "config.yaml").write_text("the run's own\n")
    before = files_of(run_dir)
    real_mkstemp = rundir.tempfile.mkstemp

    def read_only_checkpoints(prefix, dir):
        if dir == checkpoints_dir(run_dir):
            raise OSError(errno.EROFS, "Read-only file system", str(dir))
        return real_mkstemp(prefix=prefix, dir=dir)

    monkeypatch.setattr(rundir.tempfile, "mkstemp", read_only_checkpoints)
    result = invoke(["train", *TINY, f"trainer.resume_from={run_dir}", "trainer.max_steps=4"])
    assert_one_line(result, 2, f"error: trainer.out_dir={run_dir}: cannot write into {checkpoints_dir(run_dir)}: "
                               f"Read-only file system; the run writes its checkpoints there: make it writable, or "
                               f"choose another trainer.out_dir")
    assert files_of(run_dir) == before  # no config.yaml replaced, no lock, no log


def test_a_checkpoints_folder_that_is_a_file_is_refused(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "checkpoints").write_text("not a folder")
    result = invoke(["train", *TINY, f"trainer.out_dir={run_dir}"])
    assert_one_line(result, 2, f"error: trainer.out_dir={run_dir}: cannot write into {run_dir / 'checkpoints'}: Not a "
                               f"directory; ")
    assert files_of(run_dir) == {"checkpoints": b"not a folder"}


LONG_NAME = "a" * 300
DEEP = "/".join(["b" * 200] * 22)  # 4,400 characters, each name within NAME_MAX


@pytest.mark.parametrize("command", [["train"], ["bench", "--steps", "1", "--repeats", "1"], ["check-cluster"],
                                     ["submit", "launcher=slurm"]])
@pytest.mark.parametrize("relative, said", [
    (LONG_NAME, "in it is 300 bytes long; this file system takes names of at most"),
    (DEEP, "bytes long; a run directory may take at most"),
])
def test_a_run_directory_path_too_long_is_refused_in_one_line(tmp_path, command, relative, said):
    result = invoke([*command, *TINY, f"trainer.out_dir={tmp_path / relative}"])
    line = assert_one_line(result, 2, f"error: trainer.out_dir={str(tmp_path)[:40]}")
    assert said in line and "choose a shorter trainer.out_dir" in line and len(line) < 500
    assert list(tmp_path.iterdir()) == []


@pytest.mark.timeout(60)
def test_a_rendezvous_host_that_does_not_resolve_is_refused_at_once(tmp_path):
    endpoint = "nosuchhost.invalid:29400"  # .invalid never resolves (RFC 2606)
    started = time.monotonic()
    result = invoke(["train", *TINY, "launcher.nnodes=2", "launcher.node_rank=1", f"launcher.rdzv_endpoint={endpoint}",
                     f"trainer.out_dir={tmp_path / 'r'}"])
    line = assert_one_line(result, 2, f"error: launcher.rdzv_endpoint={endpoint}: host nosuchhost.invalid does not "
                                      f"resolve (")
    assert line.endswith("); set the name or address of the node that hosts the rendezvous, one that every node can "
                         "resolve")
    assert time.monotonic() - started < 5 + 5  # the resolver's bound, and composing the config
    assert not (tmp_path / "r").exists()
