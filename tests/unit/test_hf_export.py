"""What ``ppctl export`` writes besides the weights: the run's tokenizer as transformers reads it, or a note.

A tokenizer file is copied as ``tokenizer.json`` with a ``tokenizer_config.json`` that makes ``AutoTokenizer``
read it as ppctl does (the same ids, its end-of-text token as ``eos_token``); a file changed since the
checkpoint, the byte tokenizer and synthetic data give a note instead. The weights writer shards above its
threshold (``tests/unit/test_hf_gpt.py`` loads the shards).
"""

from ppctl.checkpoint.hf_export import tokenizer_files, write_tokenizer
from ppctl.resolve import compose_config
from ppctl.data.tokenizer import build_tokenizer, tokenizer_record
from tests.unit.test_prepare_corpus import save_word_tokenizer

TEXT = "the cat sat on a mat"


def _config(tokenizer: str):
    return compose_config(["data=text", "data.path=/corpora/any.txt", f"data.tokenizer={tokenizer}"])


def _index(config) -> dict:
    return {"data": {"tokenizer": tokenizer_record(config.data)}}


def test_a_tokenizer_file_reads_in_transformers_as_in_ppctl(tmp_path):
    from transformers import AutoTokenizer

    path = save_word_tokenizer(tmp_path / "words.json", [TEXT], ["<|endoftext|>"])
    config = _config(str(path))
    tokenizer, notes = tokenizer_files(config, _index(config))
    assert notes == [] and tokenizer["eod_token"] == "<|endoftext|>"
    out = tmp_path / "out"
    out.mkdir()
    write_tokenizer(out, tokenizer, {"n_positions": 16})
    loaded = AutoTokenizer.from_pretrained(out)
    ours = build_tokenizer(str(path))
    assert loaded(TEXT, add_special_tokens=False)["input_ids"] == ours.encode(TEXT)
    assert loaded.eos_token_id == ours.eod_id == tokenizer["eod_id"]


def test_a_file_without_end_of_text_or_changed_since_says_so(tmp_path):
    path = save_word_tokenizer(tmp_path / "words.json", [TEXT], [])
    config = _config(str(path))
    index = _index(config)
    tokenizer, notes = tokenizer_files(config, index)
    assert tokenizer["eod_token"] is None and notes == [
        f"note: {path} has no end-of-text token; the end-of-document id {tokenizer['eod_id']} is ppctl's own, which "
        f"the copied tokenizer.json does not know"]
    save_word_tokenizer(path, ["one two six ten big red"], [])
    assert tokenizer_files(config, index) == (None, [
        f"note: the tokenizer file {path} is gone or changed since the checkpoint was saved: no tokenizer files "
        f"written"])


def test_the_byte_tokenizer_and_synthetic_data_write_no_tokenizer():
    byte = _config("byte")
    assert tokenizer_files(byte, _index(byte)) == ({"eod_id": 256}, [
        "note: data.tokenizer=byte (UTF-8 bytes, 256 = end of document) has no Hugging Face tokenizer file: no "
        "tokenizer files written"])
    assert tokenizer_files(compose_config(["data=synthetic"]), {}) == (
        None, ["note: synthetic data has no tokenizer: no tokenizer files written"])
