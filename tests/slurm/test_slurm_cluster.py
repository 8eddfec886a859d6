"""Tests of the local Slurm cluster itself: jobs run, signal delivery, and the clients' environment (a requeue is
tests/slurm/test_submit.py's).

The signal tests pin down what Slurm 22.05 delivers where, because the preemption path builds on it:
- `scancel --signal=TERM --batch JOB` reaches the batch shell only (not its children);
- `scancel --signal=TERM JOB` reaches the tasks of the job's srun steps only (not the batch shell, not srun);
- `scancel --signal=TERM --full JOB` reaches every process of the batch step (shell, srun, the shell's other
  children), and srun answers SIGTERM by SIGKILLing its tasks, which never see the TERM.
"""

import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slurm, pytest.mark.xdist_group("slurm"), pytest.mark.timeout(120)]

def wait_for_text(path: Path, text: str, timeout_s: float = 60.0) -> str:
    """Poll until the file at `path` holds `text` and return its content; TimeoutError otherwise."""
    deadline = time.monotonic() + timeout_s
    while True:
        content = path.read_text() if path.exists() else ""
        if text in content:
            return content
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} lacks {text!r} after {timeout_s:.0f}s; it holds:\n{content}")
        time.sleep(0.1)


def write_script(path: Path, body: str) -> Path:
    """Write an executable bash script and return its path."""
    path.write_text("#!/bin/bash\n" + body)
    path.chmod(0o755)
    return path


def test_wrapped_command_runs_to_completion(slurm_cluster, tmp_path):
    out = tmp_path / "hello.out"
    job = slurm_cluster.sbatch([f"--output={out}", "--wrap", "echo hello from $SLURM_JOB_ID"], cwd=tmp_path)

    assert slurm_cluster.wait_for_job(job, timeout_s=60) == "COMPLETED"
    assert out.read_text().splitlines() == [f"hello from {job}"]


def test_term_to_the_batch_shell_reaches_its_trap(slurm_cluster, tmp_path):
    out = tmp_path / "trap.out"
    script = write_script(
        tmp_path / "trap.sh",
        """\
trap 'echo got TERM; exit 143' TERM
echo ready
sleep 60 &
wait  # a shell runs its trap only between commands: wait returns on the signal, sleep would not
echo "no signal"
""",
    )
    job = slurm_cluster.sbatch([f"--output={out}", str(script)], cwd=tmp_path)
    wait_for_text(out, "ready")

    slurm_cluster.run(["scancel", "--signal=TERM", "--batch", job])

    assert slurm_cluster.wait_for_job(job, timeout_s=60) == "FAILED"  # the trap's exit 143
    assert slurm_cluster.job_info(job)["ExitCode"] == "143:0"
    assert "got TERM" in out.read_text()
    assert "no signal" not in out.read_text()


def submit_job_with_srun_step(cluster, tmp_path: Path) -> tuple[str, Path, Path]:
    """Submit a batch shell that runs one task under srun; both trap TERM and log to signals.log.

    Returns the job id, the log and the job's output once the task has set its trap."""
    log, out = tmp_path / "signals.log", tmp_path / "job.out"
    task = write_script(
        tmp_path / "task.sh",
        f"""\
trap 'echo "task got TERM" >> {log}; exit 143' TERM
echo "task ready" >> {log}
sleep 60 &
wait
echo "task ended without a signal" >> {log}
""",
    )
    batch = write_script(
        tmp_path / "batch.sh",
        f"""\
trap 'echo "batch shell got TERM" >> {log}' TERM
srun {task} &
wait $!  # returns early if the shell's trap runs; the second wait then waits for srun itself
wait $!
echo "srun exited with $?" >> {log}
""",
    )
    job = cluster.sbatch([f"--output={out}", str(batch)], cwd=tmp_path)
    wait_for_text(log, "task ready")
    return job, log, out


def test_term_without_batch_reaches_only_the_step_tasks(slurm_cluster, tmp_path):
    job, log, out = submit_job_with_srun_step(slurm_cluster, tmp_path)

    slurm_cluster.run(["scancel", "--signal=TERM", job])

    # The batch script goes on after its step ends, so the job completes with the script's exit status.
    assert slurm_cluster.wait_for_job(job, timeout_s=60) == "COMPLETED"
    logged = log.read_text()
    assert "task got TERM" in logged
    assert "batch shell got TERM" not in logged
    assert "srun exited with 143" in logged  # srun passes on the task's exit status
    assert "forcing job termination" not in out.read_text()  # what srun prints when it gets SIGTERM


def test_term_with_full_reaches_the_batch_step_and_srun_kills_its_tasks(slurm_cluster, tmp_path):
    job, log, out = submit_job_with_srun_step(slurm_cluster, tmp_path)

    slurm_cluster.run(["scancel", "--signal=TERM", "--full", job])

    assert slurm_cluster.wait_for_job(job, timeout_s=60) == "COMPLETED"
    logged = log.read_text()
    assert "batch shell got TERM" in logged
    # srun (srun_job.c, _srun_signal_mgr) turns SIGTERM, SIGHUP and SIGQUIT into SIGKILL for its tasks;
    # other signals (USR1, USR2 ...) it forwards unchanged.
    assert "forcing job termination" in out.read_text()
    assert "task got TERM" not in logged
    assert "srun exited with 137" in logged  # 128 + SIGKILL


def test_clients_reach_the_cluster(slurm_cluster, tmp_path):
    job = slurm_cluster.sbatch(["--output=/dev/null", "--wrap", "sleep 60"], cwd=tmp_path)
    try:
        assert slurm_cluster.wait_for_job(job, "RUNNING", timeout_s=60) == "RUNNING"

        queue = slurm_cluster.run(["squeue", "--noheader", "--jobs", job, "--format=%i %T %P %N"])
        assert queue.stdout.split() == [job, "RUNNING", "debug", slurm_cluster.node]
        shown = slurm_cluster.run(["scontrol", "show", "job", job])
        assert f"JobId={job} " in shown.stdout and "JobState=RUNNING" in shown.stdout
        # Without slurmdbd there is no job accounting: sacct only says so. A test that needs a finished
        # job's state reads it from slurmctld (scontrol show job, squeue --states=all) within MinJobAge.
        sacct = slurm_cluster.run(["sacct", "--jobs", job], check=False)
        assert sacct.returncode != 0
        assert "accounting storage is disabled" in sacct.stderr
    finally:
        slurm_cluster.run(["scancel", job])
    assert slurm_cluster.wait_for_job(job, timeout_s=60) == "CANCELLED"
