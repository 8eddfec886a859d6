"""End to end: train from a Hugging Face folder at tp=2 pp=2 dp=2, export the trained run, load it in transformers.

One ``ppctl train`` launch (8 workers, float64): an untied Llama with grouped-query attention (4 query heads on
2 key/value heads: one per TP rank; ``tests/harness/hf_models.py``) starts with ``model.init_from`` and no other
model key (the folder's ``config.json`` gives the family and the shape; its ``config.yaml`` says so), trains 3
steps and takes the validation loss after them. Its logged loss of step 0 (the folder's weights) must be
transformers' cross-entropy on the same batch, and the export of its checkpoint (``ppctl export``), loaded by
``AutoModelForCausalLM``, must give the logged validation loss on the validation batch (both logged as float32:
1e-7 relative; measured 1e-8 and 4e-8; the export with k and v swapped gives 4e-3, with q and k swapped
transformers refuses it). GPT-2 and StarCoder2 make the same round trip at tp=2 pp=2 and pp=2 dp=2 in
``tests/distributed/test_hf_equivalence.py`` (their logits and loss, the export's bytes at two layouts, the
export reloaded), in the suite's worker pools rather than a launch of their own. The exports and the
refusals (of ``ppctl export``, and of an ``init_from`` that does not fit: one line, exit 2, before anything
starts) run the Typer app in this process: each costs its command, not a Python start and torch's import.
"""

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.cli.runs import series
from tests.harness.hf_models import (GPT2, LLAMA, STARCODER2, batch_loss, folder_overrides, hf_model, overrides,
                                     save_tiny, step_batch)

pytestmark = [pytest.mark.cli, pytest.mark.timeout(400)]

LAYOUT = ["parallel.tp=2", "parallel.pp=2", "parallel.dp=2", "trainer.precision=fp64", "trainer.max_steps=3",
          "trainer.log_every=1", "trainer.eval_every=3", "trainer.eval_iters=1", "trainer.tensorboard=true"]
TIED = {LLAMA: False}
LOGGED = 1e-7  # TensorBoard keeps float32: its rounding, at most 2**-24 relative


def _invoke(*args: str):
    """``ppctl ARGS`` in this process: the result (exit code, stdout, stderr apart)."""
    from ppctl.cli.app import app

    return CliRunner().invoke(app, list(args))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """``{architecture: (the HF folder, the run directory, its config)}``: one launch from each folder."""
    from ppctl.resolve import load_config_file
    from tests.cli.conftest import run_ppctl

    runs = {}
    for architecture, tie in TIED.items():
        root = tmp_path_factory.mktemp(f"hf_cli_{architecture}")
        folder = save_tiny(root / architecture, architecture, tie)
        run = root / "run"
        result = run_ppctl("train", *folder_overrides(folder), *LAYOUT, f"trainer.out_dir={run}")  # no model key
        assert result.returncode == 0, result.stderr[-3000:]
        runs[architecture] = folder, run, load_config_file(run / "config.yaml")
    return runs


@pytest.mark.parametrize("architecture", TIED)
def test_the_first_logged_loss_is_transformers_cross_entropy_of_the_folder(trained, architecture):
    folder, run, config = trained[architecture]
    assert config.model.init_from == str(folder)
    expected = batch_loss(hf_model(folder), step_batch(config, 0))
    assert series(run, "train/loss")[0] == pytest.approx(expected, rel=LOGGED)


def test_the_run_trained_the_folders_model(trained):
    folder, _run, config = trained[LLAMA]
    assert (config.model.family, config.model.name, config.model.num_kv_heads) == ("llama", LLAMA, 2)
    assert config.model.tie_embeddings is TIED[LLAMA]


@pytest.mark.parametrize("architecture", TIED)
def test_the_export_of_the_trained_run_gives_its_validation_loss_in_transformers(trained, tmp_path, architecture):
    _folder, run, config = trained[architecture]
    out = tmp_path / "exported"
    result = _invoke("export", str(run), str(out))
    assert result.exit_code == 0, (result.stderr, result.exception)
    assert result.stderr == "note: synthetic data has no tokenizer: no tokenizer files written\n"
    assert sorted(path.name for path in out.iterdir()) == ["config.json", "generation_config.json",
                                                           "model.safetensors"]
    exported = json.loads((out / "config.json").read_text())
    assert exported["tie_word_embeddings"] is TIED[architecture] and exported["model_type"] == architecture
    validation = step_batch(config, 0, split="validation")
    assert series(run, "val/loss")[2] == pytest.approx(batch_loss(hf_model(out), validation), rel=LOGGED)


def test_export_refusals_are_one_line(trained, tmp_path):
    _folder, run, _config = trained[LLAMA]
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
        result = _invoke("export", *args)
        assert result.exit_code == 2 and result.stderr == expected + "\n", (args, result.stderr)
    assert (occupied / "keep.txt").read_text() == "mine" and not (tmp_path / "a").exists()


def test_an_init_from_that_does_not_fit_is_refused_before_anything_starts(tmp_path):
    folder = save_tiny(tmp_path / "starcoder2", STARCODER2)
    result = _invoke("train", *overrides(folder, GPT2), f"trainer.out_dir={tmp_path / 'run'}", "--dry-run")
    assert result.exit_code == 2 and result.stderr == (
        f"error: model.init_from={folder}: its config.json is Starcoder2ForCausalLM (model.position_embedding=rope), "
        f"this run has model.position_embedding=learned\n"), result.stderr
    assert not (tmp_path / "run").exists()


def test_a_gpt2_folder_alone_is_a_run(tmp_path):
    """``ppctl train model.init_from=DIR --dry-run`` with no model key: the folder's model at tp=2 pp=2."""
    folder = save_tiny(tmp_path / "gpt2", GPT2)
    result = _invoke("train", *folder_overrides(folder), "parallel.tp=2", "parallel.pp=2",
                     f"trainer.out_dir={tmp_path / 'run'}", "--dry-run")
    assert result.exit_code == 0, (result.stderr, result.exception)
    assert result.stdout.startswith(f"run directory: {tmp_path / 'run'}  (train, gloo, 1 node(s), 4 workers")
    refused = _invoke("train", *folder_overrides(folder), "model.num_heads=2", "--dry-run")
    assert refused.exit_code == 2 and refused.stderr == (
        f"error: model.init_from={folder}: its config.json gives model.num_heads=4, this run has model.num_heads=2\n")


def test_a_run_dir_without_checkpoints_exports_nothing(tmp_path):
    run = tmp_path / "empty_run"
    run.mkdir()
    (run / "config.yaml").write_text("model: {}\n")
    result = _invoke("export", str(run), str(tmp_path / "out"))
    assert result.exit_code == 2
    assert result.stderr == f"error: {run}: no complete checkpoint (complete checkpoints at steps: none)\n"
    assert not Path(tmp_path / "out").exists()
