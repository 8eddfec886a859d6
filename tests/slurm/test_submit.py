"""``ppctl submit`` against a real slurmctld and slurmd on this machine (tests/slurm/cluster.py).

Three jobs run side by side on the node, each checked against
the single-process run a user would launch (``parallel=single``, same overrides):
- a plain job trains to the end, its TensorBoard losses and grad norms those of one process, and
  ``ppctl status`` reports it COMPLETED with its last step and checkpoint;
- a job stopped with ``scancel --signal=TERM``, and once resumed by SIGTERM to its batch shell (the time
  limit's warning), saves a checkpoint and requeues itself each time, resumes in the same run directory
  and finishes with every step logged once, equal to an uninterrupted run;
- a job whose worker is killed on purpose restarts its workers (``launcher.max_restarts=1``), which
  resume from the latest checkpoint and finish equal.
"""

import json
import time

import pytest

from tests.cli.conftest import run_ppctl
from tests.cli.runs import assert_same_series, scalars, single_run  # noqa: F401  (single_run: a fixture)
from tests.slurm.cluster import FINAL_STATES

pytestmark = [pytest.mark.slurm, pytest.mark.xdist_group("slurm"), pytest.mark.timeout(420)]

SMALL = ["data=synthetic", "trainer.seq_length=16", "trainer.global_batch_size=8", "trainer.log_every=1",
         "trainer.eval_every=0"]
PLAIN = [*SMALL, "trainer.max_steps=5", "trainer.save_every=2"]
LONG = [*SMALL, "trainer.max_steps=100"]  # long enough to be stopped twice on the way
# The job to be stopped comes first: its starts, stops and requeues are the module's longest path, and the jobs that
# run to their end by themselves start beside it.
JOBS = {"stopped": LONG, "plain": PLAIN,
        "restarted": [*PLAIN, "launcher.max_restarts=1", "launcher.inject_fault=0:kill@3"]}
JOB_TIMEOUT_S = 300.0


@pytest.fixture(scope="module")
def jobs(slurm_cluster, tmp_path_factory, single_run):
    """``name -> (job id, run directory)`` of the module's jobs (``JOBS``), submitted through ``ppctl submit`` as
    its first test starts, so that they run side by side whichever test runs first; the single-process runs the
    module compares with start training meanwhile (the jobs spend much of their time waiting)."""
    submitted = {name: _submit(slurm_cluster, tmp_path_factory.mktemp("runs") / name, overrides)
                 for name, overrides in JOBS.items()}
    for overrides in (LONG, PLAIN):
        single_run.start(overrides)
    return submitted


def _submit(cluster, run, overrides) -> tuple[str, object]:
    """``ppctl submit launcher=slurm OVERRIDES`` into ``run``: the job id and the run directory."""
    result = _ppctl(cluster, "submit", "launcher=slurm", *overrides, f"trainer.out_dir={run}")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("submitted job ") and f"run directory {run}" in result.stdout
    return result.stdout.split()[2].rstrip(":"), run


def _ppctl(cluster, *args):
    """``ppctl ARGS`` with the local cluster's client settings (``SLURM_CONF``) in the environment."""
    return run_ppctl(*args, env=cluster.env)


def _job_log(run, job_id) -> str:
    path = run / f"slurm-{job_id}.out"
    return path.read_text(errors="replace") if path.exists() else ""


def test_a_job_stopped_by_sigterm_saves_requeues_and_finishes_like_an_uninterrupted_run(slurm_cluster, jobs,
                                                                                         single_run):
    """Stopped twice: by ``scancel --signal=TERM`` (the training step's processes get it, as in a preemption),
    then, once requeued and resumed, by SIGTERM to the batch shell alone (what ``--signal=B:TERM@N`` sends
    before the time limit), which the script passes on to the step."""
    job_id, run = jobs["stopped"]  # the other jobs run meanwhile
    _wait_for_log(slurm_cluster, job_id, run, "step     2/100 | loss")
    slurm_cluster.run(["scancel", "--signal=TERM", job_id])
    _wait_for_log(slurm_cluster, job_id, run, "resumed from")
    slurm_cluster.run(["scancel", "--signal=TERM", "--batch", job_id])
    state = slurm_cluster.wait_for_job(job_id, timeout_s=JOB_TIMEOUT_S)
    log = _job_log(run, job_id)
    assert state == "COMPLETED", log
    assert slurm_cluster.job_info(job_id).get("Restarts") == "2", log
    assert log.count("checkpoint saved (interrupted by SIGTERM)") == 2 and log.count("requeueing job") == 2, log
    assert log.count(f"resumed from {run / 'checkpoints'}") == 2, log
    assert_same_series(run, single_run(LONG))
    assert sorted(event.step for event in scalars(run).Scalars("train/loss")) == list(range(100)), \
        "a step logged twice or missing"


def _wait_for_log(cluster, job_id, run, text) -> None:
    """Poll the job's log until it holds ``text``; fail with the log if the job ends or time runs out first."""
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while text not in _job_log(run, job_id):
        assert time.monotonic() < deadline and cluster.job_state(job_id) not in FINAL_STATES, \
            f"no {text!r} in the log of job {job_id}:\n{_job_log(run, job_id)}"
        time.sleep(0.1)


def test_a_submitted_job_trains_like_one_process_and_status_says_so(slurm_cluster, jobs, single_run):
    job_id, run = jobs["plain"]
    state = slurm_cluster.wait_for_job(job_id, timeout_s=JOB_TIMEOUT_S)
    assert state == "COMPLETED", _job_log(run, job_id)
    assert_same_series(run, single_run(PLAIN))
    status = _ppctl(slurm_cluster, "status", str(run), "--json")
    assert status.returncode == 0, status.stderr
    report = json.loads(status.stdout)
    assert report["job"]["job_id"] == job_id and report["job"]["state"] == "COMPLETED"
    assert report["last_step"] == 5 and report["latest_checkpoint"]["step"] == 5


def test_a_job_whose_worker_dies_restarts_from_its_checkpoint_and_finishes_equal(slurm_cluster, jobs, single_run):
    job_id, run = jobs["restarted"]
    state = slurm_cluster.wait_for_job(job_id, timeout_s=JOB_TIMEOUT_S)
    log = _job_log(run, job_id)
    assert state == "COMPLETED", log
    assert f"resumed from {run / 'checkpoints' / 'step_00000002'} at step 2" in log, log
    assert_same_series(run, single_run(PLAIN))
    assert sorted(event.step for event in scalars(run).Scalars("train/loss")) == [0, 1, 2, 3, 4]
