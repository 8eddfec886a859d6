"""What the launcher refuses before anything starts, and how it ends when its log cannot be written.

The run directory's lock (a second run into a live run's directory), each single-node run's own
rendezvous, an explicit rendezvous port already taken, an endpoint that accepts connections but is no
rendezvous, and the one line a full disk under ``launcher.log`` ends with.
"""

import errno
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from ppctl.run import rendezvous, rundir, supervise
from ppctl.checkpoint.files import commit, temporary_dir
from ppctl.config import ConfigError, LauncherConfig, parse_endpoint
from ppctl.resolve import compose_config
from ppctl.run.failures import describe_log_failure, mount_point
from ppctl.run.launch import LaunchRequest, LaunchResult, build_launch_plan
from ppctl.run.rendezvous import rendezvous_problem
from ppctl.run.rundir import RunDirBusy, RunDirLock


def dead_pid() -> int:
    """The pid of a process that has ended (and been reaped)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


# --- the run directory's lock ---------------------------------------------------------------------------

def test_a_second_run_into_a_locked_run_directory_is_refused_naming_the_live_run(tmp_path):
    with RunDirLock(tmp_path):
        assert (tmp_path / "ppctl.lock").read_text().split()[0] == str(os.getpid())
        with pytest.raises(RunDirBusy) as refused:
            RunDirLock(tmp_path).acquire()  # flock: another open file description, refused even in this process
    message = str(refused.value)
    assert message == (f"trainer.out_dir={tmp_path}: another run is using this run directory (ppctl pid "
                       f"{os.getpid()}, lock {tmp_path / 'ppctl.lock'}); wait for it to end or choose another "
                       f"trainer.out_dir")
    with RunDirLock(tmp_path):  # released: free again
        pass


def test_a_stale_lock_file_is_taken_over(tmp_path):
    stale = dead_pid()
    (tmp_path / "ppctl.lock").write_text(f"{stale} {socket.gethostname()}\n")
    with RunDirLock(tmp_path):
        assert (tmp_path / "ppctl.lock").read_text().split()[0] == str(os.getpid())


def test_without_flock_the_recorded_pid_decides(tmp_path, monkeypatch):
    """A file system without flock: a live recorded pid keeps the directory, a dead one is taken over."""
    def no_flock(fd, operation):
        if operation & rundir.fcntl.LOCK_EX:
            raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(rundir.fcntl, "flock", no_flock)
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        (tmp_path / "ppctl.lock").write_text(f"{live.pid} {socket.gethostname()}\n")
        with pytest.raises(RunDirBusy, match=f"ppctl pid {live.pid},"):
            RunDirLock(tmp_path).acquire()
    finally:
        live.kill()
        live.wait()
    with RunDirLock(tmp_path):  # its pid is dead now
        assert (tmp_path / "ppctl.lock").read_text().split()[0] == str(os.getpid())


def test_each_node_of_a_shared_run_directory_has_its_own_lock(tmp_path):
    with RunDirLock(tmp_path, node_rank=0), RunDirLock(tmp_path, node_rank=1) as node1:
        assert node1.path.name == "ppctl.node1.lock"


# --- rendezvous ------------------------------------------------------------------------------------------

def test_single_node_runs_each_host_their_own_rendezvous_on_a_free_port(tmp_path):
    """No fixed port and no shared id: two runs on one machine never meet (torch's old --standalone used
    port 29400, where a second run silently became a client of the first one's store)."""
    config = compose_config([])
    commands = [build_launch_plan(config, LaunchRequest("train", tmp_path), "gloo").command for _ in range(2)]
    for command in commands:
        assert "--standalone" not in command
        assert command[command.index("--rdzv-backend") + 1] == "c10d"
        assert command[command.index("--rdzv-endpoint") + 1] == "localhost:0"
    ids = [command[command.index("--rdzv-id") + 1] for command in commands]
    assert ids[0] != ids[1] and all(rdzv_id.startswith("ppctl-") for rdzv_id in ids)


def test_endpoint_parsing():
    assert parse_endpoint("node0:29400") == ("node0", 29400)
    assert parse_endpoint("[::1]:7") == ("::1", 7) and parse_endpoint("node0") == ("node0", 29400)
    for bad in ("node0:x", "node0:70000", ":5"):
        with pytest.raises(ConfigError, match="must be host:port"):
            parse_endpoint(bad)


@pytest.fixture
def listener():
    """A TCP server on a free port of 127.0.0.1 that accepts connections and never answers; yields its port."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    accepted = []

    def accept_forever():
        while True:
            try:
                accepted.append(server.accept()[0])
            except OSError:
                return

    threading.Thread(target=accept_forever, daemon=True).start()
    yield server.getsockname()[1]
    server.close()
    for connection in accepted:
        connection.close()


def test_an_explicit_single_node_port_already_taken_is_refused_at_once(listener):
    started = time.monotonic()
    problem = rendezvous_problem(LauncherConfig(rdzv_endpoint=f"127.0.0.1:{listener}"))
    assert problem.startswith(f"launcher.rdzv_endpoint=127.0.0.1:{listener}: port {listener} is already in use on "
                              f"this machine") and "\n" not in problem
    assert time.monotonic() - started < 1


def test_a_free_explicit_port_and_an_endpoint_not_up_yet_pass():
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    assert rendezvous_problem(LauncherConfig(rdzv_endpoint=f"127.0.0.1:{port}")) is None
    # another node's rendezvous that does not listen yet: torchrun waits for it
    assert rendezvous_problem(LauncherConfig(nnodes=2, rdzv_endpoint=f"127.0.0.1:{port}")) is None
    assert rendezvous_problem(LauncherConfig()) is None


@pytest.mark.timeout(60)
def test_an_endpoint_that_accepts_but_is_no_rendezvous_fails_within_the_timeout(listener):
    started = time.monotonic()
    problem = rendezvous_problem(LauncherConfig(nnodes=2, node_rank=1, rdzv_endpoint=f"127.0.0.1:{listener}",
                                                timeout_s=1))
    assert problem == (f"launcher.rdzv_endpoint=127.0.0.1:{listener}: something accepts connections there but does "
                       f"not answer as a torch rendezvous within launcher.timeout_s=1 s; check the host and port "
                       f"(another program may hold it)")
    assert time.monotonic() - started < 1 + 1


def test_an_endpoint_whose_host_does_not_resolve_is_refused_at_once(monkeypatch):
    def no_such_host(host, *args, **kwargs):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(rendezvous.socket, "getaddrinfo", no_such_host)
    for nnodes in (2, 1):  # one node may join a store elsewhere: its host must resolve as well
        problem = rendezvous_problem(LauncherConfig(nnodes=nnodes, rdzv_endpoint="node0.invalid:29400"))
        assert problem == ("launcher.rdzv_endpoint=node0.invalid:29400: host node0.invalid does not resolve (Name or "
                           "service not known); set the name or address of the node that hosts the rendezvous, one "
                           "that every node can resolve")


@pytest.mark.timeout(30)
def test_a_resolver_that_does_not_answer_is_given_up_after_a_short_bound(monkeypatch):
    answer = threading.Event()
    monkeypatch.setattr(rendezvous, "RESOLVE_S", 0.2)
    monkeypatch.setattr(rendezvous.socket, "getaddrinfo", lambda *args, **kwargs: answer.wait(20))
    started = time.monotonic()
    problem = rendezvous_problem(LauncherConfig(nnodes=2, rdzv_endpoint="node0:29400"))
    answer.set()
    assert problem.startswith("launcher.rdzv_endpoint=node0:29400: host node0 does not resolve (no answer from the "
                              "resolver within 0.2 s); ")
    assert time.monotonic() - started < 2


@pytest.mark.timeout(120)
def test_a_real_rendezvous_store_passes():
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    assert rendezvous_problem(LauncherConfig(nnodes=2, node_rank=1, rdzv_endpoint=f"127.0.0.1:{store.port}",
                                             timeout_s=60)) is None


# --- a log that cannot be written ----------------------------------------------------------------------

def test_log_failure_names_the_file_system_and_what_was_saved(tmp_path):
    log, error = tmp_path / "launcher.log", OSError(errno.ENOSPC, "No space left on device")
    assert describe_log_failure(log, error, tmp_path) == (
        f"cannot write {log}: No space left on device (the file system mounted at {mount_point(tmp_path)}); "
        "the workers were stopped; no checkpoint of this run was saved")
    temporary_dir(tmp_path, 4).mkdir(parents=True)
    (temporary_dir(tmp_path, 4) / ".metadata").write_bytes(b"m")
    checkpoint = commit(tmp_path, 4, {"reason": "periodic"}, keep_last=2)
    assert describe_log_failure(log, error, tmp_path).endswith(
        f"the workers were stopped; the last complete checkpoint is {checkpoint}: free space, then resume with "
        f"trainer.resume_from={tmp_path}")
    assert mount_point(tmp_path) in (mount_point(tmp_path / "x" / "y"), tmp_path)


def test_a_failure_exits_1_even_when_the_workers_stopped_cleanly():
    assert LaunchResult(0, "cannot write launcher.log: No space left on device").exit_code == 1


def test_a_log_write_error_begins_the_stop(tmp_path):
    stop = supervise.Stopping(shutdown_timeout_s=30)
    with open(tmp_path / "log", "wb", buffering=0) as log_file:
        supervise._copy_to_log(log_file, b"fine\n", stop)
        assert not stop.begun and (tmp_path / "log").read_bytes() == b"fine\n"
    with open(tmp_path / "log", "rb", buffering=0) as read_only:  # writing to it fails like a full disk would
        supervise._copy_to_log(read_only, b"lost\n", stop)
    assert stop.begun and stop.signum is None and isinstance(stop.log_error, OSError)


def test_nccl_needs_a_gpu_per_worker_on_the_node():
    from ppctl.run.launch import backend_problem

    problem = backend_problem("nccl", 4, 2)
    assert problem.startswith("launcher.backend=nccl needs a GPU per worker on the node: this node has 2 CUDA")
    assert "for 4 workers per node" in problem and "\n" not in problem
    assert backend_problem("nccl", 2, 2) is None and backend_problem("nccl", 1, 8) is None
    assert backend_problem("gloo", 4, 0) is None



def test_compiled_blocks_on_cpu_need_a_cxx_compiler(monkeypatch, tmp_path):
    """trainer.compile on CPU workers is refused in one line where inductor's C++ compiler is missing."""
    from ppctl.resolve import compose_config
    from ppctl.run.launch import compile_problem

    compiled, eager = compose_config(["trainer.compile=true"]), compose_config([])
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-c++"))
    problem = compile_problem(compiled, "gloo")
    assert problem.startswith("trainer.compile=true on CPU workers needs a C++ compiler") and "\n" not in problem
    assert "no-such-c++" in problem
    assert compile_problem(eager, "gloo") is None and compile_problem(compiled, "nccl") is None
    monkeypatch.setenv("CXX", "sh")  # any program on the PATH stands for one here
    assert compile_problem(compiled, "gloo") is None


def test_no_gpu_device_node_means_no_gpus_without_importing_torch(monkeypatch):
    """The launch asks how many GPUs the node has; where no GPU driver's device node exists the answer is 0 at
    once (importing torch to ask costs seconds per launch); where one does, torch counts."""
    import builtins
    import os

    from ppctl.run import launch

    real_import = builtins.__import__

    def no_torch(name, *args, **kwargs):
        assert name != "torch", "local_gpus imported torch"
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(os.path, "exists", lambda path: False)
    monkeypatch.setattr(builtins, "__import__", no_torch)
    assert launch.local_gpus() == 0
