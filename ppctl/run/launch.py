"""Start workers with torchrun, watch them, stop them on a signal, and turn a failure into one line.

``ppctl train`` and ``ppctl check-cluster`` both come here: the run directory holds
the resolved ``config.yaml``; every worker (``python -m ppctl.run.worker``) reads it.

Stopping: torchrun runs in its own session, so a terminal's Ctrl-C reaches only ``ppctl``.
On SIGINT or SIGTERM ``ppctl`` sends that same signal to the workers themselves (torchrun,
left alone, sees them end normally; signalled, it would treat the job as failed and kill them
after its own shutdown timeout; the workers record which signal stopped them), waits up to
``launcher.shutdown_timeout_s`` for torchrun to end, then kills whatever is left; a second
signal kills at once. If ``ppctl`` itself is killed, the parent-death signal sends torchrun
SIGTERM, and torchrun stops its workers (giving them ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``, set to the same timeout).

Failures: a worker that raises writes ``errors/rank<N>.txt``; torchrun stops the others and
logs its failure report; this module names the rank that failed first, and why, in one line.
A ``launcher.log`` that cannot be written (a full disk) stops the job like a signal would.

Before anything starts: ``RunDirLock`` keeps a second run out of a live run's directory,
``reuse_problem`` keeps a fresh run from replacing the checkpoints an earlier run left there, and
``rendezvous_problem`` refuses an explicit rendezvous endpoint that cannot work (its port taken
on this machine, or something there that is no rendezvous). A single-node run without an
endpoint hosts its own rendezvous on a port the OS picks, under an id of its own.
Nothing here imports torch at module level, so the CLI starts quickly.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import os
import re
import select
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from ppctl.checkpoint.files import (CheckpointError, checkpoints_dir, latest_checkpoint, list_checkpoints,
                                    read_index)
from ppctl.config import LauncherConfig, PpctlConfig, nproc_per_node, parse_endpoint
from ppctl.run.interrupt import STOP_SIGNALS, ParentDeathSignal

WORKER_MODULE = "ppctl.run.worker"
DEFAULT_RDZV_ID = "ppctl"  # the same on every node (a run directory's timestamp would differ between nodes)
# A single-node run's own rendezvous: port 0 lets the OS pick a free one, so runs on one machine never meet.
LOCAL_RDZV_ENDPOINT = "localhost:0"
POLL_S = 0.1  # how often the launcher looks at torchrun and at the signals it received
DRAIN_S = 5.0  # how long the launcher still copies torchrun's stderr after torchrun ended
CONNECT_S = 5.0  # the longest wait for a TCP connection to an explicit rendezvous endpoint


@dataclass(frozen=True)
class LaunchPlan:
    """What will be started (the torchrun command, its environment additions, the run directory) and how it stops."""

    command: list[str]
    env: dict[str, str]
    run_dir: Path
    shutdown_timeout_s: float = 60.0
    stop_notice: str = "the workers finish their step"

    def printable(self) -> str:
        """The command as one shell line, with its environment settings in front."""
        env = " ".join(f"{key}={shlex.quote(value)}" for key, value in sorted(self.env.items()))
        return f"{env} {shlex.join(self.command)}".strip()


def default_run_dir(base: str = "runs") -> Path:
    """``runs/<timestamp>``, unique to the microsecond."""
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S-%f")
    return Path(base) / stamp


def resolve_backend(requested: str, local_workers: int) -> str:
    """``auto`` -> NCCL when CUDA has a GPU for every local worker, else gloo."""
    if requested != "auto":
        return requested
    return "nccl" if local_gpus() >= local_workers else "gloo"


# Device nodes of GPU drivers torch can use (NVIDIA's, AMD's for ROCm, WSL's). Where none exists there is no GPU
# to count, and asking torch would cost its import (seconds) on every launch.
GPU_DEVICE_NODES = ("/dev/nvidiactl", "/dev/nvidia0", "/dev/kfd", "/dev/dxg")


def local_gpus() -> int:
    """The CUDA devices this node shows (0 without CUDA, at once where no GPU driver's device node exists)."""
    if not any(os.path.exists(node) for node in GPU_DEVICE_NODES):
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def backend_problem(backend: str, local_workers: int, gpus: int) -> str | None:
    """Why ``backend`` cannot run ``local_workers`` workers on a node with ``gpus`` CUDA devices, or None.

    NCCL gives each worker its own GPU (``LOCAL_RANK``); with fewer GPUs a worker would fail
    later with "invalid device ordinal", so the job is refused before it starts.
    """
    if backend == "nccl" and gpus < local_workers:
        return (f"launcher.backend=nccl needs a GPU per worker on the node: this node has {gpus} CUDA device(s) "
                f"for {local_workers} workers per node (use launcher.backend=gloo or auto, or fewer workers per node)")
    return None


def threads_per_worker(config: PpctlConfig) -> int:
    """Intra-op threads per worker so that the local workers do not oversubscribe the cores."""
    if config.launcher.threads_per_worker:
        return config.launcher.threads_per_worker
    return max(1, usable_cores() // nproc_per_node(config))


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity, e.g. under ``taskset``), else all of them."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):  # no affinity off Linux
        return os.cpu_count() or 1


def describe_workers(config: PpctlConfig) -> str:
    """``2 workers x 1 thread``: the workers this node starts and the intra-op threads each one uses."""
    workers, threads = nproc_per_node(config), threads_per_worker(config)
    return f"{workers} worker{'s' if workers != 1 else ''} x {threads} thread{'s' if threads != 1 else ''}"


def build_launch_plan(config: PpctlConfig, run_dir: Path, task: str, backend: str) -> LaunchPlan:
    """The torchrun command for ``task`` (``train`` or ``check-cluster``): standalone or c10d rendezvous."""
    launcher = config.launcher
    command = [sys.executable, "-m", "torch.distributed.run",
               "--nnodes", str(launcher.nnodes), "--nproc-per-node", str(nproc_per_node(config)),
               "--max-restarts", str(launcher.max_restarts), "--monitor-interval", "0.2"]
    if launcher.nnodes == 1 and not launcher.rdzv_endpoint:
        # What --standalone means in recent torch, spelled out: older releases put every standalone run
        # on port 29400, where a second run silently joins the first one's store and dies with it.
        command += ["--rdzv-backend", "c10d", "--rdzv-endpoint", LOCAL_RDZV_ENDPOINT,
                    "--rdzv-id", f"ppctl-{uuid.uuid4().hex[:12]}"]
    else:
        command += ["--rdzv-backend", "c10d", "--rdzv-endpoint", launcher.rdzv_endpoint,
                    "--rdzv-id", launcher.rdzv_id or DEFAULT_RDZV_ID, "--node-rank", str(launcher.node_rank)]
    command += ["-m", WORKER_MODULE, "--run-dir", str(run_dir), "--task", task, "--backend", backend]
    threads = str(threads_per_worker(config))
    # When torchrun itself must stop the workers (ppctl was killed), it gives them as long as ppctl would.
    env = {"OMP_NUM_THREADS": threads, "PPCTL_THREADS": threads,
           "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": str(launcher.shutdown_timeout_s)}
    if task != "train":
        notice = "the workers end now"
    elif config.trainer.checkpoints:
        notice = "the workers finish their step and save a checkpoint"
    else:
        notice = "the workers finish their step (trainer.checkpoints=false: nothing is saved)"
    return LaunchPlan(command=command, env=env, run_dir=run_dir,
                      shutdown_timeout_s=launcher.shutdown_timeout_s, stop_notice=notice)


@dataclass(frozen=True)
class LaunchResult:
    """How a launch ended: torchrun's exit code; on failure, one line naming the failing rank.

    ``interrupted`` is the signal ``ppctl`` got (it then forwarded a stop to the workers) and
    ``killed`` why the job had to be killed after that (None when the workers stopped by themselves).
    """

    returncode: int
    failure: str | None
    interrupted: int | None = None
    killed: str | None = None

    @property
    def exit_code(self) -> int:
        """What ``ppctl`` exits with: 128 + the signal when interrupted (130 SIGINT, 143 SIGTERM), else 0 or 1."""
        if self.interrupted is not None:
            return 128 + self.interrupted
        return 0 if self.returncode == 0 and self.failure is None else 1


def run_plan(plan: LaunchPlan) -> LaunchResult:
    """Run torchrun; stream workers' stdout, keep stderr in ``launcher.log``; stop on a signal; summarise a failure."""
    log_path = plan.run_dir / "launcher.log"
    env = {**os.environ, **plan.env, "PYTHONUNBUFFERED": "1"}
    started = time.time()
    # Unbuffered: a write that fails (a full disk) leaves nothing behind that a later flush would retry.
    with open(log_path, "ab", buffering=0) as log_file, SignalInbox() as inbox:
        log_start = log_file.tell()
        process = subprocess.Popen(plan.command, env=env, stderr=subprocess.PIPE, start_new_session=True,
                                   preexec_fn=_die_with(os.getpid()))
        stop = _supervise(process, inbox, plan, log_file)
    if stop.log_error is not None:
        return LaunchResult(process.returncode, describe_log_failure(log_path, stop.log_error, plan.run_dir),
                            killed=stop.killed)
    if stop.signum is not None:
        return LaunchResult(process.returncode, None, interrupted=stop.signum, killed=stop.killed)
    if process.returncode == 0:
        return LaunchResult(0, None)
    return LaunchResult(process.returncode,
                        describe_failure(plan.run_dir, log_path, process.returncode, log_start, started))


def _die_with(parent_pid: int):
    """Popen's ``preexec_fn`` for torchrun: SIGTERM it when ``ppctl`` dies (and do not start if that happened)."""
    death_signal = ParentDeathSignal(signal.SIGTERM)

    def arm() -> None:
        if not death_signal.arm(parent_pid):
            os._exit(1)

    return arm


class SignalInbox:
    """While the launcher runs torchrun, SIGINT and SIGTERM are only recorded; ``_supervise`` acts on them."""

    def __init__(self) -> None:
        self.received: list[int] = []
        self._previous: dict[int, object] = {}

    def __enter__(self) -> SignalInbox:
        if threading.current_thread() is threading.main_thread():  # handlers can only be set from there
            for signum in STOP_SIGNALS:
                self._previous[signum] = signal.signal(signum, lambda signum, frame: self.received.append(signum))
        return self

    def __exit__(self, *exc_info) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def take(self) -> list[int]:
        """The signals received since the last call."""
        taken, self.received[:] = list(self.received), []
        return taken


@dataclass
class _Stopping:
    """The launcher's stop in progress: why it began (the first signal, or the log that cannot be written), when
    to give up waiting (``deadline``, None until a stop began), why the job was killed."""

    signum: int | None = None
    deadline: float | None = None
    killed: str | None = None
    signalled: set[int] = field(default_factory=set)  # worker pids already sent SIGTERM
    next_scan: float = 0.0  # when to look for workers again
    log_error: OSError | None = None

    @property
    def begun(self) -> bool:
        """Whether a stop is under way."""
        return self.deadline is not None


def _supervise(process: subprocess.Popen, inbox: SignalInbox, plan: LaunchPlan, log_file) -> _Stopping:
    """Copy torchrun's stderr to the log until it ends, acting on signals every ``POLL_S``.

    All in this one thread: the parent-death signal is sent each time a thread of the parent that
    holds the child ends, so a second thread here would give torchrun two SIGTERMs when ``ppctl``
    is killed, and torchrun takes a second one as "kill the workers now".
    """
    stop = _Stopping()
    stderr_fd = process.stderr.fileno()
    stderr_open, drain_until = True, None
    while True:
        if stderr_open and select.select([stderr_fd], [], [], POLL_S)[0]:
            chunk = os.read(stderr_fd, 65536)
            _copy_to_log(log_file, chunk, stop, plan)
            stderr_open = bool(chunk)
        elif not stderr_open:
            time.sleep(POLL_S)
        if process.poll() is None:
            _on_signals(stop, inbox.take(), process.pid, plan)
        elif not stderr_open or (drain_until is not None and time.monotonic() > drain_until):
            break
        elif drain_until is None:  # copy what torchrun left in the pipe; a stray holder may keep it open
            drain_until = time.monotonic() + DRAIN_S
    process.stderr.close()
    return stop


def _copy_to_log(log_file, chunk: bytes, stop: _Stopping, plan: LaunchPlan) -> None:
    """Append torchrun's stderr to the log; once that fails, stop the job and drop the rest (still read, so that
    torchrun never blocks on a full pipe)."""
    if stop.log_error is not None:
        return
    try:
        _append_log(log_file, chunk)
    except OSError as error:
        stop.log_error = error
        if not stop.begun:
            stop.deadline = time.monotonic() + plan.shutdown_timeout_s


def _append_log(log_file, chunk: bytes) -> None:
    """Write all of ``chunk`` to the (unbuffered) log file."""
    view = memoryview(chunk)
    while view:
        view = view[log_file.write(view):]


def _on_signals(stop: _Stopping, received: list[int], torchrun_pid: int, plan: LaunchPlan) -> None:
    """First signal: SIGTERM the workers (again for any that start later); a second one, or the deadline: kill."""
    for signum in received:
        if not stop.begun:
            stop.signum, stop.deadline = signum, time.monotonic() + plan.shutdown_timeout_s
            _say(f"stopping ({signal.Signals(signum).name}): {plan.stop_notice}; waiting up to "
                 f"{plan.shutdown_timeout_s:g} s (Ctrl-C again to kill them now)")
        elif stop.killed is None:
            stop.killed = f"on a second signal ({signal.Signals(signum).name})"
            kill_job(torchrun_pid)
    if not stop.begun or stop.killed is not None:
        return
    if time.monotonic() > stop.deadline:
        stop.killed = f"still running {plan.shutdown_timeout_s:g} s after the stop (launcher.shutdown_timeout_s)"
        if stop.log_error is None:  # a log failure ends with its own single line
            _say(f"the workers are {stop.killed}: killing them")
        kill_job(torchrun_pid)
    elif time.monotonic() >= stop.next_scan:
        # The user's signal itself, so that the checkpoint says which one stopped the run (a log that cannot be
        # written stops the job as SIGTERM would).
        stop.signalled |= terminate_workers(torchrun_pid, stop.signalled, stop.signum or signal.SIGTERM)
        stop.next_scan = time.monotonic() + POLL_S


def _say(line: str) -> None:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def read_parent_table(proc: Path = Path("/proc")) -> dict[int, int] | None:
    """pid -> parent pid of every process, from ``/proc/<pid>/stat``; None where there is no ``/proc``."""
    if not (proc / "self" / "stat").exists():
        return None
    parents = {}
    for stat in proc.glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # the process ended while we looked
            continue
        parents[int(stat.parent.name)] = parent_of_stat(text)
    return parents


def parent_of_stat(stat_line: str) -> int:
    """The parent pid in a ``/proc/<pid>/stat`` line: ``pid (comm) state ppid ...``; comm may hold spaces and ')'."""
    return int(stat_line[stat_line.rindex(")") + 1:].split()[1])


def children(parents: dict[int, int], pid: int) -> list[int]:
    """The pids whose parent is ``pid``, sorted."""
    return sorted(child for child, parent in parents.items() if parent == pid)


def descendants(parents: dict[int, int], pid: int) -> list[int]:
    """Every pid below ``pid`` in the process tree (children first, then theirs), ``pid`` itself excluded."""
    found, frontier = [], [pid]
    while frontier:
        frontier = [child for parent in frontier for child in children(parents, parent)]
        found += frontier
    return found


def terminate_workers(torchrun_pid: int, already: set[int], signum: int = signal.SIGTERM) -> set[int]:
    """Send ``signum`` (SIGTERM or SIGINT: a worker stops on either after its step) to torchrun's workers (its
    children) not in ``already``; return the pids signalled.

    Only the workers: their own children (if any) stop with them. Without ``/proc`` torchrun itself
    gets a SIGTERM and stops its workers its own way (it takes SIGINT as a failure).
    """
    parents = read_parent_table()
    targets = [torchrun_pid] if parents is None else children(parents, torchrun_pid)
    if parents is None:
        signum = signal.SIGTERM
    signalled = set()
    for pid in targets:
        if pid not in already:
            _send(pid, signum)
            signalled.add(pid)
    return signalled


def kill_job(torchrun_pid: int) -> None:
    """SIGKILL torchrun's descendants (each worker runs in a session of its own) and torchrun's process group."""
    parents = read_parent_table() or {}
    for pid in descendants(parents, torchrun_pid):
        _send(pid, signal.SIGKILL)
    try:
        os.killpg(torchrun_pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        _send(torchrun_pid, signal.SIGKILL)


def _send(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


def describe_interruption(result: LaunchResult, run_dir: Path, resumable: bool, saved: bool = False) -> str:
    """One line: the job was interrupted, whether the workers stopped by themselves, and how to resume.

    ``saved``: the workers committed a checkpoint for this stop (``saved_on_stop``), which tells a clean stop
    also when torchrun, signalled itself (every process of a Slurm job step is), exited non-zero."""
    line = f"interrupted by {signal.Signals(result.interrupted).name}"
    if result.killed is not None:
        line += f": the workers were killed {result.killed}"
        stopped_cleanly = False
    elif result.returncode != 0 and not saved:
        line += f": the workers did not stop cleanly (torchrun exit code {result.returncode})"
        stopped_cleanly = False
    else:
        line += ": the workers stopped after their step"
        stopped_cleanly = True
    if not resumable:
        return line
    if stopped_cleanly:
        return f"{line} and saved a checkpoint; resume with trainer.resume_from={run_dir}"
    return f"{line}; resume from the run's latest complete checkpoint, if any, with trainer.resume_from={run_dir}"


def saved_on_stop(run_dir: Path, signum: int, since: float) -> bool:
    """Whether the run's latest checkpoint was saved for a stop by ``signum`` at or after ``since`` (epoch s)."""
    try:
        latest = latest_checkpoint(run_dir)
        if latest is None or latest.stat().st_mtime < since:
            return False
        return read_index(latest).get("reason") == f"interrupted by {signal.Signals(signum).name}"
    except (CheckpointError, OSError):
        return False


def describe_log_failure(log_path: Path, error: OSError, run_dir: Path) -> str:
    """One line: the log could not be written (why, and on which file system), the job was stopped, and what of
    the run is saved (its last complete checkpoint, if any)."""
    try:
        checkpoint = latest_checkpoint(run_dir)
    except CheckpointError:
        checkpoint = None
    if checkpoint is not None and checkpoint.is_dir():
        saved = (f"the last complete checkpoint is {checkpoint}: free space, then resume with "
                 f"trainer.resume_from={run_dir}")
    else:
        saved = "no checkpoint of this run was saved"
    reason = error.strerror or str(error)
    return (f"cannot write {log_path}: {reason} (the file system mounted at {mount_point(run_dir)}); "
            f"the workers were stopped; {saved}")


def mount_point(path: Path) -> Path:
    """The mount point of the file system that holds ``path``."""
    found = Path(os.path.abspath(path))
    while not os.path.ismount(found) and found != found.parent:
        found = found.parent
    return found


# --- a run directory that holds an earlier run's checkpoints --------------------------------------------------

def committed_steps(run_dir: Path) -> list[int]:
    """The steps of the checkpoints a run directory holds, oldest first: every committed ``step_<N>`` (complete or
    damaged; a partial one that was never committed is no checkpoint)."""
    return [info.step for info in list_checkpoints(run_dir) if not info.path.name.endswith(".partial")]


def resumes_its_own(run_dir: Path, resume_from: str | None) -> bool:
    """Whether ``resume_from`` (a resolved checkpoint directory) is one of ``run_dir``'s own checkpoints."""
    if not resume_from:
        return False
    return Path(resume_from).resolve().parent == checkpoints_dir(run_dir).resolve()


def reuse_problem(run_dir: Path, resume_from: str | None, overwrite: bool) -> str | None:
    """Why a training run may not go into ``run_dir`` (one line), or None.

    A run that does not resume from ``run_dir``'s own checkpoints would write its checkpoints and ``latest``
    over theirs, so it needs ``trainer.overwrite=true``; a run that does resume from them must not have it
    (that would delete what it resumes from). Asked before anything starts or changes in the directory.
    """
    steps = committed_steps(run_dir)
    if not steps:
        return None
    if resumes_its_own(run_dir, resume_from):
        if not overwrite:
            return None
        return (f"trainer.overwrite=true would delete the checkpoints of trainer.out_dir={run_dir}, and this run "
                f"resumes from one of them (trainer.resume_from={resume_from}); drop trainer.overwrite to continue "
                f"that run")
    if overwrite:
        return None
    start = f"resumes from {resume_from}" if resume_from else "starts from step 0"
    return (f"trainer.out_dir={run_dir} already holds the checkpoints of a run (newest: step {steps[-1]}); this run "
            f"{start} and would replace them: continue that run with trainer.resume_from={run_dir}, choose another "
            f"trainer.out_dir, or set trainer.overwrite=true to delete them and start over")


def clear_earlier_run(run_dir: Path) -> str | None:
    """``trainer.overwrite=true``: delete the checkpoints an earlier run left in ``run_dir``, and its TensorBoard logs
    (a new run's curves would otherwise be drawn over the old ones). Returns the line that says so, None when there
    was nothing to delete; OSError when something cannot be deleted."""
    steps = committed_steps(run_dir)
    if not steps:
        return None
    for folder in (checkpoints_dir(run_dir), run_dir / "tensorboard"):
        if folder.exists():
            shutil.rmtree(folder)
    return (f"trainer.overwrite=true: deleted the earlier run's checkpoints (newest: step {steps[-1]}) and "
            f"TensorBoard logs in {run_dir}")


# --- the run directory's lock -----------------------------------------------------------------------------

class RunDirBusy(RuntimeError):
    """Another live run holds the run directory; the message is one line naming it."""


def lock_name(node_rank: int) -> str:
    """The lock file of a node's launcher: ``ppctl.lock`` (node 0), ``ppctl.node<k>.lock`` (the nodes of a
    multi-node job may share one run directory)."""
    return "ppctl.lock" if node_rank == 0 else f"ppctl.node{node_rank}.lock"


class RunDirLock:
    """An exclusive OS lock (``flock``) on ``<run dir>/ppctl.lock``, held by the launcher for the run's life.

    The file records the holder's pid and host. The kernel drops the lock when its process ends, so a
    lock file left by a dead run is simply taken over. On a file system without ``flock`` the recorded
    pid decides: a live one on this host keeps the directory, a dead one is taken over.
    """

    def __init__(self, run_dir: Path, node_rank: int = 0) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / lock_name(node_rank)
        self._fd: int | None = None

    def acquire(self) -> RunDirLock:
        """Take the lock or raise ``RunDirBusy``; OSError if the file cannot be written."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            holder = self._lock(fd)
            if holder is not None:
                raise RunDirBusy(self._busy_message(holder))
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        return self

    def _lock(self, fd: int) -> tuple[int, str] | None:
        """Lock ``fd``; return the live holder (pid, host) when another run has it, else None."""
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return None
        except BlockingIOError:
            return read_lock_holder(fd) or (0, "")
        except OSError as error:
            if error.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL):
                raise
        holder = read_lock_holder(fd)  # no flock here: the recorded pid decides
        return holder if holder is not None and holder_alive(*holder) else None

    def _busy_message(self, holder: tuple[int, str]) -> str:
        pid, host = holder
        where = f" on {host}" if host and host != socket.gethostname() else ""
        who = f"ppctl pid {pid}{where}" if pid else "a ppctl process"
        return (f"trainer.out_dir={self.run_dir}: another run is using this run directory ({who}, lock "
                f"{self.path}); wait for it to end or choose another trainer.out_dir")

    def release(self) -> None:
        """Let the lock go (the file stays: removing it could let two runs lock two different files)."""
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> RunDirLock:
        return self.acquire()

    def __exit__(self, *exc_info) -> None:
        self.release()


def read_lock_holder(fd: int) -> tuple[int, str] | None:
    """The (pid, host) a lock file records, or None when it records none."""
    fields = os.pread(fd, 4096, 0).decode(errors="replace").split()
    if not fields or not fields[0].isdigit():
        return None
    return int(fields[0]), fields[1] if len(fields) > 1 else ""


def holder_alive(pid: int, host: str) -> bool:
    """Whether the process ``pid`` runs (a holder on another host counts as alive: it cannot be asked)."""
    if host and host != socket.gethostname():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return pid != os.getpid()


# --- an explicit rendezvous endpoint --------------------------------------------------------------------

# Run in a child process: a TCP store client waits for its handshake without a time limit, so the
# child is what the time limit ends.
_STORE_PROBE = ("import datetime, sys\n"
                "from torch.distributed import TCPStore\n"
                "TCPStore(sys.argv[1], int(sys.argv[2]), is_master=False, "
                "timeout=datetime.timedelta(seconds=float(sys.argv[3])))\n")


def rendezvous_problem(launcher: LauncherConfig) -> str | None:
    """Why ``launcher.rdzv_endpoint`` cannot work, in one line (None when it may, or when none is set).

    A single-node run hosts the rendezvous itself, so its port must be free on this machine
    (torchrun would otherwise join whatever store holds it). Any other run connects there: a
    program that accepts the connection but never answers as a rendezvous would hang torchrun,
    so it must answer as one within ``launcher.timeout_s``. Nothing listening yet is fine: the
    other nodes may start later, and torchrun waits for them.
    """
    endpoint = launcher.rdzv_endpoint
    if not endpoint:
        return None
    host, port = parse_endpoint(endpoint)
    setting = f"launcher.rdzv_endpoint={endpoint}"
    if launcher.nnodes == 1 and is_local_host(host):
        if port != 0 and port_in_use(port):
            return (f"{setting}: port {port} is already in use on this machine (another run's rendezvous, or "
                    f"another program); a single-node run hosts its rendezvous there: choose a free port, or leave "
                    f"launcher.rdzv_endpoint unset (each run then gets a free port of its own)")
        return None
    deadline = time.monotonic() + launcher.timeout_s
    if port == 0 or not accepts_connections(host, port, min(CONNECT_S, launcher.timeout_s)):
        return None
    if answers_as_store(host, port, max(0.1, deadline - time.monotonic())):
        return None
    return (f"{setting}: something accepts connections there but does not answer as a torch rendezvous within "
            f"launcher.timeout_s={launcher.timeout_s} s; check the host and port (another program may hold it)")


def is_local_host(host: str) -> bool:
    """Whether ``host`` names an address of this machine (one a socket can be bound to here)."""
    try:
        addresses = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    for family, kind, _, _, address in addresses:
        with socket.socket(family, kind) as probe:
            try:
                probe.bind((address[0], 0, *address[2:]))
                return True
            except OSError:
                continue
    return False


def port_in_use(port: int) -> bool:
    """Whether a TCP port is taken on this machine: bound on every address, as torch's store server binds it."""
    for family, wildcard in ((socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")):
        try:
            probe = socket.socket(family, socket.SOCK_STREAM)
        except OSError:  # no IPv6 here: the IPv4 wildcard decides
            continue
        with probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the store: TIME_WAIT is no owner
            if family == socket.AF_INET6:
                probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            try:
                probe.bind((wildcard, port))
                return False
            except OSError as error:
                if error.errno == errno.EADDRINUSE:
                    return True
    return False


def accepts_connections(host: str, port: int, timeout_s: float) -> bool:
    """Whether something at ``host:port`` accepts a TCP connection within ``timeout_s``."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def answers_as_store(host: str, port: int, timeout_s: float) -> bool:
    """Whether ``host:port`` answers a torch TCP store client's handshake within ``timeout_s`` (a child process)."""
    command = [sys.executable, "-c", _STORE_PROBE, host, str(port), f"{timeout_s:g}"]
    try:
        probe = subprocess.run(command, capture_output=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return False
    return probe.returncode == 0


# A worker whose error says a peer went away failed because another one did: gloo's socket errors, and NCCL's
# remote error, the abort of a communicator a failed peer shared, and its watchdog's timeout of a collective that a
# dead or stuck peer never joined.
PEER_LOST_MARKERS = ("closed by peer", "reset by peer", "Broken pipe", "remote process exited", "ncclRemoteError",
                     "communicator was aborted", "Watchdog caught collective operation timeout")


@dataclass(frozen=True)
class WorkerExit:
    """One failed worker as torchrun's failure report lists it."""

    rank: int
    exitcode: int


_FAILURE_RECORD = re.compile(r"rank\s*:\s*(\d+)[^\n]*\n\s*exitcode\s*:\s*(-?\d+)")


def torchrun_failures(log_text: str) -> list[WorkerExit]:
    """The failed workers in torchrun's last failure report: its root cause first, then the others."""
    start = log_text.rfind("Failures:")
    if start < 0:
        return []
    root = log_text.find("Root Cause", start)
    end = root if root >= 0 else len(log_text)
    others = [WorkerExit(int(m.group(1)), int(m.group(2))) for m in _FAILURE_RECORD.finditer(log_text, start, end)]
    first = _FAILURE_RECORD.search(log_text, root) if root >= 0 else None
    return ([WorkerExit(int(first.group(1)), int(first.group(2)))] if first else []) + others


def exit_cause(exitcode: int) -> str:
    """``killed by signal 9`` or ``exit code 1``."""
    return f"killed by signal {-exitcode}" if exitcode < 0 else f"exit code {exitcode}"


def is_consequence(cause: str) -> bool:
    """Whether a worker's end follows from another's: stopped by torchrun's SIGTERM, or it lost a peer."""
    return cause == exit_cause(-signal.SIGTERM) or any(marker in cause for marker in PEER_LOST_MARKERS)


def first_failure(exits: list[WorkerExit], errors: dict[int, str]) -> tuple[int, str] | None:
    """The rank that failed first and its cause, or None when nothing names one.

    ``exits``: torchrun's failed workers, its root cause first; ``errors``: rank -> the first line of
    its error file, oldest first. torchrun's root cause is the failure it saw first, to the second;
    a peer that lost its connection to a killed rank ends within milliseconds and may come first, so
    a rank whose end is a consequence of another's (``is_consequence``) is named only if all are.
    """
    candidates = [(worker.rank, errors.get(worker.rank) or exit_cause(worker.exitcode)) for worker in exits]
    listed = {worker.rank for worker in exits}
    candidates += [(rank, line) for rank, line in errors.items() if rank not in listed]
    if not candidates:
        return None
    primary = [candidate for candidate in candidates if not is_consequence(candidate[1])]
    return (primary or candidates)[0]


def describe_failure(run_dir: Path, log_path: Path, returncode: int, log_start: int = 0,
                     since: float = 0.0) -> str:
    """One line: the first rank that failed and why (its exception, or its exit signal).

    Only this launch counts: the log from byte ``log_start`` and error files written after ``since``
    (a resumed run reuses its run directory).
    """
    log_text = ""
    if log_path.exists():
        with open(log_path, "rb") as log_file:
            log_file.seek(log_start)
            log_text = log_file.read().decode(errors="replace")
    found = first_failure(torchrun_failures(log_text), error_lines(run_dir, since))
    if found is None:
        return f"torchrun exited with code {returncode} (log: {log_path})"
    rank, cause = found
    return f"worker rank {rank} failed: {cause} (log: {log_path})"


def error_lines(run_dir: Path, since: float = 0.0) -> dict[int, str]:
    """rank -> the first line of its ``errors/rank<N>.txt`` (written after ``since``, to the second), oldest first."""
    files = []
    for path in (run_dir / "errors").glob("rank*.txt"):
        try:
            modified, lines = path.stat().st_mtime, path.read_text(errors="replace").strip().splitlines()
        except OSError:
            continue
        if modified >= since - 1.0 and lines and path.stem.removeprefix("rank").isdigit():
            files.append((modified, int(path.stem.removeprefix("rank")), lines[0]))
    return {rank: line for _, rank, line in sorted(files)}
