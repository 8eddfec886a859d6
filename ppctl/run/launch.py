"""Start the workers with torchrun: the command and its plan, the run, and the line that says how it ended.

``ppctl train``, ``ppctl check-cluster`` and ``ppctl bench`` all come here, through ``start`` (a launch's
steps in their order): the run directory holds the resolved ``config.yaml``; every worker (``python -m
ppctl.cli.worker``) reads it. The pieces around a run live beside this module: ``supervise`` (torchrun's log
and a stop on a signal), ``proctree`` (finding and signalling the workers), ``failures`` (the first failing
rank in one line), ``rundir`` (what may go into a run directory, and its lock) and ``rendezvous`` (an
explicit endpoint, checked before the start). A single-node run without an endpoint hosts its own
rendezvous on a port the OS picks, under an id of its own. Nothing here imports torch at module level, so
the CLI starts quickly.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from ppctl.checkpoint.files import CheckpointError, latest_checkpoint, read_index
from ppctl.config import PpctlConfig, nproc_per_node
from ppctl.run.failures import describe_failure, describe_log_failure
from ppctl.run.supervise import SignalInbox, Stopping, die_with, supervise

WORKER_MODULE = "ppctl.cli.worker"
DEFAULT_RDZV_ID = "ppctl"  # the same on every node (a run directory's timestamp would differ between nodes)
# A single-node run's own rendezvous: port 0 lets the OS pick a free one, so runs on one machine never meet.
LOCAL_RDZV_ENDPOINT = "localhost:0"


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


INDUCTOR_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"
INDUCTOR_CACHE = Path(".cache") / "inductor"  # under the run directory: trainer.compile's compiled code


def compile_env(config: PpctlConfig, run_dir: Path) -> dict[str, str]:
    """The workers' environment for ``trainer.compile``: inductor's cache in ``<run dir>/.cache/inductor``.

    Set by the launcher, before any worker starts, so every worker of the run shares the folder and a resumed or
    requeued run in the same directory loads what an earlier one compiled. A worker cannot set it itself: importing
    Dynamo (which torch's own ops may do first: an initialisation on the meta device) fixes inductor's default in its
    environment. A folder the user set (``TORCHINDUCTOR_CACHE_DIR`` in ppctl's environment) is kept.
    """
    if not config.trainer.compile or users_inductor_cache() is not None:
        return {}
    return {INDUCTOR_CACHE_ENV: str((Path(run_dir) / INDUCTOR_CACHE).resolve())}


def users_inductor_cache() -> str | None:
    """``TORCHINDUCTOR_CACHE_DIR`` as the user set it, or None: unset, or set by Dynamo's import to inductor's default
    (the launcher imports Dynamo when it builds a model on the meta device to check a checkpoint's shapes)."""
    value = os.environ.get(INDUCTOR_CACHE_ENV)
    if value is not None and "torch._dynamo" in sys.modules:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir

        return None if os.path.abspath(default_cache_dir()) == value else value
    return value


def compile_problem(config: PpctlConfig, backend: str) -> str | None:
    """Why ``trainer.compile=true`` cannot compile on this node's CPU workers, or None.

    Inductor's CPU back end builds C++ at the first step with ``$CXX`` (else ``g++``, as inductor chooses); without
    that compiler every worker would fail there, minutes into the run, so it is refused before anything starts.
    """
    compiler = os.environ.get("CXX", "g++")
    if config.trainer.compile and backend == "gloo" and shutil.which(compiler) is None:
        return (f"trainer.compile=true on CPU workers needs a C++ compiler for inductor: {compiler!r} is not on the "
                f"PATH (install gcc/g++, set CXX to one, or set trainer.compile=false)")
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


@dataclass(frozen=True)
class LaunchRequest:
    """What a launch asks beside its validated config, which it leaves as it is: the task (``train``,
    ``check-cluster``, ``bench``), the run directory, and the verified checkpoint a training run resumes from
    (None: it starts at step 0)."""

    task: str
    run_dir: Path
    resume_from: str | None = None


def build_launch_plan(config: PpctlConfig, request: LaunchRequest, backend: str) -> LaunchPlan:
    """The torchrun command of a launch ``request``: standalone or c10d rendezvous."""
    launcher, run_dir, task = config.launcher, request.run_dir, request.task
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
    if request.resume_from:
        command += ["--resume-from", request.resume_from]
    threads = str(threads_per_worker(config))
    # When torchrun itself must stop the workers (ppctl was killed), it gives them as long as ppctl would.
    env = {"OMP_NUM_THREADS": threads, "PPCTL_THREADS": threads,
           "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": str(launcher.shutdown_timeout_s), **compile_env(config, run_dir)}
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
                                   preexec_fn=die_with(os.getpid()))
        stop = supervise(process, inbox, log_file, Stopping(plan.shutdown_timeout_s, plan.stop_notice))
    if stop.log_error is not None:
        return LaunchResult(process.returncode, describe_log_failure(log_path, stop.log_error, plan.run_dir),
                            killed=stop.killed)
    if stop.signum is not None:
        return LaunchResult(process.returncode, None, interrupted=stop.signum, killed=stop.killed)
    if process.returncode == 0:
        return LaunchResult(0, None)
    return LaunchResult(process.returncode,
                        describe_failure(plan.run_dir, log_path, process.returncode, log_start, started))


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
