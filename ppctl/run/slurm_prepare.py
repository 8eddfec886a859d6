"""``ppctl submit prepare-data``: a corpus prepared by a Slurm job array, one task per group of its shards.

The job's folder (``runs/prepare-<timestamp>``, or ``--out``) holds the validated config (``config.yaml``) and
``prepare.sbatch``, an array of T one-node tasks. Task I runs the command a user would type for it,
``ppctl prepare-data --config-dir <job folder> --task I --tasks T``, in the directory ``ppctl submit`` ran in
(relative paths in the config mean the same): every task, a requeued one too, prepares from the same resolved
config, whatever changes in the user's config tree meanwhile, and so plans the same shards and writes them
into the same cache entry. Task I writes the I-th of T contiguous groups of the corpus' shards (the engine's
``ShardTask``, ``ppctl/data/shards.py``), each shard complete once its metadata is written; the corpus is
complete, its index written, once every shard is, whichever task finished last.

The task runs as the training job's does: one ``srun`` step, a SIGTERM to the batch shell (the time limit's
warning, ``--signal=B:TERM@N``) passed on to it with ``scancel --signal=TERM``, as Slurm's preemption and a
user's ``scancel --signal=TERM`` do. ``ppctl prepare-data`` then stops, keeping the shards it finished, and exits
143; the script requeues that task alone (``launcher.slurm.requeue``), whose next start prepares only its shards
still missing. The script names its task ``<array id>_<index>``, never ``$SLURM_JOB_ID``: the array's last task
has the array's own id, which Slurm's commands take as the whole array. Each task logs to
``<job folder>/prepare-<array id>_<task>.out``, a requeued start appending.
"""

from __future__ import annotations

import shlex
from pathlib import Path

from ppctl.config import PpctlConfig
from ppctl.run.slurm import requeue_lines, sbatch_word, step_lines

PREPARE_SCRIPT = "prepare.sbatch"
PREPARE_LOG = "prepare-%A_%a.out"  # Slurm's file pattern: the array's id, the task's index
UNPREPARED_SOURCES = ("synthetic", "indexed")  # generated, or read as they are: nothing to prepare
SHARED_SOURCES = ("text", "python_stdlib")  # the sources whose shards tasks share (prepare-data --task I --tasks T)
# The task's own job: the last task's $SLURM_JOB_ID is the array's id, which scancel and scontrol take as every
# task of the array (measured on Slurm 22.05): signalled or requeued by it, the others would stop or run again.
THIS_TASK = "${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}"
ALLOCATION_SETTINGS = ("partition", "account", "qos", "time")  # launcher.slurm.* a CPU-only task asks for too


def parse_tasks(text: str) -> int:
    """``--tasks T``: a whole number of array tasks, at least 1; else ``ValueError`` with the one line."""
    try:
        tasks = int(text)
    except ValueError:
        tasks = 0
    if tasks < 1:
        raise ValueError(f"--tasks {text}: give the number of array tasks, a whole number of at least 1")
    return tasks


def submit_problem(config: PpctlConfig) -> str | None:
    """Why the config's preparation cannot go to Slurm as a job array, in one line, or None: without
    ``launcher=slurm`` (whose settings the array asks for, validated), with data that needs no preparation, or
    with a source whose preparation is not cut into shards for tasks to share (a blend, chat or prompt_completion
    rows)."""
    if config.launcher.kind != "slurm":
        return ("ppctl submit prepare-data hands the preparation to Slurm: add launcher=slurm (and launcher.slurm.* "
                "for the allocation); ppctl prepare-data prepares here")
    data = config.data
    if data.source in UNPREPARED_SOURCES and not data.blend:
        return f"data.source={data.source} needs no preparation: there is nothing to submit"
    if data.blend or data.source not in SHARED_SOURCES:
        what = "each source of data.blend" if data.blend else f"data.source={data.source}"
        return (f"ppctl submit prepare-data shares a text corpus's shards among its tasks (data=text or "
                f"python_stdlib); prepare {what} with ppctl prepare-data")
    return None


def prepare_options(config: PpctlConfig, job_dir: Path, tasks: int) -> list[str]:
    """The ``#SBATCH`` options of the array: ``tasks`` one-node tasks, each with the training job's partition,
    account, qos, time, requeueing and extra options (no GPUs), and ``launcher.slurm.cpus_per_task`` (else
    ``data.num_proc``) CPUs; unset settings left to the cluster."""
    slurm = config.launcher.slurm
    log_pattern = str(job_dir).replace("%", "%%") + "/" + PREPARE_LOG  # %% is a plain % in Slurm's file patterns
    options = [f"--job-name=ppctl-{job_dir.name}", f"--array=0-{tasks - 1}", "--nodes=1", "--ntasks=1",
               f"--output={log_pattern}", "--open-mode=append",  # a requeued task appends to its own log
               f"--signal=B:TERM@{slurm.signal_lead_s}", "--requeue" if slurm.requeue else "--no-requeue"]
    for name in ALLOCATION_SETTINGS:
        value = getattr(slurm, name)
        if value is not None:
            options.append(f"--{name}={value}")
    cpus = slurm.cpus_per_task or config.data.num_proc
    if cpus is not None:
        options.append(f"--cpus-per-task={cpus}")
    return options + [str(option) for option in slurm.extra_args]


def prepare_command(job_dir: Path, tasks: int, ppctl: list[str]) -> str:
    """The shell command each task runs (``$SLURM_ARRAY_TASK_ID``, its index, expands there)."""
    command = shlex.join([*ppctl, "prepare-data", "--config-dir", str(job_dir)])
    return f'{command} --task "$SLURM_ARRAY_TASK_ID" --tasks {tasks}'


def prepare_script(config: PpctlConfig, job_dir: Path, workdir: Path, tasks: int, ppctl: list[str]) -> str:
    """``prepare.sbatch``: ``tasks`` array tasks, each preparing its group of the corpus' shards; one stopped by
    SIGTERM keeps its finished shards and requeues itself."""
    lines = ["#!/bin/bash",
             f"# Written by `ppctl submit prepare-data` for the job folder {shlex.quote(str(job_dir))}.",
             f"# Task I of {tasks} prepares the I-th of {tasks} groups of the corpus' shards; submitting it again",
             f"# (sbatch {PREPARE_SCRIPT}) prepares only the shards still missing.",
             *(f"#SBATCH {sbatch_word(option)}" for option in prepare_options(config, job_dir, tasks)),
             "",
             "set -uo pipefail",
             f"cd {shlex.quote(str(workdir))}  # where ppctl submit ran: relative paths in the config mean the same",
             'echo "ppctl: task $SLURM_ARRAY_TASK_ID of job array $SLURM_ARRAY_JOB_ID (job $SLURM_JOB_ID, restart'
             ' ${SLURM_RESTART_COUNT:-0}) on $SLURM_JOB_NODELIST"',
             "# The time limit's warning (or a signal to this shell) stops the preparation: scancel signals every",
             "# process of the step (srun itself would turn a SIGTERM into SIGKILL for its tasks); the shards",
             "# finished so far are kept.",
             *step_lines("--nodes=1 --ntasks=1", prepare_command(job_dir, tasks, ppctl), THIS_TASK)]
    if config.launcher.slurm.requeue:
        lines += requeue_lines("stopped by SIGTERM, its finished shards kept", THIS_TASK)
    lines.append('exit "$status"')
    return "\n".join(lines) + "\n"
