"""Megatron-LM's indexed dataset (``ppctl/data/indexed.py``): the format written from its specification, by hand
and by ``write_indexed``, read back with its document boundaries; every corruption refused in one line naming the
file; ``data=indexed`` trains on the same windows and microbatches as the same text prepared the usual way."""

from __future__ import annotations

import dataclasses
import os
import struct
from pathlib import Path

import numpy as np
import pytest

from ppctl.config import ConfigError, DataConfig
from ppctl.config.schema import BlendSource
from ppctl.data import cache as cache_module
from ppctl.data.blend import build_blended_dataset
from ppctl.data.cache import MAX_ID_MEMO
from ppctl.data.corpus import BlendSpec, CorpusSpec, DataError
from ppctl.data.dataset import build_dataset, step_microbatches
from ppctl.data.indexed import DTYPE_CODES, IndexedWriter, read_indexed, write_indexed
from ppctl.data.prepare import prepare_corpus
from ppctl.resolve import compose_config, validate

EOD = 256  # the byte tokenizer's end of document
DOCUMENTS = [[1, 2, 3, EOD], [4, 5, EOD], [6, 7, 8, 9, 10, EOD]]


def hand_written(prefix: Path, sequences, document_indices, code: int = 8, dtype: str = "<u2") -> None:
    """The format from its specification, field by field with ``struct``: the header (magic, version 1, dtype code,
    sequence count, document-index count), the int32 lengths, the int64 byte pointers, the int64 document index."""
    itemsize = np.dtype(dtype).itemsize
    pointers = [sum(len(sequence) for sequence in sequences[:index]) * itemsize for index in range(len(sequences))]
    header = b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", code)
    header += struct.pack("<Q", len(sequences)) + struct.pack("<Q", len(document_indices))
    body = struct.pack(f"<{len(sequences)}i", *map(len, sequences)) + struct.pack(f"<{len(sequences)}q", *pointers)
    body += struct.pack(f"<{len(document_indices)}q", *document_indices)
    Path(f"{prefix}.idx").write_bytes(header + body)
    Path(f"{prefix}.bin").write_bytes(b"".join(np.asarray(sequence, dtype=dtype).tobytes() for sequence in sequences))


def test_the_writer_writes_the_specification_byte_for_byte(tmp_path):
    hand_written(tmp_path / "hand", DOCUMENTS, [0, 1, 2, 3])
    write_indexed(tmp_path / "written", DOCUMENTS, "uint16")
    for suffix in (".idx", ".bin"):
        assert (tmp_path / f"written{suffix}").read_bytes() == (tmp_path / f"hand{suffix}").read_bytes()
    assert (tmp_path / "hand.idx").read_bytes()[:34] == (b"MMIDIDX\x00\x00\x01\x00\x00\x00\x00\x00\x00\x00\x08"
                                                         b"\x03\x00\x00\x00\x00\x00\x00\x00\x04" + b"\x00" * 7)


def test_two_writers_of_one_pair_at_once_each_put_the_same_bytes_in_place(tmp_path):
    # Training ranks preparing one corpus write the same shard at once: neither may take the other's temporary.
    first, second = IndexedWriter(tmp_path / "corpus", "uint16"), IndexedWriter(tmp_path / "corpus", "uint16")
    with first:
        with second:
            for writer in (first, second):
                writer.add([1, 2, 3, 4], [3, 1])
        first.add([5], [1])
    corpus = read_indexed(tmp_path / "corpus")
    assert [corpus.document(index).tolist() for index in range(3)] == [[1, 2, 3], [4], [5]]
    assert sorted(path.name for path in tmp_path.iterdir()) == ["corpus.bin", "corpus.idx"]


@pytest.mark.parametrize("dtype", [name for name in DTYPE_CODES.values()])
def test_every_dtype_reads_back_with_its_documents(tmp_path, dtype):
    documents = [[1, 2, 3], [4], [5, 6, 7, 8, 9, 10, 11]]
    if dtype == "uint16":
        documents[1] = [65535]
    write_indexed(tmp_path / "corpus", documents, dtype)
    corpus = read_indexed(tmp_path / "corpus")
    assert corpus.dtype == np.dtype(dtype) and corpus.num_documents == 3 and corpus.num_tokens == 11
    assert corpus.document_bounds().tolist() == [0, 3, 4, 11]
    assert [corpus.document(index).tolist() for index in range(3)] == documents
    assert np.asarray(corpus.tokens()).tolist() == sum(documents, [])


def test_a_document_of_several_sequences_and_an_empty_one(tmp_path):
    """A document is its sequences in order (``--split-sentences``); a document with no sequence is read empty."""
    hand_written(tmp_path / "sentences", [[1, 2], [3, EOD], [4, EOD]], [0, 2, 2, 3], code=4, dtype="<i4")
    corpus = read_indexed(tmp_path / "sentences.idx")  # the .idx's path names the pair too
    assert corpus.document_bounds().tolist() == [0, 4, 4, 6]
    assert [corpus.document(index).tolist() for index in range(3)] == [[1, 2, 3, EOD], [], [4, EOD]]


def _patch(file: Path, offset: int, data: bytes) -> None:
    content = bytearray(file.read_bytes())
    content[offset:offset + len(data)] = data
    file.write_bytes(bytes(content))


# Three documents of uint16: lengths at byte 34, pointers at 46, the document index at 70, 102 bytes in all.
CORRUPTIONS = {
    "no .idx": (lambda idx, bin_: idx.unlink(), "corpus.idx: no such file"),
    "no .bin": (lambda idx, bin_: bin_.unlink(), "corpus.bin: no such file"),
    "header cut": (lambda idx, bin_: idx.write_bytes(idx.read_bytes()[:20]), "corpus.idx: holds 20 bytes, fewer than"),
    "magic": (lambda idx, bin_: _patch(idx, 0, b"MMIDIDY"), "not Megatron-LM's index magic"),
    "version": (lambda idx, bin_: _patch(idx, 9, struct.pack("<Q", 2)), "corpus.idx: index version 2"),
    "dtype code": (lambda idx, bin_: _patch(idx, 17, b"\x09"), "corpus.idx: unknown dtype code 9"),
    "sequence count": (lambda idx, bin_: _patch(idx, 18, struct.pack("<Q", 4)), "which take 114 bytes, but"),
    "idx cut": (lambda idx, bin_: idx.write_bytes(idx.read_bytes()[:-8]), "the file holds 94 (truncated?)"),
    "idx trailing": (lambda idx, bin_: idx.write_bytes(idx.read_bytes() + b"\x00" * 5), "holds 5 bytes after"),
    "bin cut": (lambda idx, bin_: bin_.write_bytes(bin_.read_bytes()[:-2]),
                "corpus.bin: holds 24 bytes, but sequence 2"),
    "pointer out": (lambda idx, bin_: _patch(idx, 62, struct.pack("<q", 1000)), "takes bytes 1,000 to 1,012"),
    "length": (lambda idx, bin_: _patch(idx, 38, struct.pack("<i", -3)), "corpus.idx: sequence 1 has length -3"),
    "gap": (lambda idx, bin_: _patch(idx, 54, struct.pack("<q", 10)),
            "sequence 1 starts at byte 10 of the .bin, not 8"),
    "bin trailing": (lambda idx, bin_: bin_.write_bytes(bin_.read_bytes() + b"\x00\x00"),
                     "corpus.bin: holds 28 bytes, but the 3 sequences"),
    "first document": (lambda idx, bin_: _patch(idx, 70, struct.pack("<q", 1)), "starts at sequence 1, not 0"),
    "decreasing": (lambda idx, bin_: _patch(idx, 78, struct.pack("<q", 3)) or _patch(idx, 86, struct.pack("<q", 1)),
                   "the document index decreases at entry 2 (3 then 1)"),
    "last document": (lambda idx, bin_: _patch(idx, 94, struct.pack("<q", 2)), "ends at sequence 2, not at the"),
}


@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
def test_a_corrupt_or_truncated_pair_is_refused_in_one_line(tmp_path, corruption):
    idx, bin_ = write_indexed(tmp_path / "corpus", DOCUMENTS, "uint16")
    assert idx.stat().st_size == 102 and bin_.stat().st_size == 26
    damage, expected = CORRUPTIONS[corruption]
    damage(idx, bin_)
    with pytest.raises(DataError) as refusal:
        read_indexed(tmp_path / "corpus")
    message = str(refusal.value)
    assert expected in message and "\n" not in message
    assert str(tmp_path / "corpus") in message


def _config(prefix, *overrides):
    return compose_config(["data=indexed", f"data.path={prefix}", "trainer.seq_length=4", "trainer.eval_every=0",
                           "data.validation_fraction=0", f"data.cache_dir={Path(prefix).parent / 'cache'}",
                           *overrides])


def _with_data(config, **fields):
    """``config`` with ``data`` fields changed (composing a config anew costs about half a second)."""
    return dataclasses.replace(config, data=dataclasses.replace(config.data, **fields))


def test_validation_refuses_a_corrupt_pair_and_documents_without_their_end(tmp_path):
    write_indexed(tmp_path / "good", DOCUMENTS, "uint16")
    write_indexed(tmp_path / "no_ends", [[1, 2, 3], [4, 5, EOD]], "uint16")
    validate(_config(tmp_path / "good", "data.documents=separate"))
    validate(_config(tmp_path / "no_ends"))  # joined documents need no end-of-document id
    with pytest.raises(ConfigError, match=r"no_ends.bin: document 0 of 2 ends with token 3, not the end-of-document "
                                          r"id 256 \(1 such document\(s\)\); data.documents=separate"):
        validate(_config(tmp_path / "no_ends", "data.documents=separate"))
    with pytest.raises(ConfigError, match=r"data.eod_mask_loss=true"):
        validate(_config(tmp_path / "no_ends", "data.eod_mask_loss=true"))
    (tmp_path / "good.bin").write_bytes(b"")
    with pytest.raises(ConfigError, match=r"good.bin: holds 0 bytes, but sequence 0"):
        validate(_config(tmp_path / "good"))
    with pytest.raises(ConfigError, match=r"missing.idx: no such file"):
        validate(_config(tmp_path / "missing"))
    write_indexed(tmp_path / "floats", DOCUMENTS, "float32")
    with pytest.raises(ConfigError, match=r"floats.idx: dtype float32 holds no token ids"):
        validate(_config(tmp_path / "floats"))


def test_indexed_windows_and_batches_equal_the_same_text_prepared_the_usual_way(tmp_path):
    """The same documents, prepared from text by ``prepare_corpus`` and written as an indexed dataset (each with its
    end-of-document id), give the same splits, windows and microbatches, documents kept apart."""
    for name, text in [("a.txt", "the first document\n"), ("b.txt", "a second, longer one " * 5), ("c.txt", "3")]:
        (tmp_path / name).write_text(text)
    text_spec = CorpusSpec("text", str(tmp_path / "*.txt"), tmp_path / "cache", validation_fraction=0.2)
    prepared = prepare_corpus(text_spec)
    stream = prepared.tokens()[:].tolist()
    ends = [index + 1 for index, token in enumerate(stream) if token == EOD]
    documents = [stream[start:end] for start, end in zip([0, *ends[:-1]], ends)]
    assert len(documents) == 3 and sum(documents, []) == stream
    for path, dtype in [("indexed", "int32"), ("indexed.bin", "uint16")]:
        write_indexed(tmp_path / "indexed", documents, dtype)
        indexed_spec = CorpusSpec("indexed", str(tmp_path / path), tmp_path / "cache", validation_fraction=0.2)
        assert prepare_corpus(indexed_spec).index["splits"] == prepared.index["splits"]
        for split in ("train", "validation"):
            ours, theirs = (build_dataset(spec, 8, 257, 0, split, separate_documents=True)
                            for spec in (indexed_spec, text_spec))
            assert len(ours) == len(theirs) > 0
            assert all(ours[index].tolist() == theirs[index].tolist() for index in range(len(ours)))
        for step in range(3):
            for ours, theirs in zip(*(step_microbatches(build_dataset(spec, 8, 257, 0, separate_documents=True), 0,
                                                        step, 4, 2, 0, 1) for spec in (indexed_spec, text_spec))):
                for field in ("tokens", "position_ids", "labels", "loss_mask", "segment_ids"):
                    assert getattr(ours, field).tolist() == getattr(theirs, field).tolist(), field


def test_prepare_data_reads_the_pair_as_it_is(tmp_path):
    write_indexed(tmp_path / "corpus", DOCUMENTS * 4, "uint16")
    spec = CorpusSpec("indexed", str(tmp_path / "corpus"), tmp_path / "cache", validation_fraction=0.25)
    prepared = prepare_corpus(spec)
    assert prepared.location == tmp_path / "corpus.bin"
    assert {file.name for file in (tmp_path / "cache").glob("*")} <= {MAX_ID_MEMO}  # at most the ids remembered
    assert prepared.summary() == (f"{tmp_path / 'corpus.bin'}: 52 tokens from 12 document(s) in 2 file(s); train 39, "
                                  f"validation 13 (data.validation_fraction=0.25)")
    dataset = build_dataset(spec, 3, 257, 0)
    assert [dataset[index].tolist() for index in range(len(dataset))] == [
        sum(DOCUMENTS * 4, [])[start:start + 4] for start in range(0, 36, 4)]


# --- several pairs as one corpus: a folder, a glob, ppctl's own entry -----------------------------------------------

def many_documents(count: int = 30) -> list[list[int]]:
    """``count`` documents of 1 to 12 byte ids, each ended by the end-of-document id."""
    rng = np.random.default_rng(57)
    return [rng.integers(0, 256, size=int(rng.integers(1, 13))).tolist() + [EOD] for _ in range(count)]


def same_batches(ours: CorpusSpec, theirs: CorpusSpec, seq_length: int = 8) -> None:
    """The two specs give the same split, windows (both splits) and microbatches, documents kept apart."""
    assert prepare_corpus(ours).index["splits"] == prepare_corpus(theirs).index["splits"]
    for split in ("train", "validation"):
        mine, other = (build_dataset(spec, seq_length, 257, 0, split, separate_documents=True)
                       for spec in (ours, theirs))
        assert len(mine) == len(other) > 0
        assert all(mine[index].tolist() == other[index].tolist() for index in range(len(mine)))
    datasets = [build_dataset(spec, seq_length, 257, 0, separate_documents=True) for spec in (ours, theirs)]
    for step in range(3):
        for mine, other in zip(*(step_microbatches(dataset, 0, step, 4, 2, 0, 1) for dataset in datasets)):
            for field in ("tokens", "position_ids", "labels", "loss_mask", "segment_ids"):
                assert getattr(mine, field).tolist() == getattr(other, field).tolist(), field


def test_pairs_of_different_dtypes_read_as_a_folder_or_a_glob_equal_the_same_documents_in_one_pair(tmp_path):
    """Three pairs (uint16, int32, int64) in a folder, or named by a glob, are one corpus in name order: the same
    split, windows and microbatches as the same documents in one pair (the validation cut lies inside a pair, and
    windows cross pairs)."""
    documents = many_documents()
    write_indexed(tmp_path / "one", documents, "uint16")
    (tmp_path / "parts").mkdir()
    for name, part, dtype in [("part-0", documents[:10], "uint16"), ("part-1", documents[10:22], "int32"),
                              ("part-2", documents[22:], "int64")]:
        write_indexed(tmp_path / "parts" / name, part, dtype)
    (tmp_path / "parts" / "notes.txt").write_text("not a pair")
    one = CorpusSpec("indexed", str(tmp_path / "one"), tmp_path / "cache", validation_fraction=0.3)
    for path in ("parts", "parts/part-*", "parts/*.idx"):
        spec = CorpusSpec("indexed", str(tmp_path / path), tmp_path / "cache", validation_fraction=0.3)
        prepared = prepare_corpus(spec)
        assert [shard["dtype"] for shard in prepared.index["shards"]] == ["uint16", "int32", "int64"]
        assert prepared.index["num_documents"] == 30 and prepared.location == tmp_path / "parts"
        assert prepared.tokens()[:].tolist() == sum(documents, [])
        same_batches(spec, one)


def test_a_ppctl_cache_entry_is_an_indexed_corpus(tmp_path):
    """The folder ``prepare-data`` wrote for a text corpus (several shards), given as ``data=indexed data.path``,
    trains on the same windows and microbatches; an entry whose index is not written yet is refused."""
    for name, text in [("a.txt", "the first document\n"), ("b.txt", "a second, longer one " * 5), ("c.txt", "3")]:
        (tmp_path / name).write_text(text)
    text = CorpusSpec("text", str(tmp_path / "*.txt"), tmp_path / "cache", validation_fraction=0.2, shard_mib=1e-5)
    entry = prepare_corpus(text)
    assert len(entry.index["shards"]) == 3
    indexed = CorpusSpec("indexed", str(entry.location), tmp_path / "cache", validation_fraction=0.2)
    same_batches(indexed, text)
    (entry.location / "index.json").unlink()
    with pytest.raises(DataError, match=r"a ppctl cache entry without its index.json: its preparation has not "
                                        r"finished"):
        prepare_corpus(indexed)


def test_folders_and_globs_without_whole_pairs_are_refused_in_one_line(tmp_path):
    (tmp_path / "parts").mkdir()
    write_indexed(tmp_path / "parts" / "part-0", DOCUMENTS, "uint16")
    write_indexed(tmp_path / "parts" / "part-1", [[1, 2, 3], [4, 5]], "uint16")
    (tmp_path / "empty" / "deeper").mkdir(parents=True)
    write_indexed(tmp_path / "empty" / "deeper" / "part-0", DOCUMENTS, "uint16")
    config = _config(tmp_path / "parts")
    validate(config)
    for path, expected in [
        (tmp_path / "empty", r"data.path=.*empty: the folder holds no .idx or .bin file of an indexed dataset \(its "
                             r"subfolders are not searched: name them with a glob such as .*empty/\*\*/\*.idx\)"),
        (tmp_path / "nothing-*", r"data.path=.*nothing-\*: the glob matches no .idx or .bin file"),
    ]:
        with pytest.raises(ConfigError, match=expected):
            validate(_with_data(config, path=str(path)))
    validate(_with_data(config, path=str(tmp_path / "empty" / "**" / "*.idx")))  # ** descends
    with pytest.raises(ConfigError, match=r"part-1.bin: document 0 of 2 ends with token 3, not the end-of-document"):
        validate(_with_data(config, documents="separate"))  # every pair's documents are checked
    (tmp_path / "parts" / "part-1.idx").unlink()  # a .bin left without its index
    with pytest.raises(ConfigError, match=r"parts/part-1.idx: no such file"):
        validate(config)


def settle(*files: Path, seconds: int = 1_000_000_000) -> None:
    """Date ``files`` long ago, so their size and mtime can be trusted (``RACY_SECONDS``)."""
    for file in files:
        os.utime(file, (seconds, seconds))


def test_an_id_outside_the_vocabulary_is_refused_naming_the_file_and_a_known_pair_is_not_read_again(tmp_path,
                                                                                                     monkeypatch):
    """Each ``.bin``'s largest id is read once, remembered in ``data.cache_dir`` by its path, size and mtime: later
    checks (another launch, each worker) read nothing; a ``.bin`` edited to hold an id the tokenizer does not have is
    read again and refused in one line naming it, before any worker starts."""
    (tmp_path / "parts").mkdir()
    for name in ("part-0", "part-1"):
        settle(*write_indexed(tmp_path / "parts" / name, DOCUMENTS, "uint16"))
    reads = []
    real_read = cache_module.read_max_token_id
    monkeypatch.setattr(cache_module, "read_max_token_id", lambda *args: reads.append(args[0].name) or real_read(*args))
    config = _config(tmp_path / "parts")
    validate(config)
    assert reads == ["part-0.bin", "part-1.bin"]
    validate(config)
    build_dataset(CorpusSpec("indexed", str(tmp_path / "parts"), tmp_path / "cache"), 4, 257, 0)
    assert reads == ["part-0.bin", "part-1.bin"]  # remembered: not read again
    bin_file = tmp_path / "parts" / "part-1.bin"
    tokens = np.fromfile(bin_file, dtype="<u2")
    tokens[5] = 300  # the byte tokenizer has 257 ids
    tokens.tofile(bin_file)
    settle(bin_file, seconds=1_000_000_100)
    with pytest.raises(ConfigError) as refusal:
        validate(config)
    assert str(refusal.value) == (f"{bin_file}: holds token id 300, outside the vocabulary of the byte tokenizer (257 "
                                  f"ids, 0-256); data.tokenizer must be the tokenizer the corpus was made with")
    assert reads == ["part-0.bin", "part-1.bin", "part-1.bin"]
    with pytest.raises(DataError, match=r"part-1.bin: holds token id 300"):
        build_dataset(CorpusSpec("indexed", str(tmp_path / "parts"), tmp_path / "cache"), 4, 257, 0)
    assert reads == ["part-0.bin", "part-1.bin", "part-1.bin"]  # the refused file's id is remembered too


def test_the_largest_id_is_read_in_bounded_chunks(tmp_path, monkeypatch):
    monkeypatch.setattr(cache_module, "MAX_ID_CHUNK_TOKENS", 4)
    for dtype in ("uint16", "int32", "int64"):
        tokens = np.arange(11)[::-1].copy()
        tokens[9] = 200
        tokens.astype(dtype).tofile(tmp_path / "tokens.bin")
        assert cache_module.read_max_token_id(tmp_path / "tokens.bin", dtype) == 200
    (tmp_path / "empty.bin").write_bytes(b"")
    assert cache_module.read_max_token_id(tmp_path / "empty.bin", "uint16") == -1


def test_a_blend_of_an_indexed_source_and_a_text_source_reads_each_as_alone(tmp_path):
    """A blend entry with ``source: indexed`` reads its pairs as ``data=indexed`` does: each sample is its source's
    own window; a corrupt indexed entry is refused at validation naming the entry and the file."""
    (tmp_path / "parts").mkdir()
    write_indexed(tmp_path / "parts" / "part-0", [[ord("a")] * 40 + [EOD]] * 3, "uint16")
    write_indexed(tmp_path / "parts" / "part-1", [[ord("a")] * 30 + [EOD]] * 2, "int32")
    (tmp_path / "b.txt").write_text("b" * 200)
    entries = [BlendSource(source="indexed", path=str(tmp_path / "parts"), weight=2.0),
               BlendSource(path=str(tmp_path / "b.txt"), weight=1.0)]
    blend = BlendSpec.of(DataConfig(source="text", cache_dir=str(tmp_path / "cache"), blend=entries))
    dataset = build_blended_dataset(blend, 7, 257, 0, separate_documents=True)
    alone = [build_dataset(spec, 7, 257, 0, separate_documents=True) for spec in blend.specs]
    assert [len(part) for part in dataset.datasets] == [len(part) for part in alone] == [22, 23]
    sources = set()
    for sample_id in dataset.batch_sample_ids(0, 2, 16):
        source, local = dataset.locate(sample_id)
        sources.add(source)
        assert dataset[sample_id].tolist() == alone[source][local].tolist()
        assert set(dataset[sample_id].tolist()) - {EOD} == {ord("ab"[source])}
    assert sources == {0, 1}
    overrides = [f"data.blend=[{{source: indexed, path: {tmp_path / 'parts'}, weight: 2}}, "
                 f"{{path: {tmp_path / 'b.txt'}, weight: 1}}]", f"data.cache_dir={tmp_path / 'cache'}",
                 "trainer.seq_length=7", "trainer.eval_every=0", "data.validation_fraction=0"]
    config = compose_config(overrides)
    validate(config)
    (tmp_path / "parts" / "part-1.bin").write_bytes(b"")
    with pytest.raises(ConfigError, match=r"^data.blend\[0\] \(data.path=.*parts\): .*part-1.bin: holds 0 bytes, "
                                          r"but sequence 0"):
        validate(config)
