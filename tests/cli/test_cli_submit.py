"""``ppctl submit``, ``ppctl status`` and elastic restarts, without a Slurm cluster (tests/slurm has the real one).

Submitting writes the run directory whose resolved config the job's ``ppctl train --config-dir`` reads back
unchanged; ``ppctl submit prepare-data`` writes the job folder whose config every task of its array prepares from;
the refusals are one line each. An elastic restart (``launcher.max_restarts``) after a worker killed
on purpose resumes from the run's latest checkpoint and logs every step once, with the losses of one process.
"""

import json

import pytest
from typer.testing import CliRunner

from ppctl.cli.app import app
from ppctl.resolve import compose_config, load_config_file
from tests.cli.runs import assert_same_series, scalars

SMALL = ["data=synthetic", "trainer.seq_length=16", "trainer.global_batch_size=8", "trainer.log_every=1",
         "trainer.eval_every=0"]


def invoke(args, env=None):
    return CliRunner().invoke(app, args, env=env)


def test_submit_dry_run_writes_the_run_directory_the_job_trains_from(tmp_path, monkeypatch):
    run = tmp_path / "run"
    result = invoke(["submit", "launcher=slurm", *SMALL, "launcher.slurm.time=00:30:00", f"trainer.out_dir={run}",
                     "--dry-run"])
    assert result.exit_code == 0, result.output
    script = (run / "job.sbatch").read_text()
    assert result.stdout == script and "#SBATCH --time=00:30:00" in script
    assert f"train --config-dir {run} trainer.auto_resume=true" in script
    assert not (run / "job.json").exists(), "a dry run submits nothing"
    # The job's command composes the config submit resolved, key for key.
    assert compose_config([], config_dir=run) == load_config_file(run / "config.yaml")
    assert compose_config([], config_dir=run).trainer.max_steps == compose_config(SMALL).trainer.max_steps

    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    outside = invoke(["train", "--config-dir", str(run), "--dry-run"])
    assert outside.exit_code == 2 and "submit the run with ppctl submit" in outside.output
    inside = invoke(["train", "--config-dir", str(run), "trainer.auto_resume=true", "--dry-run"],
                    env={"SLURM_JOB_ID": "7"})
    assert inside.exit_code == 0 and f"run directory: {run}" in inside.output


def test_submit_is_submit_train_whatever_comes_first(tmp_path):
    for args in (["train", "launcher=slurm", *SMALL], ["--dry-run", "launcher=slurm", *SMALL]):
        run = tmp_path / args[0].strip("-")
        result = invoke(["submit", *args, f"trainer.out_dir={run}", "--dry-run"])
        assert result.exit_code == 0, result.output
        assert result.stdout == (run / "job.sbatch").read_text()
    listed = invoke(["submit", "--help"])
    assert listed.exit_code == 0 and "train" in listed.output and "prepare-data" in listed.output, listed.output


def test_submit_prepare_data_dry_run_writes_the_folder_every_task_prepares_from(tmp_path):
    corpus = tmp_path / "my corpus"  # a space: the path stays one value on its way to the tasks
    corpus.mkdir()
    for index in range(3):
        (corpus / f"part{index}.jsonl").write_text(json.dumps({"text": f"document {index}"}) + "\n")
    job = tmp_path / "job"
    overrides = ["launcher=slurm", "data=text", f"data.path='{corpus}/*.jsonl'", "data.num_proc=2",
                 "launcher.slurm.time=00:30:00", "launcher.slurm.gpus_per_node=8"]
    result = invoke(["submit", "prepare-data", *overrides, "--tasks", "3", "--out", str(job), "--dry-run"])
    assert result.exit_code == 0, result.output
    script = (job / "prepare.sbatch").read_text()
    assert result.stdout == script and sorted(path.name for path in job.iterdir()) == ["config.yaml", "prepare.sbatch"]
    lines = script.splitlines()
    assert {"#SBATCH --array=0-2", "#SBATCH --time=00:30:00", "#SBATCH --cpus-per-task=2"} <= set(lines)
    assert not any("gpus" in line for line in lines), "a preparation task asks for no GPUs"
    assert f'prepare-data --config-dir {job} --task "$SLURM_ARRAY_TASK_ID" --tasks 3' in script
    # Every task composes the config submit validated, key for key.
    assert compose_config([], config_dir=job) == compose_config(overrides)
    default = invoke(["submit", "prepare-data", *overrides, "parallel=tp2_pp2_dp2", "launcher.slurm.nodes=2",
                      "--out", str(tmp_path / "nodes"), "--dry-run"])
    assert default.exit_code == 0 and "#SBATCH --array=0-1" in default.stdout.splitlines(), default.output


@pytest.mark.parametrize("args, fragment", [
    (["--tasks", "0"], "--tasks 0: give the number of array tasks, a whole number of at least 1"),
    (["--tasks", "two"], "--tasks two: give the number of array tasks"),
    (["launcher=local"], "ppctl submit prepare-data hands the preparation to Slurm: add launcher=slurm"),
    (["data=synthetic"], "data.source=synthetic needs no preparation: there is nothing to submit"),
    (["data=prompt_completion", "data.path={tmp_path}/rows.jsonl"], "shares a text corpus's shards among its tasks "
     "(data=text or python_stdlib); prepare data.source=prompt_completion with ppctl prepare-data"),
    (["launcher.slurm.time=soon"], "launcher.slurm.time='soon' must be a"),
    (["--out", "{tmp_path}"], "holds files already: give each job a folder of its own"),
    (["--out", "{tmp_path}/corpus.txt"], "corpus.txt: not a folder"),
])
def test_submit_prepare_data_refusals_are_one_line(args, fragment, tmp_path):
    (tmp_path / "corpus.txt").write_text("one document\n")
    (tmp_path / "rows.jsonl").write_text('{"prompt": "2 + 2 =", "completion": " 4"}\n')
    args = [arg.replace("{tmp_path}", str(tmp_path)) for arg in args]
    result = invoke(["submit", "prepare-data", "launcher=slurm", "data=text", f"data.path={tmp_path}/corpus.txt",
                     *args])
    assert result.exit_code == 2 and fragment in result.output and result.output.count("\n") == 1, result.output


@pytest.mark.parametrize("args, fragment", [
    (["submit", *SMALL], "ppctl submit hands the run to Slurm: add launcher=slurm"),
    (["submit", "launcher=slurm", "launcher.slurm.time=soon", *SMALL], "launcher.slurm.time='soon' must be a"),
    (["submit", "launcher=slurm", "launcher.slurm.partition='gpu\ntouch pwned'", *SMALL],
     "launcher.slurm.partition='gpu\\ntouch pwned' holds the control character '\\n'"),
    (["submit", "launcher=slurm", "launcher.slurm.time=00:01:00", *SMALL],
     "launcher.slurm.signal_lead_s=120 is not shorter than launcher.slurm.time=00:01:00 (60 s)"),
])
def test_submit_refusals_are_one_line(args, fragment):
    result = invoke(args)
    assert result.exit_code == 2 and fragment in result.output and result.output.count("\n") == 1, result.output


@pytest.mark.parametrize("record, fragment", [
    ('{"job_id": "12', "cannot read the job record ppctl submit writes (Unterminated string"),
    ("[1, 2]", "not the job record ppctl submit writes (a JSON object with a job_id, got list [1, 2])"),
    ('{"job": 3}', "got dict"),
    ('{"job_id": ""}', "got dict"),
])
@pytest.mark.parametrize("as_json", [[], ["--json"]])
def test_status_of_a_damaged_job_record_is_one_line(record, fragment, as_json, tmp_path):
    run = tmp_path / "run"
    assert invoke(["submit", "launcher=slurm", *SMALL, f"trainer.out_dir={run}", "--dry-run"]).exit_code == 0
    (run / "job.json").write_text(record)
    result = invoke(["status", str(run), *as_json])
    assert result.exit_code == 2 and result.output.count("\n") == 1, result.output
    assert result.output.startswith(f"error: {run / 'job.json'}: ") and fragment in result.output, result.output


def test_status_of_a_damaged_config_is_one_line(tmp_path):
    run = tmp_path / "run"
    assert invoke(["submit", "launcher=slurm", *SMALL, f"trainer.out_dir={run}", "--dry-run"]).exit_code == 0
    (run / "config.yaml").write_text("trainer: [1,\n")
    result = invoke(["status", str(run)])
    assert result.exit_code == 2 and result.output.count("\n") == 1, result.output
    assert f"{run / 'config.yaml'}: not the config a run wrote" in result.output


@pytest.mark.parametrize("command", ["status", "checkpoints"])
def test_a_folder_that_is_no_run_is_refused(command, tmp_path):
    result = invoke([command, str(tmp_path)])
    assert result.exit_code == 2 and result.output.count("\n") == 1, result.output
    assert f"{tmp_path}: not a run directory (no config.yaml or checkpoints folder in it)" in result.output


def test_submit_without_sbatch_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no Slurm client here
    result = invoke(["submit", "launcher=slurm", *SMALL, f"trainer.out_dir={tmp_path / 'run'}"])
    assert result.exit_code == 1 and "sbatch: command not found" in result.output


@pytest.mark.cli
@pytest.mark.timeout(300)
def test_an_elastic_restart_resumes_from_the_latest_checkpoint_and_trains_like_one_process(ppctl, single_run,
                                                                                              tmp_path):
    common = [*SMALL, "trainer.max_steps=5", "trainer.save_every=2"]
    single_run.start(common)  # trains beside the run below, which waits on its restart
    run = tmp_path / "run"
    result = ppctl("train", *common, "launcher.max_restarts=1", "launcher.inject_fault=0:kill@3",
                   f"trainer.out_dir={run}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("step     3/5 | loss") == 2, "step 3 runs in the failed attempt and again"
    assert f"resumed from {run / 'checkpoints' / 'step_00000002'} at step 2" in result.stdout
    assert_same_series(run, single_run(common))
    assert sorted(event.step for event in scalars(run).Scalars("train/loss")) == [0, 1, 2, 3, 4]

    status = invoke(["status", str(run), "--json"])
    assert status.exit_code == 0, status.output
    report = json.loads(status.output)
    assert report["job"] is None and report["last_step"] == 5 and report["max_steps"] == 5
    assert report["latest_checkpoint"] == {"path": str(run / "checkpoints" / "step_00000005"), "step": 5}
    assert "last logged step: 5/5, loss" in invoke(["status", str(run)]).output
