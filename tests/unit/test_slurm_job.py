"""The Slurm side of ``ppctl submit`` without a cluster: the composed settings, the job scripts it writes (a
training run's, and ``submit prepare-data``'s job array, each checked by bash's own parser), and how a job's
state is read."""

import subprocess
from pathlib import Path

import pytest

from ppctl.resolve import compose_config, validate
from ppctl.run.slurm import job_script, sbatch_options, train_command
from ppctl.run.slurm_prepare import prepare_command, prepare_options, prepare_script

RUN_DIR = Path("/shared/runs/r1")
JOB_DIR = Path("/shared/runs/prepare-1")
PPCTL = ["/opt/venv/bin/ppctl"]


def slurm_config(*overrides: str):
    config = compose_config(["launcher=slurm", "data=synthetic", *overrides])
    validate(config)
    return config


def test_slurm_nodes_set_the_nodes_torchrun_spans():
    config = slurm_config("parallel=tp2_pp2_dp2", "launcher.slurm.nodes=2")
    assert config.launcher.nnodes == 2 and config.launcher.kind == "slurm"


def test_options_name_only_what_is_set_and_keep_one_log_across_requeues():
    options = sbatch_options(slurm_config("launcher.slurm.partition=gpu", "launcher.slurm.time=1-00:00:00",
                                          "launcher.slurm.gpus_per_node=2", "launcher.slurm.extra_args=[--exclusive]"),
                             RUN_DIR)
    assert options == ["--job-name=ppctl-r1", "--nodes=1", "--ntasks-per-node=1",
                       "--output=/shared/runs/r1/slurm-%j.out", "--open-mode=append", "--signal=B:TERM@120",
                       "--requeue", "--partition=gpu", "--time=1-00:00:00", "--gpus-per-node=2", "--exclusive"]
    quiet = sbatch_options(slurm_config("launcher.slurm.requeue=false", "launcher.slurm.signal_lead_s=300"), RUN_DIR)
    assert "--no-requeue" in quiet and "--signal=B:TERM@300" in quiet and not any("partition" in o for o in quiet)


def test_each_node_runs_ppctl_train_on_the_run_directory_continuing_it():
    one_node = train_command(slurm_config(), RUN_DIR, PPCTL)
    assert one_node == "/opt/venv/bin/ppctl train --config-dir /shared/runs/r1 trainer.auto_resume=true"
    two_nodes = train_command(slurm_config("parallel=tp2_pp2_dp2", "launcher.slurm.nodes=2"), RUN_DIR, PPCTL)
    assert ('launcher.node_rank="$SLURM_NODEID" launcher.rdzv_endpoint="$head_node:$port" '
            'launcher.rdzv_id="ppctl-$SLURM_JOB_ID"') in two_nodes


@pytest.mark.parametrize("overrides", [[], ["parallel=tp2_pp2_dp2", "launcher.slurm.nodes=2"],
                                       ["launcher.slurm.requeue=false"]])
def test_the_script_parses_and_requeues_only_when_asked(overrides, tmp_path):
    config = slurm_config(*overrides)
    script = job_script(config, RUN_DIR, Path("/home/me/project"), PPCTL)
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    checked = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stderr
    assert script.startswith("#!/bin/bash\n") and "cd /home/me/project" in script
    assert ("scontrol requeue" in script) == config.launcher.slurm.requeue
    assert ("head_node=$(scontrol show hostnames" in script) == (config.launcher.nnodes > 1)
    # Every #SBATCH line comes before the first command: sbatch reads no option after it.
    lines = script.splitlines()
    first_command = next(i for i, line in enumerate(lines) if line and not line.startswith("#"))
    assert all(not line.startswith("#SBATCH") for line in lines[first_command:])


def test_a_prepare_array_asks_for_a_cpu_node_per_task_and_the_allocation_of_the_training_job():
    config = slurm_config("launcher.slurm.partition=cpu", "launcher.slurm.account=lab", "launcher.slurm.time=02:00:00",
                          "launcher.slurm.gpus_per_node=8", "data.num_proc=16",
                          "launcher.slurm.extra_args=['--mem=64G']")
    assert prepare_options(config, JOB_DIR, 3) == [
        "--job-name=ppctl-prepare-1", "--array=0-2", "--nodes=1", "--ntasks=1",
        "--output=/shared/runs/prepare-1/prepare-%A_%a.out", "--open-mode=append", "--signal=B:TERM@120",
        "--requeue", "--partition=cpu", "--account=lab", "--time=02:00:00", "--cpus-per-task=16", "--mem=64G"]
    own_cpus = prepare_options(slurm_config("data.num_proc=16", "launcher.slurm.cpus_per_task=4",
                                            "launcher.slurm.requeue=false"), JOB_DIR, 1)
    assert "--array=0-0" in own_cpus and "--cpus-per-task=4" in own_cpus and "--no-requeue" in own_cpus
    assert not any(option.startswith("--cpus-per-task") for option in prepare_options(slurm_config(), JOB_DIR, 2))


def test_each_array_task_runs_prepare_data_on_the_job_folders_config_with_its_own_index():
    assert prepare_command(JOB_DIR, 3, PPCTL) == ('/opt/venv/bin/ppctl prepare-data --config-dir '
                                                  '/shared/runs/prepare-1 --task "$SLURM_ARRAY_TASK_ID" --tasks 3')


@pytest.mark.parametrize("overrides", [[], ["launcher.slurm.requeue=false"]])
def test_the_prepare_script_parses_and_requeues_only_when_asked(overrides, tmp_path):
    config = slurm_config(*overrides)
    script = prepare_script(config, JOB_DIR, Path("/home/me/project"), 3, PPCTL)
    path = tmp_path / "prepare.sbatch"
    path.write_text(script)
    checked = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stderr
    assert script.startswith("#!/bin/bash\n") and "cd /home/me/project" in script
    assert "#SBATCH --array=0-2" in script.splitlines()
    assert ("scontrol requeue" in script) == config.launcher.slurm.requeue
    lines = script.splitlines()
    first_command = next(i for i, line in enumerate(lines) if line and not line.startswith("#"))
    assert all(not line.startswith("#SBATCH") for line in lines[first_command:])


@pytest.mark.parametrize("write_script, job_id", [
    (lambda directory: job_script(slurm_config(), RUN_DIR, directory, PPCTL), "42"),
    (lambda directory: prepare_script(slurm_config(), JOB_DIR, directory, 3, PPCTL), "40_2"),
], ids=["train", "prepare"])
def test_a_stop_signal_reaches_the_step_and_a_saved_stop_requeues(write_script, job_id, tmp_path):
    """The script run by bash with stand-ins for srun, scancel and scontrol: SIGTERM to the batch shell becomes
    ``scancel --signal=TERM`` of the job's step, whose exit status 143 (stopped after saving, or after keeping its
    finished shards) makes the script requeue its job. An array's task names itself ``<array id>_<index>``: its
    ``$SLURM_JOB_ID`` may be the array's id, which Slurm's commands take as every task."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text("#!/bin/bash\necho $$ > \"$LOG.step\"\n"
                                  "trap 'echo step got TERM >> \"$LOG\"; exit 143' TERM\n"
                                  "echo step started >> \"$LOG\"\nsleep 30 & wait\n")
    (bin_dir / "scancel").write_text("#!/bin/bash\necho scancel \"$@\" >> \"$LOG\"\nkill -TERM $(cat \"$LOG.step\")\n")
    (bin_dir / "scontrol").write_text("#!/bin/bash\necho scontrol \"$@\" >> \"$LOG\"\n")
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    script = tmp_path / "job.sbatch"
    script.write_text(write_script(tmp_path))
    log = tmp_path / "log"
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "LOG": str(log), "SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "n1",
           "SLURM_ARRAY_JOB_ID": "40", "SLURM_ARRAY_TASK_ID": "2"}
    job = subprocess.Popen(["bash", str(script)], env=env, stdout=subprocess.PIPE, text=True)
    _wait_for(lambda: log.exists() and "step started" in log.read_text())
    job.terminate()  # what --signal=B:TERM does
    assert job.wait(timeout=20) == 143
    assert log.read_text().splitlines() == ["step started", f"scancel --signal=TERM {job_id}", "step got TERM",
                                            f"scontrol requeue {job_id}"]


def _wait_for(condition, timeout_s: float = 20.0) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)
