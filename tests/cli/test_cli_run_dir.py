"""The run directory and the config inputs: what `ppctl` refuses in one line before anything starts, and what works.

Five tiny real runs in all (2 workers, pp=2, 2 steps): one alone (``solo_run``, shared), a copy of it resumed and
then started over in place, and two at once into two run directories. The refusals (a fresh run over an earlier
run's checkpoints, the dry run too) and every config-input case (YAML and override syntax, a config tree of one
group file, an unknown key) run the Typer app in this process: each is refused or shown before any worker would
start, so it costs a config composition.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ppctl.checkpoint.files import read_index, latest_checkpoint
from ppctl.cli.app import app
from ppctl.run.rundir import committed_steps
from tests.cli.conftest import REPO, run_ppctl
from tests.cli.runs import assert_same_series, series

TINY = ["data=synthetic", "trainer.seq_length=16", "trainer.global_batch_size=8", "trainer.micro_batch_size=2",
        "trainer.max_steps=2", "trainer.log_every=1", "trainer.eval_every=0",
        "launcher.backend=gloo"]  # gloo: ppctl need not import torch to choose


def invoke(args: list[str]):
    """Run the CLI in this process; returns the result (exit code, stdout, stderr apart)."""
    return CliRunner().invoke(app, args)


def one_error_line(result) -> str:
    """The single stderr line of a refusal that exited 2, without its ``error: `` prefix."""
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == 2, (result.stdout, result.stderr, result.exception)
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0].removeprefix("error: ")


def digests(folder: Path) -> dict[str, str]:
    """Relative path -> SHA-256 of every file under ``folder``."""
    return {str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(folder.rglob("*")) if path.is_file()}


def workers_line(workers: int) -> str:
    """What the run banner says of the workers of this machine: ``2 workers x 1 thread``."""
    threads = max(1, len(os.sched_getaffinity(0)) // workers)
    return f"{workers} workers x {threads} thread{'s' if threads != 1 else ''}"


@pytest.fixture(scope="module")
def solo_run(tmp_path_factory):
    """A 2-step run alone in its run directory (with its checkpoint at step 2); returns (run dir, result)."""
    run = tmp_path_factory.mktemp("solo") / "run"
    result = run_ppctl("train", *TINY, f"trainer.out_dir={run}")
    assert result.returncode == 0, result.stderr[-3000:]
    return run, result


# --- the run directory ---------------------------------------------------------------------------------------

@pytest.mark.cli
@pytest.mark.timeout(400)
def test_a_fresh_run_over_an_earlier_runs_checkpoints_is_refused_until_overwrite(solo_run, tmp_path):
    """A fresh run into a run directory that holds checkpoints would start from step 0 and replace them: refused in
    one line (the dry run too) with nothing in the directory changed; resuming the run into itself still works, and
    ``trainer.overwrite=true`` deletes the old checkpoints (saying so) and starts over."""
    solo, _ = solo_run
    run = tmp_path / "run"
    shutil.copytree(solo, run)
    before = digests(run)
    assert "checkpoints/step_00000002/ppctl.json" in before and "checkpoints/latest" in before

    expected = (f"trainer.out_dir={run} already holds the checkpoints of a run (newest: step 2); this run starts from "
                f"step 0 and would replace them: continue that run with trainer.resume_from={run}, choose another "
                f"trainer.out_dir, or set trainer.overwrite=true to delete them and start over")
    assert one_error_line(invoke(["train", *TINY, f"trainer.out_dir={run}"])) == expected
    assert one_error_line(invoke(["train", "--dry-run", *TINY, f"trainer.out_dir={run}"])) == expected
    # resumed from another run's checkpoint, it would replace them all the same
    elsewhere = invoke(["train", *TINY, "trainer.max_steps=3", f"trainer.resume_from={solo}",
                        f"trainer.out_dir={run}"])
    assert f"this run resumes from {latest_checkpoint(solo).resolve()} and would replace them" in \
        one_error_line(elsewhere)
    # start over and continue at once contradict each other
    both = invoke(["train", *TINY, "trainer.max_steps=3", f"trainer.resume_from={run}", "trainer.overwrite=true"])
    assert one_error_line(both).startswith(f"trainer.overwrite=true would delete the checkpoints of "
                                           f"trainer.out_dir={run}, and this run resumes from one of them")
    assert digests(run) == before, "a refused run changed the run directory"

    # Continuing the run in place stays allowed: out_dir named explicitly (dry run), and the usual way (a real run).
    explicit = invoke(["train", "--dry-run", *TINY, "trainer.max_steps=3", f"trainer.out_dir={run}",
                       f"trainer.resume_from={run}"])
    assert explicit.exit_code == 0 and f"run directory: {run}" in explicit.stdout, explicit.stderr
    overwrite_dry = invoke(["train", "--dry-run", *TINY, f"trainer.out_dir={run}", "trainer.overwrite=true"])
    assert overwrite_dry.exit_code == 0, overwrite_dry.stderr
    assert (f"trainer.overwrite=true: would delete the earlier run's checkpoints and TensorBoard logs in {run}"
            in overwrite_dry.stdout)
    assert digests(run) == before, "a dry run changed the run directory"
    resumed = run_ppctl("train", *TINY, "trainer.max_steps=3", f"trainer.resume_from={run}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "at step 2" in resumed.stdout and committed_steps(run) == [2, 3]

    started_over = run_ppctl("train", *TINY, f"trainer.out_dir={run}", "trainer.overwrite=true")
    assert started_over.returncode == 0, started_over.stderr[-3000:]
    assert (f"trainer.overwrite=true: deleted the earlier run's checkpoints (newest: step 3) and TensorBoard logs in "
            f"{run}") in started_over.stderr.splitlines()
    assert committed_steps(run) == [2] and read_index(latest_checkpoint(run))["reason"] == "end"
    assert sorted(series(run, "train/loss")) == [0, 1]  # the old run's curves went with it
    assert_same_series(run, solo)  # from step 0, as the run alone


@pytest.mark.cli
@pytest.mark.timeout(400)
def test_two_runs_at_once_into_two_run_directories_both_train_as_one_alone(solo_run, tmp_path):
    """Two tiny runs at once on this machine (each its own rendezvous, its workers' threads from the cores): both
    end 0 with the losses of the run alone. The run banner says the workers and their threads."""
    solo, solo_result = solo_run
    assert f"run directory: {solo}  (train, gloo, 1 node(s), {workers_line(2)})" in solo_result.stderr
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    runs = [tmp_path / "a", tmp_path / "b"]
    processes = [subprocess.Popen([sys.executable, "-m", "ppctl.cli.app", "train", *TINY, f"trainer.out_dir={run}"],
                                  cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for run in runs]
    outputs = [process.communicate(timeout=300) for process in processes]
    for run, process, (_, stderr) in zip(runs, processes, outputs):
        assert process.returncode == 0, stderr[-3000:]
        assert f"run directory: {run}  (train, gloo, 1 node(s), {workers_line(2)})" in stderr
        assert_same_series(run, solo)


# --- the config inputs ---------------------------------------------------------------------------------------

def test_a_yaml_syntax_error_names_the_file_the_line_and_the_column(tmp_path):
    """A YAML error in the user's primary config or in a group file of the tree: one line with file, line, column."""
    (tmp_path / "model").mkdir()
    (tmp_path / "exp.yaml").write_text("defaults:\n  - config\n  - _self_\ntrainer:\n  max_steps: [1, 2\n")
    (tmp_path / "model" / "broken.yaml").write_text("name: broken\nnum_layers: 4\n  hidden_size: 32\n")
    assert one_error_line(invoke(["inspect-layout", "--config-dir", str(tmp_path), "--config-name", "exp"])) == (
        f"{tmp_path / 'exp.yaml'}, line 6, column 1: invalid YAML: expected ',' or ']', but got '<stream end>' "
        f"(while parsing a flow sequence that begins at line 5, column 14)")
    assert one_error_line(invoke(["inspect-layout", "--config-dir", str(tmp_path), "model=broken"])) == (
        f"{tmp_path / 'model' / 'broken.yaml'}, line 3, column 14: invalid YAML: mapping values are not allowed here")


@pytest.mark.parametrize("override, expected", [
    ("trainer.max_steps=[1,2", "override trainer.max_steps=[1,2: cannot parse it at column 23 (its end): no viable "
                               "alternative at input '[1,2'"),
    ("model={a: 1", "override model={a: 1: cannot parse it at column 12 (its end): no viable alternative at input "
                    "'{a: 1'"),
    ("trainer.max_steps=1]", "override trainer.max_steps=1]: cannot parse it at column 20: extraneous input ']' "
                             "expecting <EOF>"),
])
def test_an_override_that_does_not_parse_is_named_with_its_column(override, expected):
    line = one_error_line(invoke(["inspect-layout", override]))
    assert line.startswith(expected + " (the override grammar: https://hydra.cc/"), line


def test_a_config_tree_of_one_group_file_composes_on_ppcts_own(tmp_path):
    """``--config-dir DIR model=mine`` where DIR holds only ``model/mine.yaml``: ppctl's primary config and groups
    stay behind it. A missing ``--config-name`` is one line naming the file and the folder."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "mine.yaml").write_text("defaults:\n  - gpt_tiny\n  - _self_\nname: mine\nnum_layers: 8\n")
    shown = invoke(["inspect-layout", "--config-dir", str(tmp_path), "model=mine", "parallel.pp=4", "--json"])
    assert shown.exit_code == 0, shown.stderr
    layers = [stage["layers"] for stage in json.loads(shown.stdout)["layers"]]
    assert layers == [[0, 1], [2, 3], [4, 5], [6, 7]]  # its 8 layers, over ppctl's default 1f1b placement
    assert one_error_line(invoke(["inspect-layout", "--config-dir", str(tmp_path), "--config-name", "nosuch"])) == (
        f"--config-name nosuch: no nosuch.yaml in --config-dir {tmp_path}")


@pytest.mark.parametrize("override, expected", [
    ("+trainer.nosuchkey=1", "Key 'nosuchkey' not in 'TrainerConfig'"),
    ("trainer.nosuchkey=1", "Could not override 'trainer.nosuchkey': Key 'nosuchkey' not in 'TrainerConfig'"),
    ("model.num_layers=abc", "Error merging override model.num_layers=abc: Value 'abc' of type 'str' could not be "
                             "converted to Integer"),
])
def test_an_unknown_key_or_a_bad_value_is_said_once(override, expected):
    line = one_error_line(invoke(["inspect-layout", override]))
    assert line == expected and line.count("Key '") <= 1
