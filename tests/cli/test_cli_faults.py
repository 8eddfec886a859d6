"""Interruptions and faults end cleanly: nothing of a job outlives ``ppctl``, and every end says why.

First the launcher itself (``run_plan``) with a stand-in for torchrun: two plain Python "workers", each in a
session of its own as torchrun starts them, so the stop logic is checked in a fraction of a second. Then
``ppctl train`` on a tiny endless run (2 workers, pp=2), signalled once its first step is logged: SIGTERM,
SIGINT twice, SIGKILL of ``ppctl``, SIGKILL of a worker. After each, no process of the job may be left: none
of the processes seen under ``ppctl`` while it ran, and none whose command line names the run directory.
"""

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from ppctl.checkpoint.files import latest_checkpoint, read_index
from ppctl.run.launch import LaunchPlan, run_plan
from ppctl.run.proctree import descendants, read_parent_table
from tests.cli.conftest import REPO

pytestmark = pytest.mark.skipif(read_parent_table() is None, reason="needs Linux /proc")

ENDLESS = ["model=gpt_tiny", "data=synthetic", "parallel.pp=2", "trainer.max_steps=100000", "trainer.log_every=1",
           "trainer.tensorboard=false", "trainer.eval_every=0", "trainer.checkpoints=false",
           "launcher.backend=gloo"]  # ppctl then need not import torch to choose


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie has ended; only its parent has not collected it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def processes_mentioning(text: str) -> list[int]:
    """Running processes whose command line contains ``text`` (a run directory: torchrun's and every worker's)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if text.encode() in cmdline.read_bytes() and alive(int(cmdline.parent.name)):
                found.append(int(cmdline.parent.name))
        except OSError:
            continue
    return found


def leftovers(pids: list[int], run_dir: Path, within: float = 10.0) -> list[int]:
    """The processes of a job still running after up to ``within`` seconds: any of ``pids``, or naming ``run_dir``."""
    deadline = time.monotonic() + within
    while True:
        left = sorted({pid for pid in pids if alive(pid)} | set(processes_mentioning(str(run_dir))))
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


def kill_all(pids: list[int], run_dir: Path) -> None:
    """Clean up after a failed test: SIGKILL what is left of the job."""
    for pid in set(pids) | set(processes_mentioning(str(run_dir))):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


# --- the launcher, with a stand-in for torchrun ---------------------------------------------------------

STAND_IN_TORCHRUN = """
import ctypes, signal, subprocess, sys
out, worker, mode = sys.argv[1:]
value = ctypes.c_int()
ctypes.CDLL(None).prctl(2, ctypes.byref(value), 0, 0, 0)  # PR_GET_PDEATHSIG
print(f"parent-death signal {value.value}", file=sys.stderr, flush=True)
signal.signal(signal.SIGTERM, lambda *_: open(f"{out}/torchrun.sigterm", "w").close())
workers = [subprocess.Popen([sys.executable, worker, out, str(rank), mode], start_new_session=True)
           for rank in range(2)]
sys.exit(max(abs(worker.wait()) for worker in workers))
"""

STAND_IN_WORKER = """
import os, signal, sys, time
out, rank, mode = sys.argv[1:]
def on_stop(signum, _):
    open(f"{out}/worker{rank}.stopped", "w").write(signal.Signals(signum).name)
    if mode == "stops":
        sys.exit(0)
signal.signal(signal.SIGTERM, on_stop)
signal.signal(signal.SIGINT, on_stop)
open(f"{out}/worker{rank}.pid", "w").write(str(os.getpid()))
while True:
    time.sleep(0.02)
"""


def run_stand_in(tmp_path: Path, mode: str, signals: list[int], shutdown_timeout_s: float = 30):
    """``run_plan`` on the stand-in; ``signals`` reach this process once both workers run (the second once the
    first was forwarded). Returns the result, the workers' pids and the seconds from the first signal to the end
    (None without signals)."""
    (tmp_path / "torchrun.py").write_text(STAND_IN_TORCHRUN)
    (tmp_path / "worker.py").write_text(STAND_IN_WORKER)
    plan = LaunchPlan(command=[sys.executable, str(tmp_path / "torchrun.py"), str(tmp_path),
                               str(tmp_path / "worker.py"), mode],
                      env={}, run_dir=tmp_path, shutdown_timeout_s=shutdown_timeout_s)
    pid_files = [tmp_path / f"worker{rank}.pid" for rank in range(2)]
    sent_at = []

    def send_signals():
        for index, signum in enumerate(signals):
            awaited = pid_files if index == 0 else [tmp_path / f"worker{rank}.stopped" for rank in range(2)]
            while not all(path.exists() for path in awaited):
                time.sleep(0.02)
            time.sleep(0.05)
            sent_at.append(time.monotonic())
            os.kill(os.getpid(), signum)

    # A signal that came after run_plan (a broken stand-in) must not end pytest: ignored out here.
    previous = {signum: signal.signal(signum, lambda *_: None) for signum in (signal.SIGTERM, signal.SIGINT)}
    sender = threading.Thread(target=send_signals, daemon=True)
    try:
        sender.start()
        result = run_plan(plan)
        ended = time.monotonic()
        sender.join(timeout=1)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    pids = [int(path.read_text()) for path in pid_files if path.exists() and path.read_text()]
    return result, pids, ended - sent_at[0] if sent_at else None


@pytest.mark.timeout(30)
def test_launcher_forwards_a_stop_to_the_workers_not_torchrun(tmp_path):
    """SIGTERM to the launcher: SIGTERM to each worker (in its own session), none to torchrun; torchrun ends
    by itself when they stop. torchrun runs with the parent-death signal SIGTERM."""
    result, pids, seconds = run_stand_in(tmp_path, "stops", [signal.SIGTERM])
    assert (result.returncode, result.interrupted, result.killed, result.exit_code) == (0, signal.SIGTERM, None, 143)
    assert [(tmp_path / f"worker{rank}.stopped").read_text() for rank in range(2)] == ["SIGTERM", "SIGTERM"]
    assert not (tmp_path / "torchrun.sigterm").exists()
    assert f"parent-death signal {int(signal.SIGTERM)}" in (tmp_path / "launcher.log").read_text()
    assert seconds < 5 and leftovers(pids, tmp_path, within=2) == []


@pytest.mark.timeout(30)
def test_launcher_kills_on_a_second_signal(tmp_path, capfd):
    """Workers that ignore the stop: a second signal (here SIGINT after SIGTERM) kills the whole job at once."""
    result, pids, seconds = run_stand_in(tmp_path, "ignores", [signal.SIGTERM, signal.SIGINT])
    assert result.interrupted == signal.SIGTERM and result.killed == "on a second signal (SIGINT)"
    assert result.returncode == -signal.SIGKILL and result.exit_code == 143
    assert seconds < 5 and leftovers(pids, tmp_path, within=2) == []
    assert "stopping (SIGTERM)" in capfd.readouterr().err


@pytest.mark.timeout(30)
def test_launcher_kills_after_the_shutdown_timeout(tmp_path, capfd):
    """Workers that ignore the stop are killed, torchrun and all, once ``launcher.shutdown_timeout_s`` has passed.
    The workers got the user's SIGINT itself (their checkpoint then says "interrupted by SIGINT")."""
    result, pids, seconds = run_stand_in(tmp_path, "ignores", [signal.SIGINT], shutdown_timeout_s=1)
    assert result.interrupted == signal.SIGINT and "1 s after the stop" in result.killed and result.exit_code == 130
    assert [(tmp_path / f"worker{rank}.stopped").read_text() for rank in range(2)] == ["SIGINT", "SIGINT"]
    assert 1 <= seconds < 5 and leftovers(pids, tmp_path, within=2) == []
    assert "killing them" in capfd.readouterr().err


@pytest.mark.timeout(30)
def test_a_log_that_cannot_be_written_stops_the_job_in_one_line(tmp_path, monkeypatch):
    """The disk under launcher.log fills (the write fails with ENOSPC): the workers are stopped as by a signal,
    nothing of the job is left, and the result is one line naming the log's file system and what is saved."""
    import errno

    from ppctl.run import failures, supervise

    def full_disk(log_file, chunk):  # the disk fills once both workers run
        deadline = time.monotonic() + 10
        while not all((tmp_path / f"worker{rank}.pid").exists() for rank in range(2)) and time.monotonic() < deadline:
            time.sleep(0.02)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(supervise, "_append_log", full_disk)
    started = time.monotonic()
    result, pids, _ = run_stand_in(tmp_path, "stops", [])
    assert result.interrupted is None and result.exit_code == 1 and result.killed is None
    assert len(pids) == 2 and all((tmp_path / f"worker{rank}.stopped").exists() for rank in range(2))
    assert result.failure == (f"cannot write {tmp_path / 'launcher.log'}: No space left on device (the file system "
                              f"mounted at {failures.mount_point(tmp_path)}); the workers were stopped; no checkpoint "
                              f"of this run was saved")
    assert time.monotonic() - started < 10 and leftovers(pids, tmp_path, within=2) == []


# --- ppctl train ----------------------------------------------------------------------------------------

class Job:
    """``ppctl train`` running in the background, its output lines collected as they come."""

    def __init__(self, run_dir: Path, *overrides: str):
        self.run_dir = run_dir
        env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "ppctl.cli.app", "train", *ENDLESS, *overrides, f"trainer.out_dir={run_dir}"],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.stdout: list[str] = []
        self.stderr: list[str] = []
        for stream, lines in ((self.process.stdout, self.stdout), (self.process.stderr, self.stderr)):
            threading.Thread(target=lambda stream=stream, lines=lines: [lines.append(line) for line in stream],
                             daemon=True).start()
        self.pids: list[int] = []

    def wait_for(self, lines: list[str], prefix: str, timeout: float = 120) -> str:
        """The first line of ``lines`` starting with ``prefix``; fails if ppctl ends first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [line for line in list(lines) if line.startswith(prefix)]
            if found:
                return found[0]
            assert self.process.poll() is None, f"ppctl ended ({self.process.returncode}): {''.join(self.stderr)}"
            time.sleep(0.05)
        raise AssertionError(f"no line {prefix!r} within {timeout} s: {''.join(self.stderr)[-2000:]}")

    def start_training(self) -> None:
        """Wait for the first step line, then note the job's processes (torchrun and the workers)."""
        self.wait_for(self.stdout, "step")
        self.pids = descendants(read_parent_table(), self.process.pid)
        assert len(self.pids) == 3, self.pids  # torchrun and 2 workers

    def worker(self, rank: int) -> int:
        """The pid of the worker of ``rank``."""
        for pid in self.pids:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            if f"RANK={rank}".encode() in environ and b"ppctl.cli.worker" in Path(f"/proc/{pid}/cmdline").read_bytes():
                return pid
        raise AssertionError(f"no worker of rank {rank} among {self.pids}")

    def end(self, timeout: float) -> tuple[int, float]:
        """Wait for ppctl to exit: its exit code and the seconds it took."""
        started = time.monotonic()
        returncode = self.process.wait(timeout=timeout)
        time.sleep(0.2)  # the output threads catch up
        return returncode, time.monotonic() - started

    def last_error_line(self) -> str:
        return "".join(self.stderr).strip().splitlines()[-1]


@pytest.fixture
def job(tmp_path):
    """Start a Job with ``start(*overrides)``; whatever is left of it is killed after the test."""
    jobs = []

    def start(*overrides: str) -> Job:
        jobs.append(Job(tmp_path / "run", *overrides))
        return jobs[-1]

    yield start
    for started in jobs:
        if started.process.poll() is None:
            started.process.kill()
        kill_all(started.pids, started.run_dir)


@pytest.mark.timeout(150)
def test_sigterm_stops_after_the_step_saves_and_exits_143(job):
    """SIGTERM: the workers finish their step and save a checkpoint; ppctl exits 143 saying how to resume."""
    run = job("trainer.checkpoints=true")
    run.start_training()
    run.process.send_signal(signal.SIGTERM)
    returncode, seconds = run.end(timeout=90)
    assert returncode == 143, "".join(run.stderr)[-3000:]
    assert any(line.startswith("stopping (SIGTERM): the workers finish their step and save a checkpoint")
               for line in run.stderr)
    assert run.last_error_line() == ("interrupted by SIGTERM: the workers stopped after their step and saved a "
                                     f"checkpoint; resume with trainer.resume_from={run.run_dir}")
    latest = latest_checkpoint(run.run_dir)  # complete (committed), and taken because of the signal
    assert latest is not None and read_index(latest)["reason"] == "interrupted by SIGTERM"
    assert seconds < 30, seconds  # well within launcher.shutdown_timeout_s (60)
    assert leftovers(run.pids, run.run_dir, within=5) == []


@pytest.mark.timeout(150)
def test_second_sigint_kills_at_once_and_exits_130(job):
    """SIGINT while a worker cannot stop (SIGSTOPped): waiting; a second SIGINT kills the job at once."""
    run = job()
    run.start_training()
    os.kill(run.worker(1), signal.SIGSTOP)
    run.process.send_signal(signal.SIGINT)
    run.wait_for(run.stderr, "stopping (SIGINT)", timeout=10)
    time.sleep(0.5)
    assert run.process.poll() is None
    run.process.send_signal(signal.SIGINT)
    returncode, seconds = run.end(timeout=30)
    assert returncode == 130, "".join(run.stderr)[-3000:]
    assert run.last_error_line() == "interrupted by SIGINT: the workers were killed on a second signal (SIGINT)"
    assert seconds < 5, seconds
    assert leftovers(run.pids, run.run_dir, within=5) == []


@pytest.mark.timeout(150)
def test_sigkill_of_ppctl_leaves_nothing_behind(job):
    """ppctl killed outright: torchrun gets its parent-death SIGTERM and stops the workers; nothing is left."""
    run = job()
    run.start_training()
    run.process.send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    run.end(timeout=10)
    assert leftovers(run.pids, run.run_dir, within=20) == []
    assert time.monotonic() - killed_at < 20


@pytest.mark.timeout(150)
def test_killed_worker_ends_the_job_naming_it(job):
    """A worker SIGKILLed mid-training: ppctl exits 1 within seconds naming that rank, not its peer (whose gloo
    receive fails at once with "Connection closed by peer"); nothing is left."""
    run = job()
    run.start_training()
    os.kill(run.worker(1), signal.SIGKILL)
    returncode, seconds = run.end(timeout=60)
    assert returncode == 1, "".join(run.stderr)[-3000:]
    assert run.last_error_line().startswith("error: worker rank 1 failed: killed by signal 9 (log: ")
    assert seconds < 15, seconds
    assert leftovers(run.pids, run.run_dir, within=5) == []


@pytest.mark.timeout(60)
@pytest.mark.parametrize("place", ["under_a_file", "read_only"])
def test_run_directory_that_cannot_be_created_is_refused(ppctl, tmp_path, place):
    """One line naming trainer.out_dir and the reason, exit 2, nothing started."""
    if place == "under_a_file":
        (tmp_path / "file").write_text("not a directory")
        run_dir, reason = tmp_path / "file" / "run", "Not a directory"
    else:
        if os.geteuid() == 0:
            pytest.skip("root writes into a read-only directory")
        (tmp_path / "ro").mkdir(mode=0o555)
        run_dir, reason = tmp_path / "ro" / "run", "Permission denied"
    result = ppctl("train", *ENDLESS, f"trainer.out_dir={run_dir}", timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"error: trainer.out_dir={run_dir}: cannot create the run directory: {reason}"], result.stderr
    assert result.stdout == "" and not run_dir.exists()
