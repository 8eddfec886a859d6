"""``model.init_from``: the folder's tokenizer is the run's, and an empty folder name is no folder.

A folder's embedding rows stand for the tokens of its ``tokenizer.json``: a run that trains them with another
vocabulary (another 300-id tokenizer, or the byte tokenizer with ``model.vocab_size=300``) reads every row as
another token. Validation compares the two vocabularies as ``trainer.resume_from`` compares a checkpoint's
(``vocabulary_sha256``: the tokens and the end-of-document id, not the file's bytes or path) and refuses a
difference in one line naming both and the setting that would be right. A folder without ``tokenizer.json`` gives
nothing to compare (taken as it is, as a checkpoint saved before ppctl recorded its tokenizer); synthetic data has
no tokens. ``model.init_from=`` (an empty string, as an unset shell variable gives) is refused: ``null`` or no
setting is "no folder".
"""

import json
import os
import shutil

import pytest

from ppctl.config import ConfigError
from ppctl.resolve import compose_config, validate
from tests.harness.hf_models import GPT2, hf_config, overrides, save_numbered_tokenizer

VOCAB = 300


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny GPT-2 folder of a 300-id vocabulary with its own ``tokenizer.json``, and a text file to train on."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("init_from_tokenizer")
    config = hf_config(GPT2, False)
    config.vocab_size = VOCAB
    AutoModelForCausalLM.from_config(config).save_pretrained(root / "gpt2")
    save_numbered_tokenizer(root / "gpt2" / "tokenizer.json", "word", VOCAB)
    (root / "corpus.txt").write_text("word1 word2 word3\n")
    return root / "gpt2"


def _run(folder, *extra, start=None) -> list[str]:
    """A run on ``folder``'s text that starts from ``start`` (default: ``folder``; 300 ids), ``extra`` overrides."""
    return [*overrides(start or folder), "data=text", f"data.path={folder.parent / 'corpus.txt'}",
            f"data.cache_dir={folder.parent / 'cache'}", f"model.vocab_size={VOCAB}", *extra]


def _refusal(items) -> str:
    with pytest.raises(ConfigError) as caught:
        validate(compose_config(items))
    assert "\n" not in str(caught.value)
    return str(caught.value)


def test_another_tokenizer_of_as_many_ids_is_refused(folder, tmp_path):
    other = save_numbered_tokenizer(tmp_path / "other.json", "token", VOCAB)
    message = _refusal(_run(folder, f"data.tokenizer={other}"))
    assert message.startswith(f"model.init_from={folder}: its tokenizer.json is not this run's data.tokenizer="
                              f"{other} (as many ids, 300, other tokens): ")
    assert message.endswith(f"set data.tokenizer={folder / 'tokenizer.json'} (or start from a folder of this "
                            f"tokenizer)")


def test_the_folders_tokenizer_is_the_runs_by_default(folder):
    config = compose_config(_run(folder))
    assert config.data.tokenizer == str(folder / "tokenizer.json")
    validate(config)


def test_the_byte_tokenizer_beside_a_folders_tokenizer_is_refused(folder):
    message = _refusal(_run(folder, "data.tokenizer=byte"))  # 257 ids, within model.vocab_size=300
    assert message.startswith(f"model.init_from={folder}: its tokenizer.json is not this run's data.tokenizer=byte "
                              f"(300 ids in the folder's, 257 in the run's): each embedding row")
    assert f"set data.tokenizer={folder / 'tokenizer.json'}" in message


def test_the_folders_tokenizer_anywhere_is_accepted(folder, tmp_path):
    """The vocabulary decides, not the path or the file's formatting."""
    validate(compose_config(_run(folder, f"data.tokenizer={folder / 'tokenizer.json'}")))
    copy = tmp_path / "copy.json"
    copy.write_text(json.dumps(json.loads((folder / "tokenizer.json").read_text()), indent=2))
    validate(compose_config(_run(folder, f"data.tokenizer={copy}")))


def test_a_folder_without_a_tokenizer_or_synthetic_data_is_not_compared(folder, tmp_path):
    bare = shutil.copytree(folder, tmp_path / "bare", ignore=shutil.ignore_patterns("tokenizer.json"))
    validate(compose_config(_run(folder, start=bare)))
    validate(compose_config([*overrides(folder), f"model.vocab_size={VOCAB}"]))  # data=synthetic


def test_a_folders_unreadable_tokenizer_is_refused_by_name(folder, tmp_path):
    broken = shutil.copytree(folder, tmp_path / "broken")
    (broken / "tokenizer.json").write_text("{not json")
    message = _refusal(_run(folder, start=broken))
    assert message.startswith(f"model.init_from={broken}: its tokenizer.json is not a Hugging Face tokenizers file")
    (broken / "tokenizer.json").unlink()
    os.mkfifo(broken / "tokenizer.json")  # would block a read for ever
    assert _refusal(_run(folder, start=broken)) == (f"model.init_from={broken}: its tokenizer.json is not a regular "
                                                     f"file")


def test_a_resumed_run_does_not_compare_the_folders_tokenizer(folder, tmp_path):
    validate(compose_config(_run(folder, f"trainer.resume_from={tmp_path}")))


@pytest.mark.parametrize("value", ["", "''"])
def test_an_empty_init_from_is_refused(value):
    message = _refusal(["data=synthetic", f"model.init_from={value}"])
    assert message == ("model.init_from='' names no folder (an unset shell variable?): give a Hugging Face model "
                       "folder, or leave model.init_from out (null) to start from random values")


def test_a_null_init_from_is_no_folder():
    assert compose_config(["data=synthetic", "model.init_from=null"]).model.init_from is None
    validate(compose_config(["data=synthetic", "model.init_from=null"]))


def test_train_refuses_both_in_one_line_before_anything_starts(folder, tmp_path):
    """``ppctl train --dry-run`` in this process: exit 2, one line on stderr, no run directory."""
    from typer.testing import CliRunner

    from ppctl.cli.app import app

    byte = f"error: model.init_from={folder}: its tokenizer.json is not this run's data.tokenizer=byte "
    for items, expected in ((_run(folder, "data.tokenizer=byte"), byte),
                            (["data=synthetic", "model.init_from="], "error: model.init_from='' names no folder")):
        result = CliRunner().invoke(app, ["train", *items, f"trainer.out_dir={tmp_path / 'run'}", "--dry-run"])
        assert result.exit_code == 2 and result.stderr.startswith(expected), (result.stderr, result.exception)
        assert result.stderr.count("\n") == 1 and not (tmp_path / "run").exists()
