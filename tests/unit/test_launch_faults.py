"""The launcher's pure parts: the process tree from /proc, torchrun's failure report, the first failure, what
ppctl says when interrupted, and the stop state machine (with the signalling replaced)."""

import os
import signal
import time

import pytest

from ppctl.run import supervise
from ppctl.resolve import compose_config
from ppctl.run.failures import WorkerExit, describe_failure, first_failure, is_consequence, torchrun_failures
from ppctl.run.launch import LaunchRequest, LaunchResult, build_launch_plan, describe_interruption
from ppctl.run.proctree import children, descendants, parent_of_stat, read_parent_table
from ppctl.run.supervise import SignalInbox

# torchrun's report after rank 1 was SIGKILLed and rank 0, its peer, was stopped (torch 2.13, abridged).
TORCHRUN_REPORT = """\
W1123 15:30:18.429000 1503 api.py:1028] Sending process 1514 closing signal SIGTERM
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
======================================================
ppctl.cli.worker FAILED
------------------------------------------------------
Failures:
[1]:
  time      : 2026-11-23_15:30:18
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : 1 (pid: 1514)
  error_file: <N/A>
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-23_15:30:18
  host      : localhost
  rank      : 3 (local_rank: 1)
  exitcode  : -9 (pid: 1515)  (SIGKILL)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 1515
======================================================
"""
PEER_LOST = "RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:33705"


def test_parent_of_stat_reads_past_a_command_name_with_spaces_and_parentheses():
    assert parent_of_stat("4242 (python) S 17 4242 4242 0 -1") == 17
    assert parent_of_stat("4243 (odd) name (x)) R 99 1 1 0") == 99


def test_children_and_descendants_walk_the_tree():
    parents = {10: 1, 11: 10, 12: 10, 13: 11, 14: 13, 20: 1}
    assert children(parents, 10) == [11, 12]
    assert descendants(parents, 10) == [11, 12, 13, 14]
    assert descendants(parents, 20) == [] and descendants(parents, 99) == []


def test_read_parent_table_from_proc(tmp_path):
    table = read_parent_table()
    if table is None:
        pytest.skip("no /proc here")
    assert table[os.getpid()] == os.getppid()
    fake = tmp_path / "proc"
    for pid, line in {"self": "1 (init) S 0", "1": "1 (init) S 0", "7": "7 (a b) S 1", "8": "8 (w) S 7"}.items():
        (fake / pid).mkdir(parents=True)
        (fake / pid / "stat").write_text(line)
    assert read_parent_table(fake) == {1: 0, 7: 1, 8: 7}
    assert read_parent_table(tmp_path / "nowhere") is None


def test_torchrun_failures_root_cause_first():
    assert torchrun_failures(TORCHRUN_REPORT) == [WorkerExit(3, -9), WorkerExit(0, 1)]
    alone = TORCHRUN_REPORT.replace(TORCHRUN_REPORT[TORCHRUN_REPORT.index("[1]:"):TORCHRUN_REPORT.index("-----\nRoot")],
                                    "  <NO_OTHER_FAILURES>\n")
    assert torchrun_failures(alone) == [WorkerExit(3, -9)]
    assert torchrun_failures("no report here") == []


@pytest.mark.parametrize("exits, errors, expected", [
    # torchrun saw the peer first (same monitor pass): the killed rank is named anyway.
    ([WorkerExit(0, 1), WorkerExit(1, -9)], {0: PEER_LOST}, (1, "killed by signal 9")),
    # the root cause is a real error: kept, even if a consequence's error file is older.
    ([WorkerExit(2, 1), WorkerExit(0, 1)], {0: PEER_LOST, 2: "ValueError: bad"}, (2, "ValueError: bad")),
    # ranks stopped by torchrun's SIGTERM are consequences too.
    ([WorkerExit(0, -15), WorkerExit(1, 1)], {}, (1, "exit code 1")),
    # every failure is a consequence (the first failure was on another node): torchrun's root cause.
    ([WorkerExit(1, 1), WorkerExit(0, 1)], {0: PEER_LOST, 1: PEER_LOST}, (1, PEER_LOST)),
    # no torchrun report (it failed itself): error files, oldest first, a real error before a consequence.
    ([], {1: PEER_LOST, 0: "RuntimeError: injected fault on rank 0"}, (0, "RuntimeError: injected fault on rank 0")),
    ([], {}, None),
])
def test_first_failure_prefers_a_cause_over_a_consequence(exits, errors, expected):
    assert first_failure(exits, errors) == expected


def test_consequences():
    assert is_consequence(PEER_LOST) and is_consequence("killed by signal 15")
    assert is_consequence("RuntimeError: Connection reset by peer")
    # NCCL: a peer's failure reaches the others as a remote error, an aborted communicator or a watchdog timeout
    assert is_consequence("torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1970, remote "
                          "process exited or there was a network error, NCCL version 2.21.5 ncclRemoteError")
    assert is_consequence("RuntimeError: NCCL communicator was aborted on rank 1.")
    assert is_consequence("[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7, OpType=RECV)")
    assert not is_consequence("killed by signal 9") and not is_consequence("exit code 1")


def test_describe_failure_names_the_killed_rank_not_its_peer(tmp_path):
    log = tmp_path / "launcher.log"
    log.write_text(TORCHRUN_REPORT)
    (tmp_path / "errors").mkdir()
    (tmp_path / "errors" / "rank0.txt").write_text(PEER_LOST + "\n\ntraceback")
    assert describe_failure(tmp_path, log, 1) == f"worker rank 3 failed: killed by signal 9 (log: {log})"


def test_describe_failure_reads_only_this_launch(tmp_path):
    """A resumed run reuses its directory: the last launch's report and error file do not count."""
    log = tmp_path / "launcher.log"
    log.write_text(TORCHRUN_REPORT)
    (tmp_path / "errors").mkdir()
    stale = tmp_path / "errors" / "rank5.txt"
    stale.write_text("ValueError: from the last launch\n\ntraceback")
    os.utime(stale, (time.time() - 100, time.time() - 100))
    start, since = log.stat().st_size, time.time()
    with open(log, "a") as log_file:
        log_file.write("torchrun: the rendezvous timed out\n")
    assert describe_failure(tmp_path, log, 1, start, since) == f"torchrun exited with code 1 (log: {log})"
    assert describe_failure(tmp_path, log, 1) == f"worker rank 3 failed: killed by signal 9 (log: {log})"
    assert describe_failure(tmp_path, tmp_path / "none.log", 2, 0, since) == \
        f"torchrun exited with code 2 (log: {tmp_path / 'none.log'})"


@pytest.mark.parametrize("result, resumable, expected", [
    (LaunchResult(0, None, signal.SIGTERM), True,
     "interrupted by SIGTERM: the workers stopped after their step and saved a checkpoint; "
     "resume with trainer.resume_from=RUN"),
    (LaunchResult(0, None, signal.SIGINT), False, "interrupted by SIGINT: the workers stopped after their step"),
    (LaunchResult(-9, None, signal.SIGINT, "on a second signal (SIGINT)"), True,
     "interrupted by SIGINT: the workers were killed on a second signal (SIGINT); resume from the run's latest "
     "complete checkpoint, if any, with trainer.resume_from=RUN"),
    (LaunchResult(1, None, signal.SIGTERM), False,
     "interrupted by SIGTERM: the workers did not stop cleanly (torchrun exit code 1)"),
])
def test_describe_interruption(result, resumable, expected):
    assert describe_interruption(result, "RUN", resumable) == expected


def test_a_stop_saved_by_the_workers_is_clean_though_torchrun_was_signalled_too():
    """In a Slurm job step every process gets the SIGTERM: torchrun exits 1, but the workers saved."""
    line = describe_interruption(LaunchResult(1, None, signal.SIGTERM), "RUN", True, saved=True)
    assert line == ("interrupted by SIGTERM: the workers stopped after their step and saved a checkpoint; "
                    "resume with trainer.resume_from=RUN")


def test_exit_codes():
    assert LaunchResult(0, None, signal.SIGINT).exit_code == 130
    assert LaunchResult(-9, None, signal.SIGTERM, "x").exit_code == 143
    assert LaunchResult(0, None).exit_code == 0 and LaunchResult(-9, "worker rank 1 failed").exit_code == 1


def test_launch_plan_carries_the_shutdown_timeout(tmp_path):
    config = compose_config(["launcher.shutdown_timeout_s=7", "trainer.checkpoints=false"])
    plan = build_launch_plan(config, LaunchRequest("train", tmp_path), "gloo")
    assert plan.shutdown_timeout_s == 7 and plan.env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] == "7"
    assert "nothing is saved" in plan.stop_notice
    assert "save a checkpoint" in build_launch_plan(compose_config([]), LaunchRequest("train", tmp_path),
                                                    "gloo").stop_notice
    assert build_launch_plan(config, LaunchRequest("check-cluster", tmp_path), "gloo").stop_notice == \
        "the workers end now"


def test_the_resume_point_is_the_launchs_and_reaches_the_workers_as_an_argument(tmp_path):
    config = compose_config([])
    command = build_launch_plan(config, LaunchRequest("train", tmp_path, "/ckpt/step_3"), "gloo").command
    assert command[command.index("--resume-from") + 1] == "/ckpt/step_3"
    assert "--resume-from" not in build_launch_plan(config, LaunchRequest("train", tmp_path), "gloo").command
    assert config.trainer.resume_from is None  # the config is left as it was


@pytest.fixture
def signalling(monkeypatch):
    """Replace the launcher's signalling with a record of what it would have done."""
    calls = []
    monkeypatch.setattr(supervise, "terminate_workers",
                        lambda pid, already, signum: calls.append(("terminate", pid, signum)) or {pid + 1})
    monkeypatch.setattr(supervise, "kill_job", lambda pid: calls.append(("kill", pid)))
    return calls


def stopping() -> supervise.Stopping:
    """A stop not yet begun, of a plan that gives the workers 30 s."""
    return supervise.Stopping(shutdown_timeout_s=30, notice="the workers finish")


def test_first_signal_stops_workers_second_kills(signalling, capsys):
    stop = stopping()
    supervise._on_signals(stop, [], 100)
    assert signalling == [] and stop.signum is None
    supervise._on_signals(stop, [signal.SIGINT], 100)
    # the user's signal itself goes to the workers: a checkpoint then says "interrupted by SIGINT"
    assert stop.signum == signal.SIGINT and signalling == [("terminate", 100, signal.SIGINT)] and stop.signalled == {101}
    assert capsys.readouterr().err == ("stopping (SIGINT): the workers finish; waiting up to 30 s "
                                       "(Ctrl-C again to kill them now)\n")
    supervise._on_signals(stop, [signal.SIGTERM], 100)
    assert signalling[-1] == ("kill", 100) and stop.killed == "on a second signal (SIGTERM)"
    supervise._on_signals(stop, [signal.SIGTERM], 100)  # once killed, nothing more
    assert len(signalling) == 2 and stop.signum == signal.SIGINT


def test_shutdown_timeout_kills(signalling, capsys):
    stop = stopping()
    supervise._on_signals(stop, [signal.SIGTERM], 100)
    stop.deadline = time.monotonic() - 1  # 30 s later
    supervise._on_signals(stop, [], 100)
    assert signalling[-1] == ("kill", 100) and "launcher.shutdown_timeout_s" in stop.killed
    assert capsys.readouterr().err.splitlines()[-1] == \
        "the workers are still running 30 s after the stop (launcher.shutdown_timeout_s): killing them"


@pytest.mark.timeout(10)
def test_signal_inbox_records_and_restores():
    before = signal.getsignal(signal.SIGTERM)
    with SignalInbox() as inbox:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)
        assert inbox.take() == [signal.SIGTERM] and inbox.take() == []
    assert signal.getsignal(signal.SIGTERM) is before


def test_signal_before_any_worker_starts_is_one_line_and_128_plus_the_signal(capsys):
    import signal

    from ppctl.run.interrupt import BeforeStartSignals

    with pytest.raises(SystemExit) as ended:
        BeforeStartSignals()(signal.SIGINT, None)
    assert ended.value.code == 130
    assert capsys.readouterr().err == "error: interrupted by SIGINT before any worker started\n"


@pytest.mark.parametrize("backend, left", [("gloo", "destroyed"), ("nccl", "aborted")])
def test_a_failed_worker_destroys_a_gloo_group_and_aborts_an_nccl_one(monkeypatch, backend, left):
    """Under NCCL destroying the group after a failure can wait forever on work a dead peer never finishes."""
    import sys
    import types

    from ppctl.cli import worker

    calls = []
    fake = types.SimpleNamespace(is_available=lambda: True, is_initialized=lambda: True, get_backend=lambda: backend,
                                 destroy_process_group=lambda: calls.append("destroyed"),
                                 distributed_c10d=types.SimpleNamespace(_abort_process_group=lambda: calls.append("aborted")))
    monkeypatch.setitem(sys.modules, "torch.distributed", fake)
    worker._leave_process_group()
    assert calls == [left]


def test_tf32_follows_trainer_allow_tf32_and_is_off_by_default():
    import torch

    from ppctl.resolve import compose_config
    from ppctl.cli.worker import set_tf32

    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        set_tf32(compose_config(["trainer.allow_tf32=true"]).trainer.allow_tf32)
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
        set_tf32(compose_config([]).trainer.allow_tf32)
        assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before
