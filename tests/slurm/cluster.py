"""A private Slurm cluster on this machine for tests: one slurmctld and one slurmd on localhost.

Everything the daemons write (slurm.conf, state, spool, pid and log files) lives under one directory,
and their ports are picked free at start, so two test sessions on one machine never share anything.
The daemons run in the foreground, each under a small supervisor process (this file run as a script,
see `supervise`) that keeps every process the daemon starts below it: `stop()` cancels the jobs and
ends the daemons together with whatever they left running (slurmstepd, job processes), and so does the
supervisor by itself when the test process dies, even by SIGKILL.
Needs Debian's Slurm 22.05 (`make slurm-setup`) and root: slurmd runs jobs as their user.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from string import Template

REQUIRED_COMMANDS = ("slurmctld", "slurmd", "sbatch")

# Job states after which a job never runs again, as `scontrol show job` spells them.
FINAL_STATES = frozenset(
    {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}
)

# Variables that would point the clients at another job or cluster (set when the tests run inside Slurm).
_CLIENT_ENV_PREFIXES = ("SLURM_", "SBATCH_", "SALLOC_", "SRUN_", "SQUEUE_", "SACCT_", "SINFO_", "SCANCEL_")

_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
_PR_SET_CHILD_SUBREAPER = 36

# The node declares at least this many CPUs, whatever the machine has: each test job asks for one, and the
# session's three jobs then run side by side instead of the third waiting for a CPU (and again after each
# requeue); they are small, and config_overrides lets the node claim more than it has.
NODE_CPUS = 4

# Why these settings:
# - auth/none and cred/none still ship with Slurm 22.05 (auth_none.so, cred_none.so), so no munged is
#   needed: the daemons trust the uid a client claims; fine for a root-only cluster on 127.0.0.1.
# - AuthInfo=cred_expire also sets how long a requeued job waits before it may start again: its begin
#   time becomes now + cred_expire + 1 (batch_requeue_fini in slurmctld/job_mgr.c). Default 120 s, minimum 5 s.
# - sched_interval=1: the main scheduler runs every second (default 60 s), so it sees that begin time pass
#   at once; batch_sched_delay=0 schedules a new batch job at once instead of up to 3 s later. The main
#   scheduler reads these only on its first run, which comes 3 s after startup; sched/backfill with
#   bf_interval=1 (read at once) starts the session's first job within a second instead.
# - MinJobAge: without accounting, slurmctld's record of a finished job is the only place its final state
#   can be read (scontrol show job, squeue --states=all), so it is kept for the default 300 s.
# - SlurmdParameters=config_overrides: the node is never drained for differing from the detected hardware.
CONF_TEMPLATE = Template(
    """\
# Written by tests/slurm/cluster.py for one test session.
ClusterName=ppctltest
SlurmctldHost=${node}(127.0.0.1)
SlurmctldPort=${ctld_port}
SlurmdPort=${slurmd_port}
SlurmUser=root
SlurmdUser=root

AuthType=auth/none
CredType=cred/none
AuthInfo=cred_expire=${cred_expire}

StateSaveLocation=${root}/state
SlurmdSpoolDir=${root}/spool
SlurmctldPidFile=${root}/slurmctld.pid
SlurmdPidFile=${root}/slurmd.pid
SlurmctldLogFile=${root}/log/slurmctld.log
SlurmdLogFile=${root}/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
PlugStackConfig=${root}/plugstack.conf
MailProg=/bin/true

ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
PropagateResourceLimits=NONE
SlurmdParameters=config_overrides

SchedulerType=sched/backfill
SchedulerParameters=sched_interval=1,batch_sched_delay=0,bf_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU

ReturnToService=2
JobRequeue=1
MinJobAge=300
KillWait=${kill_wait}
MessageTimeout=5
SlurmdTimeout=30
InactiveLimit=0
Waittime=0

NodeName=${node} NodeHostname=${node} NodeAddr=127.0.0.1 CPUs=${cpus} RealMemory=${memory_mb} State=UNKNOWN
PartitionName=debug Nodes=${node} Default=YES MaxTime=INFINITE State=UP
${extra}"""
)


class SlurmError(RuntimeError):
    """The local cluster did not start, or a client command failed."""


def missing_commands() -> list[str]:
    """The Slurm commands the cluster needs that are not on PATH."""
    return [name for name in REQUIRED_COMMANDS if shutil.which(name) is None]


def free_ports(count: int) -> list[int]:
    """`count` distinct TCP ports free now: each bound to port 0 and read back (held together, so distinct)."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("", 0))  # the daemons listen on every address, so test the same
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def machine_memory_mb() -> int:
    """Total memory of this machine in MiB (MemTotal of /proc/meminfo)."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) // 1024
    raise SlurmError("no MemTotal in /proc/meminfo")


def _prctl(option: int, arg: int) -> None:
    """Linux prctl(2) on the calling process."""
    if ctypes.CDLL(None, use_errno=True).prctl(option, arg, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), f"prctl({option}, {arg})")


def _die_with_parent() -> None:
    """Run in a child before exec: SIGTERM it when its parent dies, even by SIGKILL.

    (Strictly: when the parent's thread that started it ends; pytest runs fixtures in its main thread.)"""
    _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _descendants(root_pid: int) -> set[int]:
    """The pids of every process below `root_pid` (walking the parent links of /proc/PID/stat)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue  # gone meanwhile
            # The command name (field 2) may hold spaces and parentheses: the fields follow its last ')'.
            ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = set(), [root_pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _signal_all(pids: Iterable[int], sig: int) -> None:
    """Send `sig` to each pid that still exists."""
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _exec_daemon(argv: list[str]) -> None:
    """In the supervisor's forked child: become the daemon, never return (exit 127 if exec fails)."""
    try:
        for name in ("SIGPIPE", "SIGXFSZ"):  # Python ignores these; exec would pass that on to the daemon
            signal.signal(getattr(signal, name), signal.SIG_DFL)
        _die_with_parent()
        os.execvp(argv[0], argv)
    except BaseException as error:  # whatever happens, this process must not go on as a supervisor
        print(f"supervise: cannot run {argv[0]}: {error}", file=sys.stderr, flush=True)
    os._exit(127)


def supervise(argv: list[str]) -> int:
    """Run a daemon under this process and return its exit code; the main of `python cluster.py DAEMON ...`.

    This process is a child subreaper: slurmd daemonizes every slurmstepd (double fork), which would
    otherwise leave it to init; here it stays below us, is reaped when it exits, and is killed, with
    the job processes, once the daemon has exited. SIGTERM (also sent when the test process dies, see
    _die_with_parent) is passed on to the daemon."""
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)
    daemon = os.fork()
    if daemon == 0:
        _exec_daemon(argv)
    signal.signal(signal.SIGTERM, lambda *_: _signal_all([daemon], signal.SIGTERM))
    while True:
        pid, status = os.wait()  # also reaps every orphan that ends meanwhile
        if pid == daemon:
            break
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # nothing left to pass it on to; the cleanup is quick
    while True:  # the daemon is gone: end whatever it left, until no child is left to reap
        _signal_all(_descendants(os.getpid()), signal.SIGKILL)
        try:
            os.wait()
        except ChildProcessError:
            break
    code = os.waitstatus_to_exitcode(status)
    return code if code >= 0 else 128 - code


class LocalSlurm:
    """One slurmctld and one slurmd on localhost, configured and kept under `root`.

    `extra_conf` is appended to slurm.conf (a later line overrides an earlier one), for tests that need
    e.g. preemption settings."""

    def __init__(
        self,
        root: Path,
        *,
        cred_expire_s: int = 5,
        kill_wait_s: int = 5,
        start_timeout_s: float = 30.0,
        extra_conf: str = "",
    ):
        self.root = Path(root)
        self.conf_path = self.root / "slurm.conf"
        self.log_dir = self.root / "log"
        self.node = socket.gethostname().split(".")[0]
        self.cred_expire_s = cred_expire_s
        self.kill_wait_s = kill_wait_s
        self.start_timeout_s = start_timeout_s
        self.extra_conf = extra_conf
        self._daemons: dict[str, subprocess.Popen] = {}

    # ----- configuration and environment

    @property
    def env(self) -> dict[str, str]:
        """A whole environment for client commands: the caller's, less its SLURM_* variables, plus this
        cluster's SLURM_CONF. Jobs inherit it from sbatch, so srun and scontrol inside them work too."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(_CLIENT_ENV_PREFIXES)}
        env["SLURM_CONF"] = str(self.conf_path)
        return env

    def write_config(self) -> None:
        """Create the private directories and write slurm.conf with freshly picked free ports."""
        for sub in ("state", "spool", "log"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        (self.root / "plugstack.conf").write_text("")  # keeps /etc/slurm/plugstack.conf out
        ctld_port, slurmd_port = free_ports(2)
        self.conf_path.write_text(
            CONF_TEMPLATE.substitute(
                node=self.node,
                root=self.root,
                ctld_port=ctld_port,
                slurmd_port=slurmd_port,
                cpus=max(os.cpu_count() or 1, NODE_CPUS),
                memory_mb=max(1, machine_memory_mb() // 2),  # below the machine's, so the node is never short
                cred_expire=self.cred_expire_s,
                kill_wait=self.kill_wait_s,
                extra=self.extra_conf,
            )
        )

    # ----- start and stop

    def start(self) -> None:
        """Write the config, start slurmctld then slurmd, and return once the node is idle.

        On any failure the daemons are stopped again and SlurmError carries the tail of their logs."""
        atexit.register(self.stop)  # the fallback when the caller never reaches stop()
        try:
            self.write_config()
            # -c: start from a clean state; -i: ignore state that cannot be recovered.
            self._spawn("slurmctld", ["slurmctld", "-D", "-c", "-i", "-f", str(self.conf_path)])
            self._wait_until(self._controller_up, "slurmctld to answer scontrol ping")
            self._spawn("slurmd", ["slurmd", "-D", "-N", self.node, "-f", str(self.conf_path)])
            self._wait_until(self._node_idle, f"node {self.node} to become idle")
        except BaseException:
            self.stop()
            raise

    def stop(self, timeout_s: float = 10.0) -> None:
        """Cancel every job, then SIGTERM the daemons' supervisors, which end the daemons and whatever they
        left running; SIGKILL a supervisor that is not gone after `timeout_s`.

        Safe to call twice and after a start() that failed halfway."""
        atexit.unregister(self.stop)
        if "slurmd" in self._daemons and self._daemons["slurmctld"].poll() is None:
            self._cancel_all_jobs()
        for supervisor in self._daemons.values():
            supervisor.terminate()
        deadline = time.monotonic() + timeout_s
        for supervisor in self._daemons.values():
            try:
                supervisor.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                supervisor.kill()
                supervisor.wait()
        self._daemons.clear()

    def _spawn(self, name: str, argv: list[str]) -> None:
        """Start one daemon in the foreground under its supervisor (see supervise), in a new session;
        what it prints goes to log/NAME.out."""
        with open(self.log_dir / f"{name}.out", "ab") as out:
            self._daemons[name] = subprocess.Popen(
                [sys.executable, __file__, *argv],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,  # a Ctrl-C at the terminal goes to the tests, not the daemons
                preexec_fn=_die_with_parent,
            )

    def _cancel_all_jobs(self) -> None:
        """scancel every job that has not ended and give them KillWait and a little more to leave the node."""
        queue = self.run(["squeue", "--noheader", "--format=%i"], check=False, timeout=10)
        if queue.returncode == 0 and queue.stdout.split():
            self.run(["scancel", "--quiet", *queue.stdout.split()], check=False, timeout=10)
        deadline = time.monotonic() + self.kill_wait_s + 5
        while time.monotonic() < deadline:
            queue = self.run(["squeue", "--noheader", "--states=all", "--format=%T"], check=False, timeout=10)
            if queue.returncode != 0 or set(queue.stdout.split()) <= FINAL_STATES:
                return
            time.sleep(0.2)

    def _wait_until(self, ready: Callable[[], bool], what: str) -> None:
        """Poll `ready()` until it holds; SlurmError with the logs if a daemon dies or time runs out."""
        deadline = time.monotonic() + self.start_timeout_s
        while not ready():
            for name, daemon in self._daemons.items():
                if daemon.poll() is not None:
                    raise SlurmError(f"{name} exited with {daemon.returncode} waiting for {what}\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise SlurmError(f"timed out after {self.start_timeout_s:.0f}s waiting for {what}\n{self.log_tail()}")
            time.sleep(0.1)

    def _controller_up(self) -> bool:
        """Whether `scontrol ping` reports the controller UP."""
        ping = self.run(["scontrol", "ping"], check=False, timeout=10)
        return ping.returncode == 0 and " UP" in ping.stdout

    def _node_idle(self) -> bool:
        """Whether sinfo reports the node idle: registered, not drained, nothing running."""
        info = self.run(["sinfo", "--noheader", "--nodes", self.node, "--format=%T"], check=False, timeout=10)
        return info.returncode == 0 and info.stdout.strip() == "idle"

    def log_tail(self, lines: int = 20) -> str:
        """The last `lines` lines of each daemon's log (its own log file, else what it printed)."""
        parts = []
        for name in ("slurmctld", "slurmd"):
            for path in (self.log_dir / f"{name}.log", self.log_dir / f"{name}.out"):
                if path.exists() and path.stat().st_size:
                    tail = path.read_text(errors="replace").splitlines()[-lines:]
                    parts.append(f"--- {path}\n" + "\n".join(tail))
                    break
        return "\n".join(parts)

    # ----- clients

    def run(
        self, args: list[str], *, check: bool = True, timeout: float = 30.0, cwd: Path | None = None
    ) -> subprocess.CompletedProcess:
        """Run a client command (sbatch, squeue, sacct, scontrol, scancel ...) against this cluster."""
        result = subprocess.run(args, env=self.env, capture_output=True, text=True, timeout=timeout, cwd=cwd)
        if check and result.returncode != 0:
            raise SlurmError(f"{' '.join(args)} exited with {result.returncode}: {result.stderr.strip()}")
        return result

    def sbatch(self, args: list[str], *, cwd: Path | None = None) -> str:
        """Submit with `sbatch --parsable ARGS` and return the job id."""
        return self.run(["sbatch", "--parsable", *args], cwd=cwd).stdout.strip().split(";")[0]

    def job_info(self, job_id: str | int) -> dict[str, str]:
        """`scontrol show job` as a dict of its Key=Value fields; empty when slurmctld does not know the job.

        Values are cut at the first space: right for the fields tests read (JobState, Reason, Restarts,
        ExitCode ...), not for the free-text ones (Command, WorkDir)."""
        shown = self.run(["scontrol", "--oneliner", "show", "job", str(job_id)], check=False)
        if shown.returncode != 0:
            return {}
        return dict(re.findall(r"(\w[\w:/]*)=(\S*)", shown.stdout))

    def job_state(self, job_id: str | int) -> str | None:
        """The job's state (PENDING, RUNNING, COMPLETED ...), or None when slurmctld does not know it."""
        return self.job_info(job_id).get("JobState")

    def wait_for_job(
        self, job_id: str | int, states: str | Iterable[str] = FINAL_STATES, timeout_s: float = 60.0
    ) -> str:
        """Poll until the job's state is one of `states` (default: any final state) and return it.

        TimeoutError, with the state it was in, after `timeout_s`."""
        wanted = {states} if isinstance(states, str) else set(states)
        deadline = time.monotonic() + timeout_s
        while True:
            state = self.job_state(job_id)
            if state in wanted:
                return state
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} is {state} after {timeout_s:.0f}s, not one of {sorted(wanted)}")
            time.sleep(0.1)


if __name__ == "__main__":
    sys.exit(supervise(sys.argv[1:]))
