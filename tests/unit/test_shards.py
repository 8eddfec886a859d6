"""A corpus cut into shards: the cuts, the tasks' shares, the shards read as one stream, and the prepared corpus the
same token for token and boundary for boundary however it is cut, in however many processes or tasks."""

import dataclasses
import json
import os

import numpy as np
import pytest

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

from ppctl.data.corpus import CorpusSpec, DataError  # noqa: E402
from ppctl.data.entry import PartialCorpus  # noqa: E402
from ppctl.data.indexed import read_indexed  # noqa: E402
from ppctl.data.prepare import prepare_corpus  # noqa: E402
from ppctl.data.readers import line_blocks  # noqa: E402
from ppctl.data.shards import Piece, ShardTask, TokenShards, file_units, line_cuts, plan_shards  # noqa: E402


def rows(count: int, seed: int = 0) -> list[str | None]:
    """``count`` texts of 0 to 400 characters (some empty, some missing), non-ASCII among them."""
    rng = np.random.default_rng(seed)
    texts = []
    for number in range(count):
        length = int(rng.integers(0, 400))
        texts.append(None if number % 11 == 5 else ("é✓ab c" * 80)[:length])
    return texts


def write_jsonl(path, texts) -> None:
    """One record per line; a missing text is a record without the field."""
    path.write_text("".join(json.dumps({"text": text} if text is not None else {"n": 1}) + "\n" for text in texts))


def byte_documents(texts) -> list[list[int]]:
    """The byte tokenizer's documents of ``texts``: each non-empty one's bytes, then 256."""
    return [[*text.encode("utf-8"), 256] for text in texts if text]


def documents_of(prepared) -> list[list[int]]:
    """Each document of a prepared corpus, read from its shards' Megatron-LM indexes."""
    documents = []
    for token_file in prepared.token_files():
        corpus = read_indexed(token_file)
        documents += [corpus.document(index).tolist() for index in range(corpus.num_documents)]
    return documents


def entry_bytes(prepared) -> dict:
    """Every token and index file of an entry, and its index: name -> bytes."""
    return {file.name: file.read_bytes() for file in sorted(prepared.location.iterdir())
            if file.suffix in (".bin", ".idx") or file.name == "index.json"}


# --- the cuts -----------------------------------------------------------------------------------

def test_line_cuts_start_lines_and_the_pieces_cover_the_file_once(tmp_path):
    path = tmp_path / "corpus.jsonl"
    write_jsonl(path, rows(500))
    data = path.read_bytes()
    for every in (1, 97, 1000, 4096, len(data) - 1, len(data)):
        cuts = line_cuts(path, len(data), every)
        assert cuts == sorted(set(cuts)) and all(data[cut - 1:cut] == b"\n" for cut in cuts)
        edges = [0, *cuts, len(data)]
        assert b"".join(data[start:stop] for start, stop in zip(edges, edges[1:])) == data
        expected = sorted({data.index(b"\n", target) + 1 for target in range(every, len(data), every)} - {len(data)})
        assert cuts == expected  # the first newline at or after each multiple


def test_line_blocks_give_the_range_in_whole_lines(tmp_path):
    path = tmp_path / "corpus.jsonl"
    write_jsonl(path, rows(300))
    data = path.read_bytes()
    start, stop = line_cuts(path, len(data), 5000)[:2]
    for block_bytes in (1, 64, 1000, 1 << 20):
        blocks = list(line_blocks(path, start, stop, block_bytes))
        assert b"".join(blocks) == data[start:stop] and all(block.endswith(b"\n") for block in blocks)


def test_shards_group_small_files_and_cut_large_ones_in_order(tmp_path):
    sizes = {"a.jsonl": 100, "b.txt": 50, "c.jsonl": 3000, "d.txt": 10}
    for name, size in sizes.items():
        (tmp_path / name).write_bytes((b"y" * 9 + b"\n") * (size // 10))  # lines of 10 bytes
    units, unit_bytes = [], []
    for index, name in enumerate(sorted(sizes)):
        pieces, piece_bytes = file_units(index, tmp_path / name, 1000)
        units += pieces
        unit_bytes += piece_bytes
    shards = plan_shards(units, unit_bytes, 1000)
    assert [piece for shard in shards for piece in shard.pieces] == units  # corpus order, nothing twice
    assert [(piece.file, piece.kind) for piece in shards[0].pieces] == [(0, "whole"), (1, "whole")]
    assert [piece.kind for piece in units if piece.file == 2] == ["bytes"] * 3
    assert all(shard.input_bytes <= 1000 + 10 for shard in shards) and len(shards) == 4  # a line over at most
    assert [shard.name for shard in shards] == [f"shard-0000{index}" for index in range(4)]


def test_tasks_take_contiguous_shares_covering_every_shard_once():
    shards = plan_shards([Piece(0, "whole", 0, 1)] * 10, [1] * 10, 1)
    for count in (1, 3, 4, 10, 12):
        shares = [ShardTask(index, count).shards(shards) for index in range(count)]
        assert [shard for share in shares for shard in share] == shards
        assert max(map(len, shares)) - min(map(len, shares)) <= 1
    with pytest.raises(ValueError, match="--task 3 --tasks 3: the task must be 0 to tasks-1"):
        ShardTask(3, 3)


def test_token_shards_read_slices_across_files_as_one_stream(tmp_path):
    arrays = [np.arange(0, 7), np.arange(7, 7), np.arange(7, 20), np.arange(20, 23)]
    files, dtypes = [], ["uint16", "int32", "uint16", "int32"]
    for index, (array, dtype) in enumerate(zip(arrays, dtypes)):
        files.append(tmp_path / f"{index}.bin")
        array.astype(np.dtype(dtype).newbyteorder("<")).tofile(files[-1])
    stream = TokenShards(files, dtypes, [len(array) for array in arrays])
    assert len(stream) == 23
    for start in range(24):
        for stop in range(start, 24):
            assert stream[start:stop].tolist() == list(range(start, stop)) and stream[start:stop].dtype == np.int64
    view = stream.view(5, 21)
    assert len(view) == 16 and view[0:16].tolist() == list(range(5, 21)) and view[3:5].tolist() == [8, 9]


# --- the prepared corpus, however it is cut -------------------------------------------------------

@pytest.mark.parametrize("file_type", ["jsonl", "parquet", "txt"])
def test_any_shard_size_and_process_count_prepares_the_same_documents(file_type, tmp_path):
    import pandas

    texts = rows(600)
    data = tmp_path / "data"
    data.mkdir()
    if file_type == "jsonl":
        for part in range(3):
            write_jsonl(data / f"part{part}.jsonl", texts[part * 200:(part + 1) * 200])
    elif file_type == "parquet":
        for part in range(2):
            pandas.DataFrame({"text": texts[part * 300:(part + 1) * 300]}).to_parquet(
                data / f"part{part}.parquet", row_group_size=40)
    else:
        texts = [text or "" for text in texts[:60]]
        for number, text in enumerate(texts):
            (data / f"doc{number:03d}.txt").write_text(text)
    expected = byte_documents(texts)
    prepared = [prepare_corpus(CorpusSpec("text", str(data), tmp_path / f"cache{index}", shard_mib=shard_mib,
                                          num_proc=num_proc))
                for index, (shard_mib, num_proc) in enumerate([(64, 1), (0.005, 1), (0.005, 2)])]
    assert len(prepared[0].token_files()) == 1 and len(prepared[1].token_files()) > 3
    for corpus in prepared:
        assert documents_of(corpus) == expected
        assert corpus.tokens()[:].tolist() == sum(expected, [])
        assert corpus.index["num_documents"] == len(expected)
    assert entry_bytes(prepared[1]) == entry_bytes(prepared[2])  # the processes change nothing, to the byte


def test_tasks_prepare_the_same_bytes_as_one_preparation_and_only_the_last_completes(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    for part in range(4):
        write_jsonl(data / f"part{part}.jsonl", rows(150, seed=part))
    spec = CorpusSpec("text", str(data), tmp_path / "tasks", shard_mib=0.01)
    results = [prepare_corpus(spec, task=ShardTask(index, 3)) for index in (2, 0)]
    assert all(isinstance(result, PartialCorpus) for result in results)
    assert "task 2 of 3 wrote shards" in results[0].summary() and "of the corpus are complete" in results[0].summary()
    last = prepare_corpus(spec, task=ShardTask(1, 3))
    whole = prepare_corpus(CorpusSpec("text", str(data), tmp_path / "whole", shard_mib=0.01))
    assert not isinstance(last, PartialCorpus) and entry_bytes(last) == entry_bytes(whole)
    assert len(whole.token_files()) >= 3


def test_a_shard_changed_after_it_was_written_is_redone_alone(tmp_path, monkeypatch):
    from ppctl.data import tokenise

    data = tmp_path / "data"
    data.mkdir()
    for part in range(3):
        write_jsonl(data / f"part{part}.jsonl", rows(100, seed=part))
    spec = CorpusSpec("text", str(data), tmp_path / "cache", shard_mib=0.01)
    prepared = prepare_corpus(spec)
    expected = entry_bytes(prepared)
    (prepared.location / "index.json").unlink()
    prepared.token_files()[1].write_bytes(b"\x00\x01")  # truncated, as by a killed copy
    redone = []
    real = tokenise.tokenise_shard
    monkeypatch.setattr(tokenise, "tokenise_shard", lambda job, shard, report: redone.append(shard.index) or
                        real(job, shard, report))
    assert entry_bytes(prepare_corpus(spec)) == expected and redone == [1]


def test_ranks_preparing_one_corpus_at_once_all_end_with_the_same_entry(tmp_path):
    # Each training rank calls prepare_corpus; started together they race for the same shards, as on a cluster.
    import multiprocessing

    data = tmp_path / "data"
    data.mkdir()
    for part in range(3):
        write_jsonl(data / f"part{part}.jsonl", rows(120, seed=part))
    spec = CorpusSpec("text", str(data), tmp_path / "cache", shard_mib=0.005, num_proc=1)
    context = multiprocessing.get_context("fork")
    start, results = context.Barrier(3), context.Queue()
    ranks = [context.Process(target=_prepare_after, args=(spec, start, results)) for _ in range(3)]
    for rank in ranks:
        rank.start()
    outcomes = [results.get(timeout=120) for _ in ranks]
    for rank in ranks:
        rank.join(30)
    alone = prepare_corpus(dataclasses.replace(spec, cache_dir=tmp_path / "alone"))
    assert outcomes == [entry_bytes(alone)] * 3
    assert not [path.name for path in next((tmp_path / "cache").iterdir()).iterdir() if path.name.endswith(".tmp")]


def _prepare_after(spec, start, results) -> None:
    """A rank: wait for the others, prepare, put the entry's bytes (or the error) on ``results``."""
    start.wait()
    try:
        results.put(entry_bytes(prepare_corpus(spec)))
    except Exception as error:  # the parent's assertion shows it
        results.put(repr(error))


def test_a_parent_removes_only_its_own_ended_processes_temporaries(tmp_path):
    from ppctl.data.indexed import staged_suffix
    from ppctl.data.shards import Shard
    from ppctl.data.tokenise import remove_temporaries

    shard = Shard(0, (), 0)
    names = [f"{shard.name}.bin.x{staged_suffix(11)}", f".{shard.name}.json.y{staged_suffix(11)}",
             f"{shard.name}.bin.z{staged_suffix(12)}", f"{shard.name}.idx.w{staged_suffix(12)}"]
    for name in names:
        (tmp_path / name).write_bytes(b"")
    remove_temporaries(tmp_path, [shard], [11])
    assert sorted(path.name for path in tmp_path.iterdir()) == sorted(names[2:])


def test_a_resumed_preparation_s_last_shard_still_prints_its_line(capsys):
    # One line per shard when the corpus has several, however many are left to do (a resume with one left).
    from ppctl.data.progress import ShardProgress
    from ppctl.data.shards import Shard

    record = {"num_documents": 3, "num_tokens": 12}
    for corpus_shards, lines in ((27, 1), (1, 0)):
        progress = ShardProgress("lines", [Shard(26, (), 100)], "corpus", corpus_shards)
        progress.shard_done(Shard(26, (), 100), record)
        written = capsys.readouterr().err.splitlines()
        assert len(written) == lines and all(line.startswith("shard-00026: 3 documents") for line in written)


def test_a_corpus_without_the_text_field_is_refused_naming_the_fields_it_has(tmp_path):
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps({"body": "x", "id": number}) + "\n" for number in range(5)))
    with pytest.raises(DataError, match=f"^data.text_field=text is not a field of data.path={path}; its fields: "
                                        "body, id$"):
        prepare_corpus(CorpusSpec("text", str(path), tmp_path / "cache", shard_mib=1e-5))


def test_the_shards_are_megatron_indexed_datasets_of_the_tokens_dtype(tmp_path):
    from tests.unit.test_prepare_corpus import save_word_tokenizer

    words = [f"w{number}" for number in range(70_000)]  # more ids than uint16 holds: Megatron-LM's int32
    tokenizer = save_word_tokenizer(tmp_path / "words.json", [" ".join(words[:10])], [])
    path = tmp_path / "corpus.jsonl"
    write_jsonl(path, ["w1 w2", "w3", "w9 w9 w9"])
    del tokenizer
    big = tmp_path / "big.json"
    vocab = {"[UNK]": 0, **{word: number + 1 for number, word in enumerate(words)}}
    from tokenizers import Tokenizer, models, pre_tokenizers

    model = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    model.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    model.save(str(big))
    prepared = prepare_corpus(CorpusSpec("text", str(path), tmp_path / "cache", str(big)))
    (token_file,) = prepared.token_files()
    corpus = read_indexed(token_file)
    eod = prepared.index["eod_id"]
    assert corpus.dtype == np.dtype("int32") and prepared.index["dtype"] == "int32" and eod == 70_001
    assert [corpus.document(index).tolist() for index in range(3)] == [[2, 3, eod], [4, eod], [10, 10, 10, eod]]


def test_a_hub_dataset_is_cut_by_rows_and_prepares_its_documents(tmp_path, monkeypatch):
    import datasets

    from ppctl.data import prepare as prepare_module

    texts = rows(400, seed=3)
    loaded = datasets.Dataset.from_dict({"text": texts, "id": list(range(400))})
    monkeypatch.setattr(prepare_module, "load_hub", lambda corpus, progress: loaded)  # the datasets cache's copy
    monkeypatch.setattr(prepare_module, "hub_fingerprint", lambda corpus, documents: "hub|owner/name|fixed")
    prepared = [prepare_corpus(CorpusSpec("text", "owner/name", tmp_path / f"cache{index}", shard_mib=shard_mib))
                for index, shard_mib in enumerate((64, 0.01))]
    assert [len(corpus.token_files()) for corpus in prepared][0] == 1 < len(prepared[1].token_files())
    for corpus in prepared:
        assert documents_of(corpus) == byte_documents(texts) and corpus.index["file_type"] == "hub"
        assert corpus.index["skipped_rows"]["missing"] == sum(text is None for text in texts)


def test_a_stat_fingerprint_reads_no_input_and_still_sees_a_new_size_or_mtime(tmp_path, monkeypatch):
    from ppctl.data import cache

    path = tmp_path / "corpus.jsonl"
    write_jsonl(path, rows(50))
    monkeypatch.setattr(cache, "file_sha256", None)  # by size and mtime: no file is hashed
    spec = CorpusSpec("text", str(path), tmp_path / "cache", fingerprint="stat")
    first = prepare_corpus(spec)
    assert prepare_corpus(spec).location == first.location
    write_jsonl(path, rows(51))
    changed = prepare_corpus(spec)
    assert changed.location != first.location and changed.index["num_rows"] == 51
    monkeypatch.undo()
    by_content = prepare_corpus(CorpusSpec("text", str(path), tmp_path / "cache"))
    assert by_content.location != changed.location and entry_bytes(by_content).keys() == entry_bytes(changed).keys()
