"""A run started from its resolved config: here (the checks, the run directory, the workers, how it ended) or as
a Slurm job (its run directory and job script).

``ppctl train``, ``ppctl check-cluster`` and ``ppctl bench`` come here through ``plan_launch`` then
``start_launch``, the command preparing the data between the two; ``ppctl submit`` through ``write_job_dir``,
``ppctl submit prepare-data`` through ``write_prepare_job``.
The order is the guarantee: what can be refused without writing anything (the run directory's rules, the
backend) is refused before anything starts or changes in the directory, the dry run included; the
rendezvous endpoint is asked just before the start; the run directory is locked before it is written, and
an earlier run's checkpoints are cleared only under that lock. A refusal or a failure is ``LaunchError``
(one line, its exit status), a signal's stop ``LaunchInterrupted`` (one line, 128 + the signal), a run
directory that cannot be used ``RunDirError``. Nothing here calls the command line; progress lines go to
stderr as the launcher's own do.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from ppctl.config import PpctlConfig
from ppctl.fileio import os_reason
from ppctl.resolve import to_yaml

from ppctl.run.launch import (LaunchPlan, LaunchRequest, LaunchResult, backend_problem, build_launch_plan,
                              compile_problem, describe_interruption, describe_workers, local_gpus, resolve_backend,
                              run_plan, saved_on_stop)
from ppctl.run.rendezvous import rendezvous_problem
from ppctl.run.rundir import (RunDirError, clear_earlier_run, clears_earlier_run, run_dir_problem, write_files,
                              write_run_dir)
from ppctl.run.slurm import JOB_SCRIPT, job_script, ppctl_command, script_problem
from ppctl.run.slurm_prepare import PREPARE_SCRIPT, prepare_script
from ppctl.run.supervise import say

if TYPE_CHECKING:
    from ppctl.resolve.resolved import ResolvedConfig


class LaunchError(RuntimeError):
    """A launch refused (exit status 2) or failed (1); the message is one line."""

    def __init__(self, line: str, exit_code: int = 2) -> None:
        super().__init__(line)
        self.exit_code = exit_code


class LaunchInterrupted(Exception):
    """The launch stopped on a signal; the message is the line that says how the workers stopped, ``exit_code``
    128 + the signal."""

    def __init__(self, line: str, exit_code: int) -> None:
        super().__init__(line)
        self.exit_code = exit_code


@dataclass(frozen=True)
class Launch:
    """A launch checked and planned, nothing started: its resolved config, request, torchrun plan and banner line."""

    resolved: ResolvedConfig
    request: LaunchRequest
    plan: LaunchPlan
    banner: str

    def clears_earlier_run(self) -> bool:
        """Whether it deletes an earlier run's checkpoints in its run directory (``trainer.overwrite=true``)."""
        return clears_earlier_run(self.resolved.config, self.request.run_dir, self.request.task)


def plan_launch(resolved: ResolvedConfig, request: LaunchRequest) -> Launch:
    """Check what can be checked before anything starts or changes in the run directory (its rules, the backend
    on this node) and plan the torchrun command; ``LaunchError`` for a refusal."""
    config, run_dir, task = resolved.config, request.run_dir, request.task
    problem = run_dir_problem(run_dir, task, request.resume_from, config.trainer.overwrite)
    if problem is not None:
        raise LaunchError(problem)
    backend = resolve_backend(config.launcher.backend, resolved.sizes.nproc_per_node)
    problem = (backend_problem(backend, resolved.sizes.nproc_per_node, local_gpus())
               or compile_problem(config, backend))
    if problem is not None:
        raise LaunchError(problem)
    banner = (f"run directory: {run_dir}  ({task}, {backend}, {config.launcher.nnodes} node(s), "
              f"{describe_workers(config)})")
    return Launch(resolved, request, build_launch_plan(config, request, backend), banner)


def dry_run_lines(launch: Launch) -> list[str]:
    """What ``--dry-run`` prints: the banner, what ``trainer.overwrite=true`` would delete, the torchrun command."""
    lines = [launch.banner]
    if launch.clears_earlier_run():
        lines.append(f"trainer.overwrite=true: would delete the earlier run's checkpoints and TensorBoard logs in "
                     f"{launch.request.run_dir}")
    return lines + [launch.plan.printable()]


def start_launch(launch: Launch, layout_json: str, files: dict[str, str]) -> None:
    """Check the rendezvous endpoint, create and lock the run directory (its records, ``layout_json`` and
    ``files`` written into it), run the workers, release the lock; ``LaunchInterrupted`` or ``LaunchError`` (exit
    1) when the run did not end well, ``LaunchError`` or ``RunDirError`` (exit 2) when it could not start."""
    config, run_dir, task = launch.resolved.config, launch.request.run_dir, launch.request.task
    problem = rendezvous_problem(config.launcher)
    if problem is not None:
        raise LaunchError(problem)
    lock = write_run_dir(run_dir, config, task, layout_json)
    started = time.time()
    try:
        if launch.clears_earlier_run():
            _clear_earlier_run(run_dir)  # only now, under the lock: never a live run's checkpoints
        write_files(run_dir, files)
        say(launch.banner)
        result = run_plan(launch.plan)
    finally:
        lock.release()
    _raise_unless_ended_well(launch, result, started)


def _raise_unless_ended_well(launch: Launch, result: LaunchResult, started: float) -> None:
    """``LaunchInterrupted`` for a run stopped by a signal (saying whether and how to resume), ``LaunchError``
    (exit 1) for a failed one."""
    config, run_dir = launch.resolved.config, launch.request.run_dir
    if result.interrupted is not None:
        resumable = launch.request.task == "train" and config.trainer.checkpoints
        saved = resumable and saved_on_stop(run_dir, result.interrupted, started)
        raise LaunchInterrupted(describe_interruption(result, run_dir, resumable, saved), result.exit_code)
    if result.failure:
        raise LaunchError(result.failure, exit_code=1)


def write_job_dir(config: PpctlConfig, run_dir: Path, workdir: Path, resume_from: str | None,
                  layout_json: str) -> None:
    """``ppctl submit``: check, lock and write the job's run directory (its records, ``layout_json``, the job's own
    ``config.yaml`` and ``job.sbatch``, which starts in ``workdir``); ``RunDirError`` when it cannot.

    The job's config has its run directory and checkpoint pinned, and the earlier run cleared now, once, so that
    the job's starts (a requeue too) continue the run instead of deleting it again."""
    problem = script_problem(run_dir, workdir) or run_dir_problem(run_dir, "train", resume_from,
                                                                  config.trainer.overwrite)
    if problem is not None:
        raise RunDirError(problem)
    lock = write_run_dir(run_dir, config, "train", layout_json)
    try:
        if clears_earlier_run(config, run_dir, "train"):
            _clear_earlier_run(run_dir)
        job = replace(config, trainer=replace(config.trainer, out_dir=str(run_dir), resume_from=resume_from,
                                              overwrite=False))
        write_files(run_dir, {"config.yaml": to_yaml(job),
                              JOB_SCRIPT: job_script(job, run_dir, workdir, ppctl_command())})
    finally:
        lock.release()


def write_prepare_job(config: PpctlConfig, job_dir: Path, workdir: Path, tasks: int) -> None:
    """``ppctl submit prepare-data``: write the job's folder, new or empty (the config its tasks prepare from and
    ``prepare.sbatch``, an array of ``tasks`` tasks starting in ``workdir``); ``RunDirError`` when it cannot."""
    problem = script_problem(job_dir, workdir, "--out") or _job_folder_problem(job_dir)
    if problem is not None:
        raise RunDirError(problem)
    files = {"config.yaml": to_yaml(config), PREPARE_SCRIPT: prepare_script(config, job_dir, workdir, tasks,
                                                                           ppctl_command())}
    path = job_dir
    try:
        job_dir.mkdir(parents=True, exist_ok=True)
        for name, text in files.items():
            path = job_dir / name
            path.write_text(text)
    except OSError as error:
        raise RunDirError(f"--out {job_dir}: cannot write {path.name}: {os_reason(error, path)}") from None


def _job_folder_problem(job_dir: Path) -> str | None:
    """Why ``job_dir`` cannot be a new job's folder (it is a file, or holds files already: an earlier job's logs
    would mix with the new one's), in one line, or None."""
    if job_dir.exists() and not job_dir.is_dir():
        return f"--out {job_dir}: not a folder"
    if job_dir.is_dir() and any(job_dir.iterdir()):
        return (f"--out {job_dir} holds files already: give each job a folder of its own (a new --out DIR, or no "
                f"--out for a new runs/prepare-<timestamp>); sbatch {job_dir / PREPARE_SCRIPT} submits an earlier "
                f"job again")
    return None


def _clear_earlier_run(run_dir: Path) -> None:
    """Delete the earlier run's checkpoints and logs in ``run_dir`` and say so on stderr (``RunDirError`` when they
    cannot be deleted)."""
    said = clear_earlier_run(run_dir)
    if said:
        say(said)
