"""End to end: train from a Hugging Face folder at tp=2 pp=2 dp=2, export the trained run, load it in transformers.

One launch (8 workers, float64) starts a tiny tied GPT-2 (``tests/harness/hf_models.py``) with
``model.init_from``, trains 3 steps and takes the validation loss after them. Its logged loss of step 0
(the folder's weights) must be transformers' cross-entropy on the same batch, and the export of its
checkpoint, loaded by ``AutoModelForCausalLM``, must give the logged validation loss on the validation
batch (both logged as float32: 1e-7 relative, measured 5e-8 and 5e-9). The refusals of ``ppctl export`` and
of an ``init_from`` that does not fit end in one line, exit 2, before anything starts.
"""

import json
from pathlib import Path

import pytest

from tests.cli.runs import series
from tests.harness.hf_models import GPT2, STARCODER2, batch_loss, hf_model, overrides, save_tiny, step_batch

pytestmark = [pytest.mark.cli, pytest.mark.timeout(400)]

LAYOUT = ["parallel.tp=2", "parallel.pp=2", "parallel.dp=2", "trainer.precision=fp64", "trainer.max_steps=3",
          "trainer.log_every=1", "trainer.eval_every=3", "trainer.eval_iters=1", "trainer.tensorboard=true"]
LOGGED = 1e-7  # TensorBoard keeps float32: its rounding, at most 2**-24 relative


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """``(the HF folder, the run directory, its config)`` of one launch from the folder."""
    from ppctl.config import load_config_file
    from tests.cli.conftest import run_ppctl

    root = tmp_path_factory.mktemp("hf_cli")
    folder = save_tiny(root / "gpt2", GPT2, tie=True)
    run = root / "run"
    result = run_ppctl("train", *overrides(folder, GPT2, True), *LAYOUT, f"trainer.out_dir={run}")
    assert result.returncode == 0, result.stderr[-3000:]
    return folder, run, load_config_file(run / "config.yaml")


def test_the_first_logged_loss_is_transformers_cross_entropy_of_the_folder(trained):
    folder, run, config = trained
    assert config.model.init_from == str(folder)
    expected = batch_loss(hf_model(folder), step_batch(config, 0))
    assert series(run, "train/loss")[0] == pytest.approx(expected, rel=LOGGED)


def test_the_export_of_the_trained_run_gives_its_validation_loss_in_transformers(ppctl, trained, tmp_path):
    _folder, run, config = trained
    out = tmp_path / "exported"
    result = ppctl("export", str(run), str(out))
    assert result.returncode == 0, result.stderr
    assert result.stderr == "note: synthetic data has no tokenizer: no tokenizer files written\n"
    assert sorted(path.name for path in out.iterdir()) == ["config.json", "generation_config.json",
                                                           "model.safetensors"]
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True
    validation = step_batch(config, 0, split="validation")
    assert series(run, "val/loss")[2] == pytest.approx(batch_loss(hf_model(out), validation), rel=LOGGED)


def test_export_refusals_are_one_line(ppctl, trained, tmp_path):
    _folder, run, _config = trained
    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "keep.txt").write_text("mine")
    cases = [
        ((str(run), str(occupied)), f"error: {occupied} exists and is not empty: choose a new folder (nothing is "
                                    f"replaced)"),
        ((str(run), "--step", "7", str(tmp_path / "a")), f"error: {run}: no checkpoint at step 7 (complete "
                                                         f"checkpoints at steps: 3)"),
        ((str(tmp_path / "nowhere"), str(tmp_path / "b")), f"error: {tmp_path / 'nowhere'}: no such run directory"),
    ]
    for args, expected in cases:
        result = ppctl("export", *args)
        assert result.returncode == 2 and result.stderr == expected + "\n", (args, result.stderr)
    assert (occupied / "keep.txt").read_text() == "mine" and not (tmp_path / "a").exists()


def test_an_init_from_that_does_not_fit_is_refused_before_anything_starts(ppctl, tmp_path):
    folder = save_tiny(tmp_path / "starcoder2", STARCODER2)
    result = ppctl("train", *overrides(folder, GPT2), f"trainer.out_dir={tmp_path / 'run'}", "--dry-run")
    assert result.returncode == 2 and result.stderr == (
        f"error: model.init_from={folder}: its config.json is Starcoder2ForCausalLM (model.position_embedding=rope), "
        f"this run has model.position_embedding=learned\n"), result.stderr
    assert not (tmp_path / "run").exists()


def test_a_run_dir_without_checkpoints_exports_nothing(ppctl, tmp_path):
    run = tmp_path / "empty_run"
    run.mkdir()
    (run / "config.yaml").write_text("model: {}\n")
    result = ppctl("export", str(run), str(tmp_path / "out"))
    assert result.returncode == 2
    assert result.stderr == f"error: {run}: no complete checkpoint (complete checkpoints at steps: none)\n"
    assert not Path(tmp_path / "out").exists()
