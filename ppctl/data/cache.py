"""The token cache: its keys, what makes an entry reusable, the prepared tokens as training reads them.

A text corpus's entry is a folder of shards in Megatron-LM's indexed format with an ``index.json`` (``entry.py``);
instruction data's (``data=chat``, ``data=prompt_completion``) is ``<name>.bin`` with a ``<name>.json`` index and
three files beside them: ``<name>.idx`` (Megatron-LM's index of its documents, so the ``.bin`` is an indexed
dataset), ``<name>.weights`` (a uint8 loss weight per token: 1 where it is trained on) and ``<name>.docs`` (int64
rows ``[end, file, row]``: where each conversation ends and the file and row it came from), staged and put in place
before the token file. Either way the key covers the inputs' content, the tokenizer and the dtype, not the
validation fraction (another fraction rewrites only the index's split); nothing is taken for complete before its
index says so; the largest id of each token file is recorded with its size and mtime, read again when they change,
and an id outside the tokenizer's vocabulary is refused. ``FileMemo`` remembers what a file's content gave (input
files' digests; an indexed corpus's largest ids, whose ``.bin`` files ppctl did not write) by (path, size, mtime).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from ppctl.data.corpus import Corpus, CorpusSpec, DataError
from ppctl.data.tokenizer import Tokenizer
from ppctl.fileio import file_sha256, write_atomically

TOKEN_DTYPES = ("auto", "uint16", "uint32")
# numpy is imported only where tokens are made (config validation is quick)
TOKEN_BYTES = {"uint16": 2, "uint32": 4, "int32": 4}
SPLITS = ("train", "validation")
CACHE_FORMAT_VERSION = 5  # 5: text corpora as a folder of Megatron-LM indexed shards; 4: BOS/EOS, weights, docs
DIGEST_MEMO = "file-digests.json"
MAX_ID_MEMO = "max-token-ids.json"  # the largest id of each indexed corpus's .bin, by (path, size, mtime)
MAX_ID_CHUNK_TOKENS = 1 << 24  # tokens read at a time while looking for the largest id: memory stays bounded
RACY_SECONDS = 2.0  # a file modified this recently is re-read: its mtime may not yet tell two versions apart
# Instruction data's files beside the tokens: suffix -> (bytes per value, values per token or per document).
SIDECARS = {".weights": (1, 1), ".docs": (8, 3)}


@dataclass(frozen=True)
class PreparedCorpus:
    """Prepared tokens: where they are (``location``: a text corpus's folder of shards, or one token file), the
    index, and the label that names the source in messages."""

    location: Path
    index: dict
    label: str
    too_long: str = "truncate"  # what instruction data does with a document longer than the window

    @property
    def is_sharded(self) -> bool:
        """Whether the entry is a folder of shards (a text corpus) rather than one token file (instruction data,
        an indexed dataset)."""
        return "shards" in self.index

    def token_files(self) -> list[Path]:
        """The token files, in stream order: each shard's ``.bin``, or the one file."""
        if not self.is_sharded:
            return [Path(self.location)]
        return [Path(self.location) / f"{shard['name']}.bin" for shard in self.index["shards"]]

    def tokens(self):
        """Every token as one stream (``TokenShards``: memory-mapped, sliced as int64)."""
        from ppctl.data.shards import TokenShards

        shards = self.index["shards"] if self.is_sharded else [self.index]
        dtypes = [shard.get("dtype", self.index["dtype"]) for shard in shards]  # an indexed corpus's pairs: their own
        return TokenShards(self.token_files(), dtypes, [shard["num_tokens"] for shard in shards])

    @property
    def is_instruction_data(self) -> bool:
        """Whether the entry carries per-token loss weights and document rows (``.weights``, ``.docs``)."""
        return "num_trained_tokens" in self.index

    def document_table(self):
        """The ``[end, file, row]`` int64 rows of each document (instruction data only)."""
        import numpy as np

        return np.fromfile(sidecar_path(self.location, ".docs"), dtype=np.int64).reshape(-1, 3)

    def loss_weights(self):
        """The memory-mapped uint8 loss weight of each token (instruction data only)."""
        import numpy as np

        return np.memmap(sidecar_path(self.location, ".weights"), dtype=np.uint8, mode="r")

    def check_lengths(self, seq_length: int) -> int:
        """How many documents are longer than a window of ``seq_length + 1`` tokens; with ``too_long=refuse``,
        ``DataError`` naming the first one's file and row."""
        if not self.is_instruction_data:
            return 0
        table = self.document_table()
        lengths = table[:, 0] - document_starts(table)
        too_long = (lengths > seq_length + 1).nonzero()[0]
        if len(too_long) and self.too_long == "refuse":
            end, file, row = (int(value) for value in table[too_long[0]])
            raise DataError(f"{self.index['files'][file]} {row_name(self.index, file)} {row}: holds "
                            f"{int(lengths[too_long[0]]):,} tokens, longer than a window of trainer.seq_length+1="
                            f"{seq_length + 1} ({len(too_long):,} such row(s)); set data.too_long=truncate, a longer "
                            f"trainer.seq_length, or shorten it")
        return len(too_long)

    def split(self, name: str) -> tuple[int, int]:
        """The ``[start, end)`` token range of split ``name`` (``train`` or ``validation``)."""
        if name not in SPLITS:
            raise ValueError(f"unknown split {name!r}; splits: {', '.join(SPLITS)}")
        start, end = self.index["splits"][name]
        return int(start), int(end)

    def check_split(self, name: str, seq_length: int) -> None:
        """Raise ``DataError`` unless split ``name`` holds at least one window of ``seq_length + 1`` tokens."""
        start, end = self.split(name)
        window, num_tokens = seq_length + 1, end - start
        if num_tokens >= window:
            return
        if name == "train":
            raise DataError(f"{self.label}: the train split holds {num_tokens:,} tokens, fewer than one window of "
                            f"trainer.seq_length+1={window}; use a larger corpus, a shorter trainer.seq_length or a "
                            f"smaller data.validation_fraction")
        raise DataError(f"{self.label}: the validation split holds {num_tokens:,} tokens (data.validation_fraction="
                        f"{self.index['validation_fraction']} of {self.index['num_tokens']:,}), fewer than one window "
                        f"of trainer.seq_length+1={window}; raise data.validation_fraction or set trainer.eval_every=0")

    def summary(self, seq_length: int | None = None) -> str:
        """One line: where the tokens are, how many, from what, and the split (instruction data: how many are
        trained on, the rows skipped, and with ``seq_length`` the documents longer than a window)."""
        index = self.index
        if self.is_instruction_data:
            return self._instruction_summary(seq_length)
        hub = index["file_type"] == "hub"
        origin = f"hub dataset {index['source_path']}" if hub else f"{index['num_files']} file(s)"
        shards = f" ({len(index['shards'])} shards)" if len(index.get("shards", ())) > 1 else ""
        return (f"{self.location}{shards}: {index['num_tokens']:,} tokens from {index['num_documents']:,} "
                f"document(s) in {origin}{skipped_rows_note(index)}; train {self.split('train')[1]:,}, validation "
                f"{self.split('validation')[1] - self.split('validation')[0]:,} "
                f"(data.validation_fraction={index['validation_fraction']})")


    def _instruction_summary(self, seq_length: int | None) -> str:
        """The summary of instruction data."""
        index = self.index
        skipped = "".join(f", {count:,} skipped ({why})" for why, count in index["skipped_rows"].items() if count)
        long_note = ""
        if seq_length is not None and (num_long := self.check_lengths(seq_length)):
            long_note = (f"; {num_long:,} longer than a window of trainer.seq_length+1={seq_length + 1} "
                         f"({'truncated' if self.too_long == 'truncate' else 'refused'})")
        return (f"{self.location}: {index['num_tokens']:,} tokens ({index['num_trained_tokens']:,} trained on) "
                f"from {index['num_documents']:,} {index['source']} row(s) of {index['num_rows']:,} in "
                f"{index['num_files']} file(s){skipped}{long_note}; train {self.split('train')[1]:,}, validation "
                f"{self.split('validation')[1] - self.split('validation')[0]:,} "
                f"(data.validation_fraction={index['validation_fraction']})")


def row_name(index: dict, file: int) -> str:
    """How a row of file ``file`` is named: ``line`` (jsonl, counted from 1) or ``record`` (a json list, from 0)."""
    return "line" if index["files"][file].endswith(".jsonl") else "record"


def document_starts(table):
    """Where each document of a ``.docs`` table starts: the end of the one before it (0 for the first)."""
    import numpy as np

    return np.concatenate([np.zeros(1, dtype=np.int64), table[:-1, 0]]) if len(table) else table[:, 0]


def sidecar_path(token_file: Path, suffix: str) -> Path:
    """The instruction-data file ``suffix`` (``.weights`` or ``.docs``) beside ``token_file``."""
    return Path(token_file).with_suffix(suffix)


def skipped_rows_note(index: dict) -> str:
    """``; 5 of 10 rows skipped (no "text" value)`` when rows gave no document, else nothing.

    A row has no value when its record lacks the field or holds null (a csv's empty cell is
    null too); a ``.txt`` corpus has one row per file, and an empty file is skipped.
    """
    skipped = index.get("skipped_rows") or {}
    missing, empty = skipped.get("missing", 0), skipped.get("empty", 0)
    if not missing and not empty:
        return ""
    rows = "files" if index["text_field"] is None else "rows"
    field = f'"{index["text_field"]}"'
    if index["text_field"] is None:
        why = "empty"
    elif missing and empty:
        why = f"{missing:,} with no {field} value, {empty:,} with {field} empty"
    else:
        why = f"no {field} value" if missing else f"{field} empty"
    return f"; {missing + empty:,} of {index['num_rows']:,} {rows} skipped ({why})"


def token_dtype_for(token_dtype: str, vocab_size: int) -> str:
    """The dtype name of token ids below ``vocab_size``: ``auto`` is uint16 up to 65,536 ids, else uint32."""
    if token_dtype not in TOKEN_DTYPES:
        raise DataError(f"data.token_dtype={token_dtype!r} must be one of {', '.join(TOKEN_DTYPES)}")
    if token_dtype == "uint16" and vocab_size > 1 << 16:
        raise DataError(f"data.token_dtype=uint16 holds 65,536 ids but the tokenizer has {vocab_size:,}; "
                        f"use data.token_dtype=uint32 or auto")
    if token_dtype == "auto":
        return "uint16" if vocab_size <= 1 << 16 else "uint32"
    return token_dtype


def split_bounds(num_tokens: int, validation_fraction: float, document_ends=None) -> dict[str, list[int]]:
    """The train and validation token ranges: validation is the last ``floor(fraction * num_tokens)`` tokens; with
    ``document_ends`` (instruction data) it starts at the first document that begins at or after that cut, so no
    conversation is split between the two."""
    cut = num_tokens - int(num_tokens * validation_fraction)
    if document_ends is not None and 0 < cut < num_tokens:
        starts = [0, *[int(end) for end in document_ends[:-1]]]
        cut = next((start for start in starts if start >= cut), num_tokens)
    return {"train": [0, cut], "validation": [cut, num_tokens]}


def split_entries(num_tokens: int, validation_fraction: float, document_ends=None) -> dict:
    """The index entries of the split: the fraction and each split's token range."""
    return {"validation_fraction": validation_fraction,
            "splits": split_bounds(num_tokens, validation_fraction, document_ends)}


def index_path(token_file: Path) -> Path:
    """Return the JSON index that describes ``token_file``."""
    return Path(token_file).with_suffix(".json")


def read_index(token_file: Path) -> dict:
    """Return the index stored next to ``token_file``."""
    return json.loads(index_path(token_file).read_text())


def write_index(token_file: Path, index: dict) -> None:
    """Write the index of ``token_file`` (atomically)."""
    write_atomically(index_path(token_file), lambda handle: handle.write(json.dumps(index, indent=2).encode()))


def cache_key(source_fingerprint: str, tokenizer: Tokenizer, dtype: str) -> str:
    """SHA-256 over the format version, the source fingerprint, the tokenizer and the token dtype."""
    identity = json.dumps(tokenizer.identity, sort_keys=True)
    header = f"v{CACHE_FORMAT_VERSION}|{source_fingerprint}|{identity}|{tokenizer.vocab_size}|{tokenizer.eod_id}"
    return hashlib.sha256(f"{header}|{dtype}".encode()).hexdigest()


def cache_stem(spec: CorpusSpec, corpus: Corpus, tokenizer: Tokenizer) -> str:
    """A readable file-name stem: source, what the path names, tokenizer."""
    if spec.source == "python_stdlib":
        parts = [spec.source]
    elif corpus.hub_name:
        parts = [spec.source, corpus.hub_name]
    elif len(corpus.files) == 1:
        parts = [spec.source, corpus.files[0].stem]
    else:
        parts = [spec.source, Path(spec.path).name if Path(spec.path).is_dir() else "glob"]
    parts.append(Path(tokenizer.name).stem)
    return "-".join(re.sub(r"[^\w.]+", "_", part)[:40] for part in parts)


def files_fingerprint(corpus: Corpus, text_field: str, cache_dir: Path, by: str = "content") -> str:
    """What the documents of local files depend on: their type, the text field, each file's name and, ``by``
    ``content``, its SHA-256 (read once, then remembered by path, size and mtime), or ``by`` ``stat`` its size and
    mtime alone (nothing read: a corpus too large to read once per preparation task)."""
    fingerprint = [corpus.file_type, "" if corpus.file_type == "text" else text_field]
    if by == "stat":
        stats = [file.stat() for file in corpus.files]
        return "|".join([*fingerprint, "stat", *(f"{file.name}:{stat.st_size}:{stat.st_mtime_ns}"
                                                 for file, stat in zip(corpus.files, stats))])
    digests = FileMemo(cache_dir / DIGEST_MEMO)
    fingerprint += [f"{file.name}:{digests.value(file, file_sha256)}" for file in corpus.files]
    digests.save()
    return "|".join(fingerprint)


class FileMemo:
    """What a function of a file's content gave (its SHA-256, its largest token id), remembered in a JSON file of
    the cache folder by the file's (path, size, mtime).

    A reused cache or an indexed corpus is then checked without reading a large corpus again (the
    launcher and then every worker look it up). A file modified in the last ``RACY_SECONDS`` is not
    remembered, since its mtime may not yet tell one version from the next.
    """

    def __init__(self, memo_file: Path):
        self.memo_file = memo_file
        try:
            self.entries = json.loads(memo_file.read_text())
        except (OSError, ValueError):
            self.entries = {}
        self.changed = False

    def value(self, file: Path, compute, variant: str = ""):
        """``compute(file)``, called only when ``file`` (read as ``variant``, e.g. a dtype) is unknown or changed."""
        stat = file.stat()
        key = str(file.resolve()) + (f"|{variant}" if variant else "")
        known = self.entries.get(key)
        if known is not None and known[:2] == [stat.st_size, stat.st_mtime_ns]:
            return known[2]
        value = compute(file)
        if time.time() - stat.st_mtime_ns / 1e9 > RACY_SECONDS:
            self.entries[key] = [stat.st_size, stat.st_mtime_ns, value]
            self.changed = True
        return value

    def save(self) -> None:
        """Write the memo back (atomically) when something new was learnt."""
        if self.changed:
            self.memo_file.parent.mkdir(parents=True, exist_ok=True)
            write_atomically(self.memo_file, lambda handle: handle.write(json.dumps(self.entries).encode()))


def valid_index(token_file: Path, key: str) -> dict | None:
    """The index of ``token_file`` when both files exist, match ``key`` and are complete; else None."""
    if not token_file.is_file() or not index_path(token_file).is_file():
        return None
    try:
        index = read_index(token_file)
        expected_bytes = index["num_tokens"] * TOKEN_BYTES[index["dtype"]]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    complete = index.get("format_version") == CACHE_FORMAT_VERSION and token_file.stat().st_size == expected_bytes
    if complete and "num_trained_tokens" in index:
        complete = _sidecars_complete(token_file, index)
    return index if complete and index.get("fingerprint") == key else None


def _sidecars_complete(token_file: Path, index: dict) -> bool:
    """Whether instruction data's ``.weights`` and ``.docs`` files hold a weight per token and a row per document."""
    from ppctl.data.indexed import index_file_bytes  # numpy: imported where tokens are read

    counts = {".weights": index["num_tokens"], ".docs": index["num_documents"]}
    for suffix, (value_bytes, per_row) in SIDECARS.items():
        file = sidecar_path(token_file, suffix)
        if not file.is_file() or file.stat().st_size != counts[suffix] * per_row * value_bytes:
            return False
    idx_file = sidecar_path(token_file, ".idx")  # the Megatron-LM index of the documents
    return idx_file.is_file() and idx_file.stat().st_size == index_file_bytes(index["num_documents"])


@contextlib.contextmanager
def staged_token_file(token_file: Path) -> Iterator[Path]:
    """A hidden temporary name next to ``token_file`` to write its tokens under; removed on the way out unless
    ``commit_entry`` renamed it into place (an error or an interruption leaves the cache as it was)."""
    descriptor, name = tempfile.mkstemp(dir=token_file.parent, prefix=f".{token_file.name}.", suffix=".tmp")
    os.close(descriptor)
    try:
        yield Path(name)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name)


def commit_entry(staged: Path, token_file: Path, index: dict, staged_sidecars: dict | None = None) -> None:
    """Put a built entry in place: the staged files of ``staged_sidecars`` (suffix -> staged path) renamed beside
    ``token_file``, then the staged token file renamed to ``token_file``, then its index written.

    Between the two a reader finds no index of this key, or one whose tokens are these: either way it
    takes nothing half-written for complete.
    """
    for suffix, staged_sidecar in (staged_sidecars or {}).items():
        os.chmod(staged_sidecar, 0o644)
        os.replace(staged_sidecar, sidecar_path(token_file, suffix))
    os.chmod(staged, 0o644)  # mkstemp creates 0600; caches are meant to be shared
    os.replace(staged, token_file)
    try:
        write_index(token_file, index)
    except BaseException:  # a signal or an error between the two: no token file without its index is left
        with contextlib.suppress(FileNotFoundError):
            os.unlink(token_file)
        raise


def token_file_record(token_file: Path, dtype: str) -> dict:
    """What the index records of the token file as written: its size and mtime, and its largest id."""
    stat = token_file.stat()  # before the read: a change while reading shows as another mtime next time
    return {"token_file_stat": [stat.st_size, stat.st_mtime_ns], "max_token_id": read_max_token_id(token_file, dtype)}


def check_token_ids(prepared: PreparedCorpus, tokenizer: Tokenizer) -> None:
    """Raise ``DataError`` when a token file of ``prepared`` holds an id outside ``tokenizer``'s vocabulary.

    Such a file was changed after it was built (the cache key covers the tokenizer), and a
    worker would fail on it with an index error of the embedding; the model's vocabulary
    (``model.vocab_size``) is at least the tokenizer's, which config validation checks.
    """
    for token_file, record in _token_file_records(prepared):
        largest = max_token_id(token_file, record, prepared.index["dtype"])
        if largest >= tokenizer.vocab_size:
            what = index_path(token_file).name if not prepared.is_sharded else f"{token_file.stem}.json"
            raise DataError(f"{token_file}: holds token id {largest:,}, outside the vocabulary of the {tokenizer.name} "
                            f"tokenizer ({tokenizer.vocab_size:,} ids, 0-{tokenizer.vocab_size - 1:,}); it changed "
                            f"after it was built: delete it and {what} to rebuild them")


def _token_file_records(prepared: PreparedCorpus) -> list[tuple[Path, dict]]:
    """Each token file with what was recorded of it as built (``token_file_stat``, ``max_token_id``)."""
    if not prepared.is_sharded:
        return [(Path(prepared.location), prepared.index)]
    pairs = []
    for token_file in prepared.token_files():
        try:
            record = json.loads(token_file.with_suffix(".json").read_text())
            record = {"token_file_stat": record["bin_stat"], "max_token_id": record["max_token_id"]}
        except (OSError, ValueError, KeyError):
            record = {}
        pairs.append((token_file, record))
    return pairs


def max_token_id(token_file: Path, record: dict, dtype: str) -> int:
    """The largest id in ``token_file``: the ``record``'s while the file keeps the size and mtime it was built
    with (no read, so a reused cache costs nothing), else read from the file (memory-mapped)."""
    stat = token_file.stat()
    if (record.get("token_file_stat") == [stat.st_size, stat.st_mtime_ns]
            and isinstance(record.get("max_token_id"), int)):
        return record["max_token_id"]
    return read_max_token_id(token_file, dtype)


def read_max_token_id(token_file: Path, dtype: str) -> int:
    """The largest id in ``token_file`` (-1 when it is empty), read ``MAX_ID_CHUNK_TOKENS`` at a time (a
    corpus of any size in bounded memory)."""
    import numpy as np

    dtype = np.dtype(dtype).newbyteorder("<")
    num_tokens, largest = token_file.stat().st_size // dtype.itemsize, -1
    with open(token_file, "rb") as stream:
        for _ in range(0, num_tokens, MAX_ID_CHUNK_TOKENS):
            chunk = np.fromfile(stream, dtype=dtype, count=MAX_ID_CHUNK_TOKENS)
            largest = max(largest, int(chunk.max()))
    return largest


def check_indexed_token_ids(token_files: list[Path], dtypes: list[str], tokenizer: Tokenizer,
                            cache_dir: Path) -> None:
    """Raise ``DataError`` (one line naming the file) when a ``.bin`` of an indexed corpus holds an id outside
    ``tokenizer``'s vocabulary (a worker would fail on it with an index error of the embedding).

    Each file's largest id is read once and remembered in ``cache_dir``'s ``MAX_ID_MEMO`` by its (path,
    size, mtime): a later launch, and each of its workers, reads nothing of an unchanged corpus.
    """
    memo = FileMemo(Path(cache_dir) / MAX_ID_MEMO)
    try:
        for token_file, dtype in zip(token_files, dtypes):
            largest = memo.value(token_file, lambda file: read_max_token_id(file, dtype), dtype)
            if largest >= tokenizer.vocab_size:
                raise DataError(f"{token_file}: holds token id {largest:,}, outside the vocabulary of the "
                                f"{tokenizer.name} tokenizer ({tokenizer.vocab_size:,} ids, "
                                f"0-{tokenizer.vocab_size - 1:,}); data.tokenizer must be the tokenizer the corpus "
                                f"was made with")
    finally:
        with contextlib.suppress(OSError):  # a cache folder that cannot be written costs a read next time, no more
            memo.save()  # what was read stays known, a refused file's id too
