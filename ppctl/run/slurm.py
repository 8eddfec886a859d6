"""``ppctl submit`` and ``ppctl status``: a run as a Slurm batch job, and what its job is doing.

The job script (``<run dir>/job.sbatch``) runs one task per node; each task is the command a user
would type on that node, ``ppctl train --config-dir <run dir>`` on the run's resolved config, with
the node's rank and torchrun's c10d rendezvous on the allocation's first node. A one-node job keeps
its own rendezvous on a port the OS picks; a multi-node job's port follows from the job id, so two
jobs sharing a node do not meet. Every start passes ``trainer.auto_resume=true``: the first start
begins the run, a requeued or resubmitted job continues from the run's latest complete checkpoint.

Preemption and the time limit: Slurm signals the batch shell (``--signal=B:TERM@N``) and the script
passes SIGTERM on with ``scancel --signal=TERM``, which reaches every process of the training step
(``ppctl train``, torchrun, the workers: ``StopRequest`` takes the copies as one stop), as Slurm's own
preemption and a user's ``scancel --signal=TERM`` do; the workers finish their step and save. Not through
``srun``: srun turns a SIGTERM into SIGKILL for its tasks. ``ppctl train`` then exits 143 and the script
requeues the job (``launcher.slurm.requeue``).
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from ppctl.config import PpctlConfig
from ppctl.resolve.validate import control_character, script_value_problem

JOB_SCRIPT = "job.sbatch"
JOB_RECORD = "job.json"  # the submitted job's id, for ``ppctl status``
STOPPED_BY_SIGTERM = 143  # ppctl train's exit status after SIGTERM, once the workers saved (128 + 15)
PORT_BASE, PORT_SPAN = 20000, 20000  # a multi-node job's rendezvous port: PORT_BASE + job id mod PORT_SPAN
SBATCH_PLAIN_WORD = re.compile(r"[-\w.,:=@/%+]+")  # an #SBATCH option sbatch reads whole without quotes
THIS_JOB = "$SLURM_JOB_ID"  # the job a script runs in, as the shell expands it (an array's task: slurm_prepare.py)
SLURM_TIMEOUT_S = 30.0  # the longest wait for sbatch, squeue, sacct or scontrol


class SlurmError(RuntimeError):
    """A Slurm command is missing or refused; the message is one line."""


def script_problem(run_dir: Path, workdir: Path, run_dir_name: str = "trainer.out_dir") -> str | None:
    """Why the resolved run directory (the job's folder, named ``run_dir_name``) or working directory cannot go
    into a job script, in one line, or None.

    The config's own values are checked by validation; these two also hold the current directory."""
    for name, path in ((run_dir_name, run_dir), ("the current directory", workdir)):
        if control_character(str(path)) is not None:
            return script_value_problem(name, str(path))
    if "\\" in str(run_dir):  # a backslash turns off the %j of Slurm's --output pattern
        return (f"{run_dir_name}={str(run_dir)!r} holds a backslash, which Slurm's --output pattern reads as "
                f"'no %j here' (every job would write one log): choose a folder without one")
    return None


def sbatch_word(option: str) -> str:
    """One ``#SBATCH`` option as sbatch's script parser reads it whole: as it is when it holds nothing special,
    else in double quotes with ``\\``, ``"`` and ``#`` escaped (an older sbatch ends a word at ``#`` even in
    quotes, and a space ends it outside them)."""
    if SBATCH_PLAIN_WORD.fullmatch(option):
        return option
    return '"' + re.sub(r'([\\"#])', r"\\\1", option) + '"'


def sbatch_options(config: PpctlConfig, run_dir: Path) -> list[str]:
    """The ``#SBATCH`` options of the run's job, unset settings left to the cluster."""
    slurm, nodes = config.launcher.slurm, config.launcher.nnodes
    log_pattern = str(run_dir).replace("%", "%%") + "/slurm-%j.out"  # %% is a plain % in Slurm's file patterns
    options = [f"--job-name=ppctl-{run_dir.name}", f"--nodes={nodes}", "--ntasks-per-node=1",
               f"--output={log_pattern}", "--open-mode=append",  # a requeued job appends to the same log
               f"--signal=B:TERM@{slurm.signal_lead_s}", "--requeue" if slurm.requeue else "--no-requeue"]
    for name in ("partition", "account", "qos", "time", "gpus_per_node", "cpus_per_task"):
        value = getattr(slurm, name)
        if value is not None:
            options.append(f"--{name.replace('_', '-')}={value}")
    return options + [str(option) for option in slurm.extra_args]


def ppctl_command() -> list[str]:
    """How the job starts ppctl: the ``ppctl`` beside this interpreter, else ``python -m ppctl.cli.app``."""
    script = Path(sys.executable).parent / "ppctl"
    return [str(script)] if script.exists() else [sys.executable, "-m", "ppctl.cli.app"]


def train_command(config: PpctlConfig, run_dir: Path, ppctl: list[str]) -> str:
    """The shell command each node's task runs (``$SLURM_NODEID``, ``$head_node`` and ``$port`` expand there)."""
    words = [*ppctl, "train", "--config-dir", str(run_dir), "trainer.auto_resume=true"]
    command = shlex.join(words)
    if config.launcher.nnodes > 1:
        command += (' launcher.node_rank="$SLURM_NODEID" launcher.rdzv_endpoint="$head_node:$port"'
                    ' launcher.rdzv_id="ppctl-$SLURM_JOB_ID"')
    return command


def job_script(config: PpctlConfig, run_dir: Path, workdir: Path, ppctl: list[str]) -> str:
    """``job.sbatch``: the run's training on the allocation, with preemption turned into save-and-requeue."""
    nodes = config.launcher.nnodes
    task = train_command(config, run_dir, ppctl)
    lines = ["#!/bin/bash",
             f"# Written by `ppctl submit` for the run directory {shlex.quote(str(run_dir))}.",
             "# Submitting it again (sbatch job.sbatch) continues the run from its latest checkpoint.",
             *(f"#SBATCH {sbatch_word(option)}" for option in sbatch_options(config, run_dir)),
             "",
             "set -uo pipefail",
             f"cd {shlex.quote(str(workdir))}  # where ppctl submit ran: relative paths in the config mean the same",
             'echo "ppctl: job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}) on $SLURM_JOB_NODELIST"']
    if nodes > 1:
        lines += ["# torchrun's c10d rendezvous: the allocation's first node, on a port of this job's own",
                  'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
                  f"port=$(({PORT_BASE} + SLURM_JOB_ID % {PORT_SPAN}))",
                  "export head_node port"]
    lines += ["# The time limit's warning (or a signal to this shell) stops the training step: scancel signals every",
              "# process of the step (srun itself would turn a SIGTERM into SIGKILL for its tasks); ppctl train's",
              "# workers finish their step and save a checkpoint.",
              *step_lines(f"--nodes={nodes} --ntasks-per-node=1", task)]
    if config.launcher.slurm.requeue:
        lines += requeue_lines("stopped by SIGTERM after saving a checkpoint")
    lines.append('exit "$status"')
    return "\n".join(lines) + "\n"


def step_lines(srun_options: str, task: str, job: str = THIS_JOB) -> list[str]:
    """The script's one job step, ``bash -c TASK`` under srun, waited for into ``$status``; a SIGTERM to the batch
    shell is passed on with ``scancel --signal=TERM`` of ``job`` (this job's id, as the shell expands it), which
    reaches every process of the step."""
    return [f"trap 'scancel --signal=TERM \"{job}\"' TERM",
            f"srun {srun_options} --kill-on-bad-exit=1 bash -c {shlex.quote(task)} &",
            "step=$!",
            'wait "$step"; status=$?',
            '# A trapped signal ends `wait` early: wait on until the step has ended.',
            'while kill -0 "$step" 2>/dev/null; do wait "$step"; status=$?; done']


def requeue_lines(stopped: str, job: str = THIS_JOB) -> list[str]:
    """Requeue ``job`` (this job's id, as the shell expands it) when its step exited as stopped by SIGTERM;
    ``stopped`` says what that stop kept."""
    return [f'if [ "$status" -eq {STOPPED_BY_SIGTERM} ]; then',
            f'    echo "ppctl: {stopped}; requeueing job {job}"',
            f'    scontrol requeue "{job}"',
            "fi"]


def _slurm(command: list[str]) -> subprocess.CompletedProcess:
    """Run a Slurm client command; a missing command or a time-out is one ``SlurmError`` line."""
    if shutil.which(command[0]) is None:
        raise SlurmError(f"{command[0]}: command not found (is this a Slurm login node? ppctl submit needs sbatch, "
                         f"squeue and scontrol on PATH)")
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=SLURM_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise SlurmError(f"{shlex.join(command)}: no answer within {SLURM_TIMEOUT_S:.0f} s") from None


def submit_job(script: Path) -> str:
    """``sbatch`` the script; the job id, or ``SlurmError`` with sbatch's own reason."""
    done = _slurm(["sbatch", "--parsable", str(script)])
    if done.returncode != 0:
        reason = " ".join(done.stderr.split()) or f"exit status {done.returncode}"
        raise SlurmError(f"sbatch {script} refused the job: {reason}")
    return done.stdout.strip().split(";")[0]  # --parsable: "id" or "id;cluster"


def record_job(run_dir: Path, job_id: str) -> None:
    """Keep the job id in ``<run dir>/job.json`` for ``ppctl status``."""
    (run_dir / JOB_RECORD).write_text(json.dumps({"job_id": job_id, "script": str(run_dir / JOB_SCRIPT)}) + "\n")


class JobRecordError(ValueError):
    """A run's ``job.json`` that ``ppctl submit`` did not write as it is; the message is one line."""


def recorded_job(run_dir: Path) -> str | None:
    """The id of the job ``ppctl submit`` submitted for this run directory, or None (a local run)."""
    path = run_dir / JOB_RECORD
    if not path.exists():
        return None
    try:
        record = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise JobRecordError(f"{path}: cannot read the job record ppctl submit writes ({error}); the job's id is "
                             f"the <id> of {run_dir}/slurm-<id>.out") from None
    job_id = record.get("job_id") if isinstance(record, dict) else None
    if not isinstance(job_id, (str, int)) or isinstance(job_id, bool) or not str(job_id).strip():
        raise JobRecordError(f"{path}: not the job record ppctl submit writes (a JSON object with a job_id, got "
                             f"{type(record).__name__} {json.dumps(record)[:60]}); the job's id is the <id> of "
                             f"{run_dir}/slurm-<id>.out")
    return str(job_id)


@dataclass(frozen=True)
class JobState:
    """What Slurm says of a job: its state (``PENDING``, ``RUNNING``, ``COMPLETED``, ...) and restarts so far."""

    state: str
    restarts: int | None = None


def job_state(job_id: str) -> JobState:
    """The job's state from ``scontrol`` (while the controller remembers it), else ``sacct``, else ``UNKNOWN``."""
    shown = _slurm(["scontrol", "show", "job", "--oneliner", job_id])
    if shown.returncode == 0:
        fields = dict(re.findall(r"(\w+)=(\S*)", shown.stdout))
        if "JobState" in fields:
            restarts = fields.get("Restarts")
            return JobState(fields["JobState"], int(restarts) if restarts and restarts.isdigit() else None)
    if shutil.which("sacct") is not None:
        accounted = _slurm(["sacct", "--noheader", "--parsable2", "--allocations", "--jobs", job_id,
                            "--format=State"])
        states = accounted.stdout.split() if accounted.returncode == 0 else []
        if states:
            return JobState(states[-1].split()[0])
    return JobState("UNKNOWN (neither scontrol nor sacct knows the job any more)")
