"""Real corpora: file types, folders and globs, text fields, tokenizer files, the vocabulary, the cache, the splits."""

import json
import multiprocessing
import os
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

from ppctl.config import ConfigError, DataConfig, ModelConfig, PpctlConfig, fill_unset  # noqa: E402
from ppctl.resolve import compose_config, to_yaml, validate  # noqa: E402
from ppctl.data import cache as cache_module  # noqa: E402
from ppctl.data import prepare as prepare_module  # noqa: E402
from ppctl.data import tokenise as tokenise_module  # noqa: E402
from ppctl.data import utf8 as utf8_module  # noqa: E402
from ppctl.data.cache import split_bounds, token_dtype_for  # noqa: E402
from ppctl.data.corpus import CorpusSpec, DataError, looks_like_hub_name, resolve_corpus  # noqa: E402
from ppctl.data.dataset import SYNTHETIC_VALIDATION_SAMPLES, build_dataset  # noqa: E402
from ppctl.data.prepare import prepare_corpus  # noqa: E402
from ppctl.data.tokenise import tokenise_texts  # noqa: E402
from ppctl.data.tokenizer import build_tokenizer  # noqa: E402

DOCUMENTS = ["first document", "the second one, héllo ✓", "third"]


def byte_stream(documents: list[str]) -> list[int]:
    """The byte tokenizer's token stream of ``documents``: each one's bytes, then 256."""
    return [token for text in documents for token in [*text.encode("utf-8"), 256]]


def write_corpus(folder: Path, file_type: str, documents=DOCUMENTS, field: str = "text") -> Path:
    """Write ``documents`` as one file of ``file_type`` (``.txt``: one file per document); return its path."""
    folder.mkdir(parents=True, exist_ok=True)
    if file_type == "txt":
        for number, text in enumerate(documents):
            (folder / f"doc{number}.txt").write_text(text)
        return folder
    path = folder / f"corpus.{file_type}"
    records = [{field: text, "id": number} for number, text in enumerate(documents)]
    if file_type == "jsonl":
        path.write_text("".join(json.dumps(record) + "\n" for record in records))
    elif file_type == "json":
        path.write_text(json.dumps(records))
    else:
        import pandas

        frame = pandas.DataFrame(records)
        frame.to_parquet(path) if file_type == "parquet" else frame.to_csv(path, index=False)
    return path


def tokens_of(prepared) -> list[int]:
    return prepared.tokens()[:].tolist()


def prepare(path, cache_dir, **options):
    return prepare_corpus(CorpusSpec("text", str(path), cache_dir, **options))


def save_word_tokenizer(path: Path, words: list[str], special_tokens: list[str]) -> Path:
    """A tiny WordLevel ``tokenizers`` file trained on ``words``; return its path."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(words, trainers.WordLevelTrainer(special_tokens=["[UNK]", *special_tokens]))
    tokenizer.save(str(path))
    return path


# --- file types, folders, globs ------------------------------------------------------------------

@pytest.mark.parametrize("file_type", ["txt", "jsonl", "json", "parquet", "csv"])
def test_each_file_type_gives_every_document_then_eod(file_type, tmp_path):
    prepared = prepare(write_corpus(tmp_path / "data", file_type), tmp_path / "cache", validation_fraction=0.0)
    assert tokens_of(prepared) == byte_stream(DOCUMENTS)
    index = prepared.index
    assert index["file_type"] == {"txt": "text", "jsonl": "json"}.get(file_type, file_type)
    assert index["num_documents"] == 3 and index["num_tokens"] == len(byte_stream(DOCUMENTS))
    assert index["text_field"] == (None if file_type == "txt" else "text")
    assert index["splits"] == {"train": [0, index["num_tokens"]], "validation": [index["num_tokens"]] * 2}


def test_folder_and_glob_take_their_known_files_in_order(tmp_path):
    folder = tmp_path / "books"
    (folder / "b").mkdir(parents=True)
    (folder / "a.txt").write_text("alpha")
    (folder / "b" / "c.txt").write_text("gamma")
    (folder / "README.md").write_text("not a document")  # unknown suffix: ignored
    (folder / ".hidden.txt").write_text("hidden")  # hidden: ignored
    corpus = resolve_corpus(str(folder))
    assert corpus.file_type == "text" and [file.name for file in corpus.files] == ["a.txt", "c.txt"]
    assert tokens_of(prepare(folder, tmp_path / "cache", validation_fraction=0.0)) == byte_stream(["alpha", "gamma"])
    glob_corpus = resolve_corpus(str(folder / "**" / "*.txt"))
    assert [file.name for file in glob_corpus.files] == ["a.txt", "c.txt"]
    assert [file.name for file in resolve_corpus(str(folder / "*.txt")).files] == ["a.txt"]
    single = folder / "notes"  # an explicit file of another suffix is plain text
    single.write_text("x")
    assert resolve_corpus(str(single)).file_type == "text"


def test_path_errors_are_one_line_naming_the_setting(tmp_path):
    (tmp_path / "empty").mkdir()
    mixed = tmp_path / "mixed"
    write_corpus(mixed, "txt")
    write_corpus(mixed, "csv")
    write_corpus(mixed, "jsonl")
    only_md = tmp_path / "docs"
    only_md.mkdir()
    (only_md / "a.md").write_text("x")
    cases = [
        (tmp_path / "nope.txt", "no such file, folder or glob"),
        (tmp_path / "*.parquet", "the glob matches no file"),
        (tmp_path / "empty", "the folder holds no file"),
        (mixed, "mixes file types csv, json, text; a corpus takes files of one type"),
        (only_md, "none of its 1 file(s) ends in .txt, .json, .jsonl, .parquet or .csv"),
    ]
    for path, fragment in cases:
        with pytest.raises(DataError) as error:
            resolve_corpus(str(path))
        assert str(error.value) == f"data.path={path}: {fragment}" or fragment in str(error.value)
        assert str(error.value).startswith(f"data.path={path}: ") and "\n" not in str(error.value)


def test_hub_names_and_offline_hub_failure_in_one_line(tmp_path, monkeypatch):
    assert looks_like_hub_name("roneneldan/TinyStories") and looks_like_hub_name("wikitext")
    for local in ("nope.txt", "/abs/owner/name", "a/b/c", "./x", "data/*.jsonl"):
        assert not looks_like_hub_name(local), local
    monkeypatch.chdir(tmp_path)
    import datasets

    if not datasets.config.HF_HUB_OFFLINE:
        pytest.skip("the hub is only tried offline here (HF_DATASETS_OFFLINE=1)")
    with pytest.raises(DataError) as error:
        prepare("ppctl-tests/no-such-dataset", tmp_path / "cache")
    message = str(error.value)
    assert message.startswith("data.path=ppctl-tests/no-such-dataset: no such file, folder or glob, and loading it "
                              "as a Hugging Face hub dataset failed: ") and "\n" not in message


def test_offline_a_hub_name_fails_at_once_in_one_line_without_library_noise(tmp_path, monkeypatch, capfd):
    import time

    import datasets

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    if not datasets.config.HF_HUB_OFFLINE:
        pytest.skip("datasets was imported online (HF_DATASETS_OFFLINE unset at its import)")
    started = time.monotonic()
    with pytest.raises(DataError) as error:
        prepare("ppctl-tests/no-such-dataset", tmp_path / "cache")
    assert str(error.value) == ("data.path=ppctl-tests/no-such-dataset: no such file, folder or glob, and loading it "
                                "as a Hugging Face hub dataset failed: it is not in the local cache, and "
                                "HF_DATASETS_OFFLINE=1 (offline) keeps the hub out of reach")
    assert time.monotonic() - started < 5 and capfd.readouterr().err == ""


def test_without_network_a_hub_name_fails_at_once_without_retries(tmp_path, monkeypatch, capfd):
    """Online, but the hub does not accept a connection (here: a port nothing listens on): no download is tried,
    so none of the library's five growing retries."""
    import time

    import datasets

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:1")
    monkeypatch.setattr(datasets, "load_dataset", lambda *args, **kwargs: pytest.fail("the hub was tried"))
    started = time.monotonic()
    with pytest.raises(DataError) as error:
        prepare("ppctl-tests/no-such-dataset", tmp_path / "cache")
    assert str(error.value).startswith(
        "data.path=ppctl-tests/no-such-dataset: no such file, folder or glob, and loading it as a Hugging Face hub "
        "dataset failed: the hub http://127.0.0.1:1 cannot be reached (Connection refused); with the dataset in the "
        "local cache, set HF_HUB_OFFLINE=1")
    assert time.monotonic() - started < 2 and capfd.readouterr().err == ""


@pytest.mark.parametrize("name, content, fragment", [
    ("fake.parquet", b"not a parquet file\n", "cannot read its parquet files: Parquet magic bytes not found"),
    ("broken.jsonl", b'{"text": "a"}\n{bad json\n', "cannot read its json files: "),
])
def test_unreadable_files_are_one_line_without_the_library_log(tmp_path, capfd, name, content, fragment):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(DataError) as error:
        prepare(path, tmp_path / "cache")
    assert str(error.value).startswith(f"data.path={path}: {fragment}") and "\n" not in str(error.value)
    assert capfd.readouterr().err == ""  # not the library's own "Failed to read ..." line first


@pytest.mark.parametrize("name, content, fragment", [
    ("empty.jsonl", b"", "empty.jsonl holds no records (the file is empty or blank)"),
    ("blank.json", b"\n \n", "blank.json holds no records (the file is empty or blank)"),
    ("empty.csv", b"", "empty.csv holds no records (the file is empty or blank)"),
    ("header.csv", b"text\n", "its csv file(s) hold no records"),
    ("none.json", b"[]", "its json file(s) hold no records"),
])
def test_files_without_a_record_are_named_as_such(tmp_path, name, content, fragment):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(DataError) as error:
        prepare(path, tmp_path / "cache")
    assert str(error.value) == f"data.path={path}: {fragment}"


def test_a_folder_of_empty_files_holds_no_records(tmp_path):
    folder = tmp_path / "all_empty"
    folder.mkdir()
    for part in ("a.jsonl", "b.jsonl"):
        (folder / part).write_bytes(b"")
    with pytest.raises(DataError, match=r": its 2 json files hold no records \(all are empty or blank\)$"):
        prepare(folder, tmp_path / "cache")


# --- text fields, empty corpora -------------------------------------------------------------------

def test_text_field_picks_the_column_and_a_missing_one_names_the_fields(tmp_path):
    path = write_corpus(tmp_path / "data", "jsonl", field="body")
    assert tokens_of(prepare(path, tmp_path / "cache", text_field="body", validation_fraction=0.0)) == \
        byte_stream(DOCUMENTS)
    with pytest.raises(DataError, match=f"^data.text_field=text is not a field of data.path={path}; its fields: "
                                        "body, id$"):
        prepare(path, tmp_path / "cache")
    with pytest.raises(DataError, match=r"data.text_field=id of .* holds Value\('int64'\), not text"):
        prepare(path, tmp_path / "cache", text_field="id")


def test_empty_documents_are_skipped_and_an_empty_corpus_refused(tmp_path):
    path = write_corpus(tmp_path / "data", "jsonl", documents=["a", "", "b"])
    prepared = prepare(path, tmp_path / "cache", validation_fraction=0.0)
    assert tokens_of(prepared) == byte_stream(["a", "b"]) and prepared.index["num_documents"] == 2
    empty = write_corpus(tmp_path / "empty", "jsonl", documents=["", ""])
    with pytest.raises(DataError, match=r"data.path=.*corpus.jsonl: the corpus holds no text \(2 empty document"):
        prepare(empty, tmp_path / "cache")
    assert len(list((tmp_path / "cache").glob("text-corpus-*"))) == 2  # the first corpus's files; none for it


# --- text that is not UTF-8, rows without text -------------------------------------------------------

def test_first_invalid_utf8_names_line_offset_and_byte_across_blocks(tmp_path, monkeypatch):
    monkeypatch.setattr(utf8_module, "SCAN_BLOCK_BYTES", 4)  # "✓" (3 bytes) straddles two blocks
    path = tmp_path / "scan.txt"
    path.write_bytes("ab\n✓\n".encode() + b"c\xe9d\n")
    assert utf8_module.first_invalid_utf8(path) == (3, 8, 0xe9)
    path.write_bytes("ab\n✓\nok\n".encode())
    assert utf8_module.first_invalid_utf8(path) is None
    path.write_bytes(b"ok\n\xe2\x9c")  # a character cut by the end of the file
    assert utf8_module.first_invalid_utf8(path) == (2, 3, 0xe2)


@pytest.mark.parametrize("name, content, line, offset", [
    ("one.txt", b"first\nsecond caf\xe9\n", 2, 16),  # .txt is decoded strictly now, not with U+FFFD
    ("rows.jsonl", b'{"text": "ok"}\n{"text": "caf\xe9"}\n', 2, 28),
    ("list.json", b'[{"text": "ok"}, {"text": "caf\xe9"}]', 1, 30),
    ("table.csv", b"text,id\nok,1\ncaf\xe9,2\n", 3, 16),
])
def test_a_file_that_is_not_utf8_is_refused_naming_it_with_line_and_offset(tmp_path, name, content, line, offset):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(DataError) as error:
        prepare(path, tmp_path / "cache")
    assert str(error.value) == (f"data.path={path}: {name} is not UTF-8: line {line} (byte offset {offset}) holds "
                                "0xe9; convert the file to UTF-8")


def test_in_a_folder_the_bad_file_is_named_by_its_path(tmp_path):
    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "a.txt").write_text("fine ✓")
    (folder / "b.txt").write_bytes(b"\xff at the start")
    with pytest.raises(DataError, match=f"^data.path={folder}: {folder / 'b.txt'} is not UTF-8: line 1 \\(byte "
                                        "offset 0\\) holds 0xff; convert the file to UTF-8$"):
        prepare(folder, tmp_path / "cache")


def test_a_parquet_value_that_is_not_utf8_is_refused_naming_file_row_and_column(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as parquet

    folder = tmp_path / "tables"
    folder.mkdir()
    for part, values in (("a", [b"ok", b"fine"]), ("b", [b"ok", b"x", b"caf\xe9"])):
        parquet.write_table(pa.table({"text": pa.array(values, pa.binary()).view(pa.string())}),
                            folder / f"{part}.parquet")
    with pytest.raises(DataError) as error:
        prepare(folder, tmp_path / "cache")
    assert str(error.value) == (f"data.path={folder}: {folder / 'b.parquet'} is not UTF-8: the row at index 2 holds "
                                "0xe9 in column text; write its text as UTF-8")


def test_rows_without_text_are_counted_in_the_index_and_said_in_the_summary(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"text": "a"}\n{"title": "no text"}\n{"text": null}\n{"text": ""}\n{"text": "b"}\n')
    prepared = prepare(path, tmp_path / "cache", validation_fraction=0.0)
    assert tokens_of(prepared) == byte_stream(["a", "b"])
    assert (prepared.index["num_rows"], prepared.index["num_documents"]) == (5, 2)
    assert prepared.index["skipped_rows"] == {"missing": 2, "empty": 1}
    assert " in 1 file(s); 3 of 5 rows skipped (2 with no \"text\" value, 1 with \"text\" empty); train 4," \
        in prepared.summary()
    csv = tmp_path / "table.csv"  # an empty csv cell is no value
    csv.write_text("text,id\na,1\n,2\nb,3\n")
    assert "; 1 of 3 rows skipped (no \"text\" value); " in prepare(csv, tmp_path / "cache").summary()
    empty = write_corpus(tmp_path / "empty_rows", "parquet", documents=["a", "", "b"])
    assert "; 1 of 3 rows skipped (\"text\" empty); " in prepare(empty, tmp_path / "cache").summary()
    folder = write_corpus(tmp_path / "texts", "txt", documents=["a", "", "b"])
    assert "; 1 of 3 files skipped (empty); " in prepare(folder, tmp_path / "cache").summary()
    whole = prepare(write_corpus(tmp_path / "whole", "jsonl"), tmp_path / "cache")
    assert "skipped" not in whole.summary() and whole.index["skipped_rows"] == {"missing": 0, "empty": 0}


# --- token ids outside the vocabulary ---------------------------------------------------------------

def edit_token(token_file: Path, position: int, value: int) -> None:
    """Overwrite one token in place (the file keeps its size) and move its mtime on, as a later edit would."""
    tokens = np.memmap(token_file, dtype=np.uint16, mode="r+")
    tokens[position] = value
    tokens.flush()
    del tokens
    stat = token_file.stat()
    os.utime(token_file, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))


def test_a_token_file_edited_to_hold_an_id_outside_the_vocabulary_is_refused(tmp_path):
    path = write_corpus(tmp_path / "data", "jsonl")
    prepared = prepare(path, tmp_path / "cache")
    assert prepared.index["max_token_id"] == 256  # the end-of-document id
    (token_file,) = prepared.token_files()
    edit_token(token_file, 3, 40_000)
    with pytest.raises(DataError) as error:
        prepare(path, tmp_path / "cache")
    assert str(error.value) == (f"{token_file}: holds token id 40,000, outside the vocabulary of the byte "
                                f"tokenizer (257 ids, 0-256); it changed after it was built: delete it and "
                                f"shard-00000.json to rebuild them")
    with pytest.raises(DataError, match="holds token id 40,000"):  # the workers' way in refuses it too
        build_dataset(CorpusSpec("text", str(path), tmp_path / "cache"), 8, 384, 0)
    edit_token(token_file, 3, 255)  # changed, but inside the vocabulary: nothing to refuse
    assert tokens_of(prepare(path, tmp_path / "cache"))[3] == 255


def test_a_reused_token_file_is_not_read_while_it_is_as_built(tmp_path, monkeypatch):
    path = write_corpus(tmp_path / "data", "jsonl")
    (token_file,) = prepare(path, tmp_path / "cache").token_files()
    reads = []
    real_read = cache_module.read_max_token_id
    monkeypatch.setattr(cache_module, "read_max_token_id", lambda *args: reads.append(1) or real_read(*args))
    prepare(path, tmp_path / "cache")
    prepare(path, tmp_path / "cache", validation_fraction=0.5)  # rewrites the index, not the tokens
    assert reads == []
    os.utime(token_file, ns=(token_file.stat().st_atime_ns, token_file.stat().st_mtime_ns + 1))
    prepare(path, tmp_path / "cache")
    assert reads == [1]


# --- tokenizer files ------------------------------------------------------------------------------

def test_tokenizer_file_with_its_own_end_of_text_token(tmp_path):
    words = ["the cat sat", "on the mat"]
    tokenizer_file = save_word_tokenizer(tmp_path / "words.json", words, ["</s>"])
    tokenizer = build_tokenizer(str(tokenizer_file))
    vocab = json.loads(tokenizer_file.read_text())["model"]["vocab"]
    assert tokenizer.eod_id == vocab["</s>"] and tokenizer.vocab_size == len(vocab)
    path = write_corpus(tmp_path / "data", "jsonl", documents=words)
    prepared = prepare(path, tmp_path / "cache", tokenizer=str(tokenizer_file), validation_fraction=0.0)
    expected = [vocab[word] for word in "the cat sat".split()] + [tokenizer.eod_id] + \
        [vocab[word] for word in "on the mat".split()] + [tokenizer.eod_id]
    assert tokens_of(prepared) == expected
    assert tokenizer.decode(expected[:4]) == "the cat sat"
    identity = prepared.index["tokenizer"]
    assert identity["path"] == str(tokenizer_file.resolve()) and len(identity["sha256"]) == 64
    assert prepared.index["vocab_size"] == len(vocab) and prepared.index["eod_id"] == vocab["</s>"]


def test_tokenizer_file_without_one_gets_a_new_eod_id(tmp_path):
    tokenizer_file = save_word_tokenizer(tmp_path / "words.json", ["a b c"], [])
    tokenizer = build_tokenizer(str(tokenizer_file))
    file_size = len(json.loads(tokenizer_file.read_text())["model"]["vocab"])
    assert (tokenizer.eod_id, tokenizer.vocab_size) == (file_size, file_size + 1)
    counts = {"num_rows": 0, "missing": 0, "empty": 0, "num_documents": 0, "num_tokens": 0, "max_token_id": -1}
    tokens, lengths = tokenise_texts(["a c", ""], tokenizer, counts)
    assert tokens.tolist() == [*tokenizer.encode("a c"), file_size] and lengths == [len(tokens)]
    assert (counts["num_rows"], counts["empty"], counts["num_documents"]) == (2, 1, 1)
    (tmp_path / "broken.json").write_text("{}")
    with pytest.raises(ValueError, match="broken.json: not a Hugging Face tokenizers file"):
        build_tokenizer(str(tmp_path / "broken.json"))


def test_token_dtype_follows_the_vocabulary_and_uint16_is_refused_above_65536(tmp_path):
    assert token_dtype_for("auto", 257) == "uint16" and token_dtype_for("auto", 65_536) == "uint16"
    assert token_dtype_for("auto", 65_537) == "uint32" and token_dtype_for("uint32", 257) == "uint32"
    with pytest.raises(DataError, match="data.token_dtype=uint16 holds 65,536 ids but the tokenizer has 65,537; "
                                        "use data.token_dtype=uint32 or auto"):
        token_dtype_for("uint16", 65_537)
    with pytest.raises(DataError, match="data.token_dtype='int8' must be one of auto, uint16, uint32"):
        token_dtype_for("int8", 257)
    from tokenizers import Tokenizer, models

    big = tmp_path / "big.json"  # 65,536 words and no end-of-text token: 65,537 ids
    Tokenizer(models.WordLevel({f"w{number}": number for number in range(1 << 16)}, unk_token="w0")).save(str(big))
    with pytest.raises(ConfigError, match="data.token_dtype=uint16 holds 65,536 ids but the tokenizer has 65,537"):
        validate(config_of(tokenizer=str(big), token_dtype="uint16"))
    assert config_of(tokenizer=str(big)).model.vocab_size == 65_537


# --- vocabulary resolution ------------------------------------------------------------------------

def config_of(vocab_size=None, eval_every=50, **data) -> PpctlConfig:
    """A config with these data settings, resolved as composing resolves it (without Hydra's cost)."""
    config = PpctlConfig(model=ModelConfig(vocab_size=vocab_size), data=DataConfig(**data))
    config.trainer.eval_every = eval_every
    fill_unset(config)
    return config


def test_vocab_size_follows_the_tokenizer_unless_set(tmp_path):
    tokenizer_file = save_word_tokenizer(tmp_path / "words.json", ["a b c"], ["<|endoftext|>"])
    file_size = len(json.loads(tokenizer_file.read_text())["model"]["vocab"])
    assert config_of().model.vocab_size == 257
    assert config_of(source="synthetic").model.vocab_size == 257
    assert config_of(source="synthetic", tokenizer=str(tokenizer_file)).model.vocab_size == 257
    config = compose_config([f"data.tokenizer={tokenizer_file}"])  # as the CLI resolves it, into config.yaml
    assert config.model.vocab_size == file_size and "vocab_size: " + str(file_size) in to_yaml(config)
    assert config_of(vocab_size=300).model.vocab_size == 300
    with pytest.raises(ConfigError, match="model.vocab_size=256 is smaller than the 257 ids of data.tokenizer=byte; "
                                          "set model.vocab_size >= 257 or leave it unset to follow the tokenizer"):
        validate(config_of(vocab_size=256))
    validate(config_of(vocab_size=16, source="synthetic"))  # synthetic data takes any vocabulary
    with pytest.raises(ConfigError, match="data.tokenizer=nope.json: unknown tokenizer"):
        config_of(tokenizer="nope.json")


def test_data_settings_are_validated_in_one_line(tmp_path):
    for settings, fragment in [
        (dict(validation_fraction=1.0), "data.validation_fraction=1.0 must be >= 0 and < 1"),
        (dict(validation_fraction=0.0), "data.validation_fraction=0.0 leaves no validation split but "
                                        "trainer.eval_every=50; set trainer.eval_every=0"),
        (dict(num_proc=0), "data.num_proc=0 must be a positive integer"),
        (dict(source="text", path=str(tmp_path)), f"data.path={tmp_path}: the folder holds no file"),
        (dict(source="text"), "data.source=text needs data.path"),
        (dict(path="x.txt"), "data.source=python_stdlib takes no data.path"),
        (dict(source="text_file"),
         "data.source='text_file' must be one of python_stdlib, text, chat, prompt_completion, indexed, synthetic"),
    ]:
        with pytest.raises(ConfigError) as error:
            validate(config_of(**settings))
        assert fragment in str(error.value) and "\n" not in str(error.value)
    validate(config_of(validation_fraction=0.0, eval_every=0))
    validate(config_of(source="text", path="owner/hub-name"))  # tried when preparing


# --- cache ----------------------------------------------------------------------------------------

def test_cache_is_reused_and_rebuilt_when_an_input_changes(tmp_path, monkeypatch):
    path = write_corpus(tmp_path / "data", "jsonl")
    builds = []
    real_build = prepare_module._build_entry
    monkeypatch.setattr(prepare_module, "_build_entry", lambda *args: builds.append(1) or real_build(*args))
    first = prepare(path, tmp_path / "cache")
    (token_file,) = first.token_files()
    token_mtime = token_file.stat().st_mtime_ns
    assert prepare(path, tmp_path / "cache").location == first.location and len(builds) == 1
    # another validation fraction keeps the tokens and moves the split in the index
    other_split = prepare(path, tmp_path / "cache", validation_fraction=0.5)
    assert other_split.location == first.location and len(builds) == 1
    assert token_file.stat().st_mtime_ns == token_mtime
    assert json.loads((first.location / "index.json").read_text())["splits"] == split_bounds(first.index["num_tokens"], 0.5)
    # a changed tokenizer, dtype, text field or content is another cache
    tokenizer_file = save_word_tokenizer(tmp_path / "words.json", DOCUMENTS, [])
    changed = [prepare(path, tmp_path / "cache", tokenizer=str(tokenizer_file)),
               prepare(path, tmp_path / "cache", token_dtype="uint32")]
    write_corpus(tmp_path / "data", "jsonl", documents=DOCUMENTS[:2])
    changed.append(prepare(path, tmp_path / "cache"))
    assert len(builds) == 4 and len({first.location, *(prepared.location for prepared in changed)}) == 4
    assert tokens_of(changed[-1]) == byte_stream(DOCUMENTS[:2])


def test_file_digests_are_remembered_only_for_settled_files(tmp_path):
    path = write_corpus(tmp_path / "data", "jsonl")
    digests = cache_module.FileMemo(tmp_path / "memo.json")
    fresh = digests.value(path, cache_module.file_sha256)
    assert not digests.entries  # just written: its mtime cannot be trusted yet
    os.utime(path, (1_000_000_000, 1_000_000_000))
    assert digests.value(path, cache_module.file_sha256) == fresh and digests.entries
    digests.save()
    remembered = cache_module.FileMemo(tmp_path / "memo.json")
    assert remembered.value(path, None) == fresh  # a remembered file is not read again (None is never called)


def test_an_entry_interrupted_before_its_index_keeps_its_shards_and_the_next_run_completes_it(tmp_path,
                                                                                               monkeypatch):
    path = write_corpus(tmp_path / "data", "jsonl")
    real_write = prepare_module.write_entry_index

    def interrupted(*args):  # every shard is written; the signal comes before the entry's index
        raise KeyboardInterrupt

    monkeypatch.setattr(prepare_module, "write_entry_index", interrupted)
    with pytest.raises(KeyboardInterrupt):
        prepare(path, tmp_path / "cache")
    (folder,) = [entry for entry in (tmp_path / "cache").iterdir() if entry.is_dir()]
    assert sorted(file.name for file in folder.iterdir()) == ["shard-00000.bin", "shard-00000.idx",
                                                              "shard-00000.json"]  # no index, no temporary
    monkeypatch.setattr(prepare_module, "write_entry_index", real_write)
    monkeypatch.setattr(tokenise_module, "tokenise_shard", None)  # the complete shard is not tokenised again
    assert tokens_of(prepare(path, tmp_path / "cache")) == byte_stream(DOCUMENTS)


def test_an_error_in_a_tokenising_process_is_its_one_line_and_ends_the_others(tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    for number in range(4):
        (folder / f"{number}.jsonl").write_text(json.dumps({"text": "fine " * 50}) + "\n")
    (folder / "2.jsonl").write_text('{"text": "a"}\n{bad json\n')
    with pytest.raises(DataError, match=f"^data.path={folder}: cannot read its json files: "):
        prepare(folder, tmp_path / "cache", num_proc=2, shard_mib=1e-6)
    assert multiprocessing.active_children() == []


def test_cache_writes_are_atomic(tmp_path):
    from ppctl.fileio import write_atomically

    target = tmp_path / "tokens.bin"

    def write_half_then_fail(handle):
        handle.write(b"half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        write_atomically(target, write_half_then_fail)
    assert list(tmp_path.iterdir()) == []  # neither the file nor its temporary
    write_atomically(target, lambda handle: handle.write(b"done"))
    assert target.read_bytes() == b"done" and oct(target.stat().st_mode & 0o777) == "0o644"


def test_progress_bar_shown_only_when_asked(tmp_path, capfd):
    path = write_corpus(tmp_path / "data", "jsonl")
    prepare_corpus(CorpusSpec("text", str(path), tmp_path / "quiet"))
    assert "tokenising" not in capfd.readouterr().err
    prepare_corpus(CorpusSpec("text", str(path), tmp_path / "shown"), progress=True)
    assert "tokenising 1 shard(s)" in capfd.readouterr().err


# --- splits ---------------------------------------------------------------------------------------

def test_splits_cut_the_last_tokens_and_windows_stay_inside_each(tmp_path):
    assert split_bounds(100, 0.05) == {"train": [0, 95], "validation": [95, 100]}
    assert split_bounds(100, 0.0) == {"train": [0, 100], "validation": [100, 100]}
    assert split_bounds(7, 0.1) == {"train": [0, 7], "validation": [7, 7]}
    text = "".join(chr(ord("a") + number % 26) for number in range(199))  # one document: 200 tokens
    path = tmp_path / "one.txt"
    path.write_text(text)
    spec = CorpusSpec("text", str(path), tmp_path / "cache", validation_fraction=0.25)
    train, held_out = (build_dataset(spec, 9, 257, 0, split=split) for split in ("train", "validation"))
    assert (len(train), len(held_out)) == (150 // 10, 50 // 10)
    stream = byte_stream([text])
    assert held_out[0].tolist() == stream[150:160] and held_out[4].tolist() == stream[190:200]
    assert train[14].tolist() == stream[140:150]
    prepared = prepare_corpus(spec)
    with pytest.raises(DataError, match=r"the validation split holds 50 tokens \(data.validation_fraction=0.25 of "
                                        r"200\), fewer than one window of trainer.seq_length\+1=65; raise "
                                        "data.validation_fraction or set trainer.eval_every=0"):
        prepared.check_split("validation", 64)
    with pytest.raises(ValueError, match="unknown split 'test'"):
        build_dataset(spec, 9, 257, 0, split="test")


def test_synthetic_validation_is_another_fixed_stream():
    spec = CorpusSpec("synthetic")
    train, held_out = build_dataset(spec, 16, 100, 5), build_dataset(spec, 16, 100, 5, split="validation")
    assert len(held_out) == SYNTHETIC_VALIDATION_SAMPLES == 1024
    again = build_dataset(spec, 16, 100, 5, split="validation")
    assert held_out[3].tolist() == again[3].tolist() and held_out[3].tolist() != train[3].tolist()
    assert held_out[3].tolist() != build_dataset(spec, 16, 100, 6, split="validation")[3].tolist()


def test_dataset_of_gives_each_split_of_the_configured_corpus(tmp_path):
    from ppctl.model.from_config import dataset_of

    path = tmp_path / "one.txt"
    path.write_text("x" * 999)
    config = compose_config(["data=text", f"data.path={path}", f"data.cache_dir={tmp_path / 'cache'}",
                             "data.validation_fraction=0.2", "trainer.seq_length=9"])
    assert (len(dataset_of(config)), len(dataset_of(config, "validation"))) == (80, 20)
