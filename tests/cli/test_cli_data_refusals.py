"""Bad corpora and caches, through the command line: one line naming the file and the place, exit 2.

Each case runs ``ppctl`` in a subprocess, as a user would, so that the processes ``datasets``
forks to tokenise (``data.num_proc``) are real and their output would show.
"""

import json
import time

import numpy as np
import pytest

ROWS = [f"document number {number}, plain text" for number in range(20)]
BAD = b"caf\xe9 au lait"  # latin-1, not UTF-8: byte 3 of the text is 0xe9


def jsonl_with_a_bad_row(path, bad_row: int):
    """A jsonl file of ``ROWS`` whose row ``bad_row`` (0-based) holds latin-1 bytes; returns (line, byte offset)."""
    lines = [json.dumps({"text": text, "id": number}).encode() for number, text in enumerate(ROWS)]
    lines[bad_row] = b'{"text": "' + BAD + b'", "id": %d}' % bad_row
    path.write_bytes(b"\n".join(lines) + b"\n")
    offset = sum(len(line) + 1 for line in lines[:bad_row]) + len(b'{"text": "caf')
    return bad_row + 1, offset


def txt_with_a_bad_line(path):
    head = b"first line\nsecond line\n"
    path.write_bytes(head + BAD + b"\nlast line\n")
    return 3, len(head) + 3


def csv_with_a_bad_row(path):
    head = b"text,id\nhello,1\n"
    path.write_bytes(head + BAD + b",2\nbye,3\n")
    return 3, len(head) + 3


def prepare_args(path, tmp_path, *extra):
    return ["prepare-data", "data=text", f"data.path={path}", f"data.cache_dir={tmp_path / 'cache'}",
            "trainer.eval_every=0", "trainer.seq_length=8", *extra]


def assert_refused(result, line: str) -> None:
    """Exit 2, nothing on stdout, and exactly ``line`` on stderr (no "interrupted" line from a child)."""
    assert (result.returncode, result.stdout, result.stderr.splitlines()) == (2, "", [line]), result.stderr


@pytest.mark.timeout(120)
@pytest.mark.parametrize("suffix, write", [
    ("jsonl", lambda path: jsonl_with_a_bad_row(path, 5)),
    ("txt", txt_with_a_bad_line),
    ("csv", csv_with_a_bad_row),
])
def test_a_file_that_is_not_utf8_is_named_with_its_line_and_byte_offset(ppctl, tmp_path, suffix, write):
    path = tmp_path / f"corpus.{suffix}"
    line, offset = write(path)
    assert_refused(ppctl(*prepare_args(path, tmp_path)),
                   f"error: data.path={path}: corpus.{suffix} is not UTF-8: line {line} (byte offset {offset}) "
                   "holds 0xe9; convert the file to UTF-8")


@pytest.mark.timeout(120)
def test_a_tokenising_child_that_fails_prints_nothing_of_its_own(ppctl, tmp_path):
    # data.num_proc=2: the rows reach Dataset.map undecoded, and the child holding row 15 fails on it;
    # its pool then ends the other child with SIGTERM, which must not print "interrupted by SIGTERM".
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "a.jsonl").write_text("".join(json.dumps({"text": text, "id": 0}) + "\n" for text in ROWS))
    line, offset = jsonl_with_a_bad_row(folder / "b.jsonl", 15)
    assert_refused(ppctl(*prepare_args(folder, tmp_path, "data.num_proc=2")),
                   f"error: data.path={folder}: {folder / 'b.jsonl'} is not UTF-8: line {line} "
                   f"(byte offset {offset}) holds 0xe9; convert the file to UTF-8")


@pytest.mark.timeout(120)
def test_a_parquet_value_that_is_not_utf8_is_named_by_its_row(ppctl, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as parquet

    values = [text.encode() for text in ROWS]
    values[12] = BAD
    path = tmp_path / "corpus.parquet"
    parquet.write_table(pa.table({"text": pa.array(values, pa.binary()).view(pa.string())}), path)
    assert_refused(ppctl(*prepare_args(path, tmp_path, "data.num_proc=2")),
                   f"error: data.path={path}: corpus.parquet is not UTF-8: the row at index 12 holds 0xe9 in "
                   "column text; write its text as UTF-8")


@pytest.mark.timeout(120)
def test_rows_without_text_are_counted_and_said(ppctl, tmp_path):
    path = tmp_path / "corpus.jsonl"
    rows = [{"text": "x" * 2400} if number % 2 == 0 else {"title": "no text here"} for number in range(10)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    result = ppctl(*prepare_args(path, tmp_path))
    assert result.returncode == 0, result.stderr
    assert "12,005 tokens from 5 document(s) in 1 file(s); 5 of 10 rows skipped (no \"text\" value); train " \
        in result.stdout


@pytest.mark.timeout(180)
def test_a_cache_edited_to_hold_an_id_outside_the_vocabulary_is_refused_before_any_worker(ppctl, tmp_path):
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps({"text": text * 20}) + "\n" for text in ROWS))
    args = ["data=text", f"data.path={path}", f"data.cache_dir={tmp_path / 'cache'}"]
    assert ppctl("prepare-data", *args).returncode == 0
    token_file = next((tmp_path / "cache").glob("text-corpus-byte-*/shard-00000.bin"))
    tokens = np.memmap(token_file, dtype=np.uint16, mode="r+")
    tokens[::50] = 1000  # in every window; past the byte tokenizer's 257 ids and the embedding's 384 rows
    tokens.flush()
    del tokens
    run_dir = tmp_path / "run"
    started = time.monotonic()
    result = ppctl("train", *args, "trainer.max_steps=1", "launcher.backend=gloo", f"trainer.out_dir={run_dir}")
    assert_refused(result, f"error: {token_file}: holds token id 1,000, outside the vocabulary of the byte tokenizer "
                           f"(257 ids, 0-256); it changed after it was built: delete it and shard-00000.json to "
                           "rebuild them")
    assert time.monotonic() - started < 60 and not run_dir.exists()  # refused before the run directory and workers


def word_tokenizer(path, words: list[str]):
    """A ``tokenizers`` file whose vocabulary is ``[UNK]`` then ``words``, one id each; returns its path."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, **{word: number + 1 for number, word in enumerate(words)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(path))
    return path


def saved_run(run_dir, overrides: list[str], with_record: bool = True):
    """A run directory with one committed checkpoint whose index is what a run of ``overrides`` saves (the files
    the ranks would write stand in as bytes); ``with_record=False``: as saved before ppctl recorded the tokenizer."""
    from types import SimpleNamespace

    from ppctl.checkpoint.files import commit, temporary_dir
    from ppctl.checkpoint.state import checkpoint_index
    from ppctl.resolve import compose_config

    config = compose_config(overrides)
    layout = SimpleNamespace(world_size=1, tp=1, pp=1, vpp=1, dp=1, cp=1, ep=1)
    index = checkpoint_index(SimpleNamespace(config=config, context=SimpleNamespace(layout=layout)), 3, "end", 3)
    if not with_record:
        del index["data"]["tokenizer"]
    partial = temporary_dir(run_dir, 3)
    partial.mkdir(parents=True)
    (partial / ".metadata").write_bytes(b"metadata")
    return commit(run_dir, 3, index, keep_last=2)


@pytest.mark.timeout(180)
def test_a_resume_with_another_tokenizer_of_as_many_ids_is_refused(ppctl, tmp_path):
    # Each file holds 9 ids and the end of a document is a 10th: model.vocab_size, the model's shape, is the same.
    trained = word_tokenizer(tmp_path / "trained.json", "the cat sat on a mat and slept".split())
    other = word_tokenizer(tmp_path / "other.json", "one two six ten red big old new".split())
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the cat sat on a mat and slept\n" * 40)
    common = ["data=text", f"data.path={corpus}", f"data.cache_dir={tmp_path / 'cache'}", "trainer.eval_every=0",
              "trainer.seq_length=8", "trainer.max_steps=5", "launcher.backend=gloo"]
    run_dir = tmp_path / "run"
    checkpoint = saved_run(run_dir, [*common, f"data.tokenizer={trained}"])
    refused = ppctl("train", *common, f"data.tokenizer={other}", f"trainer.resume_from={run_dir}", "--dry-run")
    assert_refused(refused, f"error: trainer.resume_from={run_dir}: cannot resume from {checkpoint}: it was trained "
                            f"with tokenizer {trained}; this run's data.tokenizer is {other} (same vocabulary size, "
                            "different tokens): each embedding row would stand for another token; resume with the "
                            "tokenizer it was trained with, or start a new run without trainer.resume_from")
    same = ppctl("train", *common, f"data.tokenizer={trained}", f"trainer.resume_from={run_dir}", "--dry-run")
    assert same.returncode == 0, same.stderr
    before_the_record = saved_run(tmp_path / "old_run", [*common, f"data.tokenizer={trained}"], with_record=False)
    old = ppctl("train", *common, f"data.tokenizer={other}", f"trainer.resume_from={before_the_record}", "--dry-run")
    assert (old.returncode, old.stderr) == (0, ""), old.stderr
