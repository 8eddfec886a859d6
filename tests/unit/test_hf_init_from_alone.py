"""``model.init_from=DIR`` alone: a Hugging Face folder gives the run its model and its tokenizer.

For a tiny Llama (with a ``tokenizer.json``) and a tiny GPT-2 (without one) that transformers saved, composition
with no model key but ``model.init_from`` gives every model key the folder's ``config.json`` gives (the same config
as the run that writes every shape key out, ``overrides``), and validation accepts it. A model key the user sets
(on the command line or in a config file of their tree) that agrees with the folder is accepted; one that does not
is refused in one line naming both values; so is a model preset chosen explicitly (``model=llama_tiny``). The
folder's ``tokenizer.json`` is the run's ``data.tokenizer`` unless another is set. The run directory's
``config.yaml`` holds the resolved shape: a resume composed from it (``trainer.resume_from``, or
``trainer.auto_resume`` where the run directory holds a checkpoint) reads no folder (the folder renamed away).
"""

import json

import pytest

from ppctl.config import ConfigError
from ppctl.resolve import compose_config, load_config_file, to_yaml, validate
from ppctl.model.hf_format import folder_model, run_setting
from tests.harness.hf_models import (GPT2, HIDDEN, LLAMA, VOCAB, folder_overrides, overrides, save_numbered_tokenizer,
                                     save_tiny)

ARCHITECTURES = (LLAMA, GPT2)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """``{architecture: folder}``: the tiny Llama with a tokenizer of its vocabulary, the tiny GPT-2 without one."""
    root = tmp_path_factory.mktemp("init_from_alone")
    saved = {architecture: save_tiny(root / architecture, architecture) for architecture in ARCHITECTURES}
    save_numbered_tokenizer(saved[LLAMA] / "tokenizer.json", "word", VOCAB)
    return saved


def _refusal(items, config_dir=None) -> str:
    with pytest.raises(ConfigError) as caught:
        validate(compose_config(items, config_dir))
    assert "\n" not in str(caught.value)
    return str(caught.value)


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_the_folder_alone_gives_every_model_key_its_config_json_gives(folders, architecture):
    folder = folders[architecture]
    config = compose_config(folder_overrides(folder))
    validate(config)
    _family, _hf_config, settings = folder_model(folder)
    assert {key: run_setting(config.model, key) for key in settings} == settings
    written_out = compose_config(overrides(folder, architecture))  # every shape key on the command line
    assert config.model.family == written_out.model.family == ("llama" if architecture == LLAMA else "gpt")
    assert vars(config.model) == {**vars(written_out.model), "name": architecture}
    hf_config = json.loads((folder / "config.json").read_text())
    assert config.model.hidden_size == HIDDEN == hf_config.get("hidden_size", hf_config.get("n_embd"))


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_a_model_key_that_agrees_is_accepted_and_one_that_does_not_is_refused(folders, architecture):
    folder = folders[architecture]
    validate(compose_config([*folder_overrides(folder), f"model.hidden_size={HIDDEN}", "model.num_layers=4"]))
    assert _refusal([*folder_overrides(folder), "model.hidden_size=64"]) == (
        f"model.init_from={folder}: its config.json gives model.hidden_size={HIDDEN}, this run has "
        f"model.hidden_size=64")


def test_a_model_preset_chosen_explicitly_is_checked_against_the_folder(folders):
    assert _refusal([*folder_overrides(folders[LLAMA]), "model=llama_tiny"]) == (
        f"model.init_from={folders[LLAMA]}: its config.json gives model.hidden_size={HIDDEN}, this run has "
        f"model.hidden_size=64")
    assert _refusal([*folder_overrides(folders[GPT2]), "model=llama_tiny"]) == (
        f"model.init_from={folders[GPT2]}: its config.json is GPT2LMHeadModel (model.family=gpt), this run has "
        f"model.family=llama")


def test_a_model_key_a_config_file_sets_is_checked_against_the_folder(folders, tmp_path):
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "config.yaml").write_text("defaults:\n  - ppctl_config\n  - _self_\nmodel:\n  num_layers: 2\n")
    assert _refusal(folder_overrides(folders[LLAMA]), tree) == (
        f"model.init_from={folders[LLAMA]}: its config.json gives model.num_layers=4, this run has model.num_layers=2")


def test_the_folders_tokenizer_is_the_default_and_a_folder_without_one_keeps_the_byte_tokenizer(folders):
    assert compose_config(folder_overrides(folders[LLAMA])).data.tokenizer == str(folders[LLAMA] / "tokenizer.json")
    assert compose_config(folder_overrides(folders[GPT2])).data.tokenizer == "byte"
    set_by_the_user = compose_config([*folder_overrides(folders[LLAMA]), "data.tokenizer=byte"])
    assert set_by_the_user.data.tokenizer == "byte"


def test_a_folder_that_cannot_be_read_is_refused_naming_init_from(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(ConfigError) as caught:
        compose_config(folder_overrides(missing))
    assert str(caught.value) == f"model.init_from={missing}: no such folder"


def test_a_resume_from_the_run_directorys_config_reads_no_folder(folders, tmp_path):
    folder = folders[LLAMA]
    started = compose_config(folder_overrides(folder))
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(to_yaml(started))
    (run / "checkpoints").mkdir()
    (run / "checkpoints" / "latest").write_text("step_00000002\n")
    folder.rename(tmp_path / "gone")
    try:
        resumed = compose_config([f"trainer.resume_from={run}"], run)
        validate(resumed)
        assert vars(resumed.model) == vars(started.model) == vars(load_config_file(run / "config.yaml").model)
        requeued = compose_config(["trainer.auto_resume=true", f"trainer.out_dir={run}"], run)  # a requeued job
        validate(requeued)
        assert vars(requeued.model) == vars(started.model)
        (run / "checkpoints" / "latest").unlink()  # a first start reads the folder
        assert _refusal(["trainer.auto_resume=true", f"trainer.out_dir={run}"], run) == (
            f"model.init_from={folder}: no such folder")
    finally:
        (tmp_path / "gone").rename(folder)
