"""Start workers with torchrun, watch them, and turn a failure into one line.

``ppctl train`` and ``ppctl check-cluster`` both come here: the run directory holds
the resolved ``config.yaml``; every worker (``python -m ppctl.worker``) reads it.
A worker that raises writes ``errors/rank<N>.txt``; torchrun stops the others; this
module then reports the first failing rank and its error in one line. Nothing here
imports torch at module level, so the CLI starts quickly.
"""

from __future__ import annotations

import datetime
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from ppctl.config import PpctlConfig, nproc_per_node

WORKER_MODULE = "ppctl.worker"
DEFAULT_RDZV_ID = "ppctl"  # the same on every node (a run directory's timestamp would differ between nodes)


@dataclass(frozen=True)
class LaunchPlan:
    """What will be started: the torchrun command, its environment additions, and the run directory."""

    command: list[str]
    env: dict[str, str]
    run_dir: Path

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
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() >= local_workers:
        return "nccl"
    return "gloo"


def threads_per_worker(config: PpctlConfig) -> int:
    """Intra-op threads per worker so that the local workers do not oversubscribe the cores."""
    if config.launcher.threads_per_worker:
        return config.launcher.threads_per_worker
    return max(1, (os.cpu_count() or 1) // nproc_per_node(config))


def build_launch_plan(config: PpctlConfig, run_dir: Path, task: str, backend: str) -> LaunchPlan:
    """The torchrun command for ``task`` (``train`` or ``check-cluster``): standalone or c10d rendezvous."""
    launcher = config.launcher
    command = [sys.executable, "-m", "torch.distributed.run",
               "--nnodes", str(launcher.nnodes), "--nproc-per-node", str(nproc_per_node(config)),
               "--max-restarts", "0", "--monitor-interval", "0.2"]
    if launcher.nnodes == 1 and not launcher.rdzv_endpoint:
        command.append("--standalone")
    else:
        command += ["--rdzv-backend", "c10d", "--rdzv-endpoint", launcher.rdzv_endpoint,
                    "--rdzv-id", launcher.rdzv_id or DEFAULT_RDZV_ID, "--node-rank", str(launcher.node_rank)]
    command += ["-m", WORKER_MODULE, "--run-dir", str(run_dir), "--task", task, "--backend", backend]
    threads = str(threads_per_worker(config))
    return LaunchPlan(command=command, env={"OMP_NUM_THREADS": threads, "PPCTL_THREADS": threads}, run_dir=run_dir)


@dataclass(frozen=True)
class LaunchResult:
    """How a launch ended: torchrun's exit code and, on failure, one line naming the failing rank."""

    returncode: int
    failure: str | None


def run_plan(plan: LaunchPlan) -> LaunchResult:
    """Run torchrun; stream workers' stdout, keep stderr in ``launcher.log``; summarise a failure."""
    log_path = plan.run_dir / "launcher.log"
    env = {**os.environ, **plan.env, "PYTHONUNBUFFERED": "1"}
    with open(log_path, "ab") as log_file:
        process = subprocess.Popen(plan.command, env=env, stderr=subprocess.PIPE, start_new_session=True)
        copier = threading.Thread(target=_copy_stream, args=(process.stderr, log_file), daemon=True)
        copier.start()
        try:
            returncode = process.wait()
        except KeyboardInterrupt:
            _stop(process)
            returncode = 130
        copier.join(timeout=5)
    if returncode == 0:
        return LaunchResult(0, None)
    return LaunchResult(returncode, describe_failure(plan.run_dir, log_path, returncode))


def _copy_stream(stream, log_file) -> None:
    for chunk in iter(lambda: stream.read1(65536), b""):
        log_file.write(chunk)
        log_file.flush()


def _stop(process: subprocess.Popen) -> None:
    """Terminate torchrun and its workers (its own process group), then kill what remains."""
    for sig, wait_s in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        try:
            os.killpg(process.pid, sig)
            process.wait(timeout=wait_s)
            return
        except (ProcessLookupError, subprocess.TimeoutExpired):
            continue


_TORCHRUN_FAILURE = re.compile(r"rank\s*:\s*(\d+).*?\n.*?exitcode\s*:\s*(-?\d+)", re.S)


def describe_failure(run_dir: Path, log_path: Path, returncode: int) -> str:
    """One line: the first rank that failed and why (its exception, or its exit signal)."""
    error_files = sorted((run_dir / "errors").glob("rank*.txt"), key=lambda path: path.stat().st_mtime)
    if error_files:
        first = error_files[0]
        rank = first.stem.removeprefix("rank")
        message = first.read_text().strip().splitlines()[0]
        return f"worker rank {rank} failed: {message} (log: {log_path})"
    log_text = log_path.read_text(errors="replace") if log_path.exists() else ""
    root_cause = log_text.find("Root Cause")
    match = _TORCHRUN_FAILURE.search(log_text, max(root_cause, 0))
    if match:
        rank, exitcode = int(match.group(1)), int(match.group(2))
        cause = f"killed by signal {-exitcode}" if exitcode < 0 else f"exit code {exitcode}"
        return f"worker rank {rank} failed: {cause} (log: {log_path})"
    return f"torchrun exited with code {returncode} (log: {log_path})"
