"""Turn a corpus into a cached flat token file with an index.

``data.path`` is resolved to a corpus (``resolve_corpus``: local files of one type,
or a hub dataset; pure file-system look-ups, so config validation uses it too), loaded
as documents through Hugging Face ``datasets``, tokenised with ``Dataset.map`` (batched, ``num_proc`` processes),
each document followed by the end-of-document token, and the whole stream is written
once as ``<name>.bin`` (a flat array of unsigned ints) with a ``<name>.json`` index
(source, tokenizer, dtype, counts, fingerprints, train/validation split). Both files
are written to a temporary name and renamed, so a reader never sees a half-written
cache. The cache key covers the inputs' content, the tokenizer and the dtype; the
validation fraction is not part of it: another fraction reuses the tokens and
rewrites only the index's split.

Sources (``data.source``):
  * ``python_stdlib``: the top-level ``*.py`` files of this Python's standard
    library, sorted by name, one document each; no download.
  * ``text``: ``data.path``, a file, folder or glob of ``.txt`` (one document per
    file), ``.json``/``.jsonl``, ``.parquet`` or ``.csv`` files (one document per
    row, its ``data.text_field``), or a hub dataset name.

Every failure is one ``DataError`` line: the log records ``datasets`` and ``huggingface_hub``
print on their way to an error are silenced, files without a record are named as such, a file
that is not UTF-8 is named with the line and byte offset (a parquet value by its row) of the first
bytes that are not, and a hub dataset is not tried where it cannot load (offline without it in
the cache, or the hub unreachable) rather than retried for half a minute.

Rows without text (no value in the text field, or an empty one) are no document; the index
counts them and the summary says how many were skipped and why. The index also records the
largest token id and the token file's size and mtime; a cache whose token file changed since
is read again, and one that holds an id outside the tokenizer's vocabulary is refused.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import logging
import os
import re
import socket
import sysconfig
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from ppctl.data.tokenizer import Tokenizer, build_tokenizer
from ppctl.fileio import exception_in_chain, file_sha256, write_atomically

TOKEN_SOURCES = ("python_stdlib", "text")
TOKEN_DTYPES = ("auto", "uint16", "uint32")
TOKEN_BYTES = {"uint16": 2, "uint32": 4}  # numpy is imported only where tokens are made (config validation is quick)
SPLITS = ("train", "validation")
CACHE_FORMAT_VERSION = 3  # 3: the index records skipped rows, the largest id and the token file's stat
DEFAULT_CACHE_DIR = Path("data/cache")  # relative to the repository root, git-ignored
DEFAULT_VALIDATION_FRACTION = 0.05
# Below this much text one process tokenises faster than several (measured: see data/README.md).
SMALL_CORPUS_BYTES = 64 << 20
MAX_AUTO_NUM_PROC = 4
DIGEST_MEMO = "file-digests.json"
RACY_SECONDS = 2.0  # a file modified this recently is re-read: its mtime may not yet tell two versions apart
# File suffix -> the Hugging Face ``datasets`` builder that reads it.
FILE_TYPES = {".txt": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}
KNOWN_SUFFIXES = ".txt, .json, .jsonl, .parquet or .csv"
GLOB_CHARACTERS = ("*", "?", "[")
HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")
LIBRARY_LOGGERS = ("datasets", "huggingface_hub")  # silenced while ppctl turns their errors into one line
DEFAULT_HUB_ENDPOINT = "https://huggingface.co"
HUB_CONNECT_S = 5.0  # how long the hub may take to accept a connection before it counts as unreachable
TRUE_VALUES = ("1", "ON", "YES", "TRUE")  # what the Hugging Face libraries read as a set flag
EMPTY_PROBE_BYTES = 1 << 16  # a file this small holding only whitespace holds no record
TEXT_FILE_TYPES = ("text", "json", "csv")  # read as UTF-8 text: a bad byte is found by line and byte offset
SCAN_BLOCK_BYTES = 1 << 20
ENCODING_WORDS = re.compile(r"utf-?8|codec|encoding", re.IGNORECASE)


class DataError(ValueError):
    """A data source that cannot be prepared; the message is one line naming the setting."""


@dataclass(frozen=True)
class Corpus:
    """Documents to tokenise: ``files`` of one ``file_type`` (a ``FILE_TYPES`` value), or ``hub_name``.

    ``label`` names the source in messages (``data.path=...`` or ``data.source=...``).
    """

    label: str
    file_type: str | None
    files: tuple[Path, ...] = ()
    hub_name: str | None = None


def stdlib_source_files() -> list[Path]:
    """Return the top-level ``*.py`` files of the running Python's stdlib, sorted by name."""
    stdlib_dir = Path(sysconfig.get_paths()["stdlib"])
    return sorted(stdlib_dir.glob("*.py"), key=lambda file: file.name)


def stdlib_corpus() -> Corpus:
    """The embedded default: each stdlib ``*.py`` file is one plain-text document."""
    return Corpus("data.source=python_stdlib", "text", tuple(stdlib_source_files()))


def resolve_corpus(path: str) -> Corpus:
    """Return the corpus ``data.path`` names, or raise ``DataError`` (one line).

    A file is read by its suffix (any other suffix: plain text, one document); a
    folder (searched recursively, hidden entries skipped) or a glob takes its files
    with a known suffix, all of one type (``.json`` and ``.jsonl`` are one type). A
    path that exists nowhere and looks like a hub name (``owner/name`` or ``name``)
    is a hub dataset.
    """
    label = f"data.path={path}"
    target = Path(path).expanduser()
    if any(character in path for character in GLOB_CHARACTERS):
        files = sorted(Path(name) for name in glob.glob(str(target), recursive=True) if Path(name).is_file())
        if not files:
            raise DataError(f"{label}: the glob matches no file")
    elif target.is_dir():
        files = sorted(file for file in target.rglob("*") if file.is_file()
                       and not any(part.startswith(".") for part in file.relative_to(target).parts))
        if not files:
            raise DataError(f"{label}: the folder holds no file")
    elif target.is_file():
        return Corpus(label, FILE_TYPES.get(target.suffix.lower(), "text"), (target,))
    elif looks_like_hub_name(path):
        return Corpus(label, None, hub_name=path)
    else:
        raise DataError(f"{label}: no such file, folder or glob")
    known = tuple(file for file in files if file.suffix.lower() in FILE_TYPES)
    return Corpus(label, _one_file_type(label, files), known)


def looks_like_hub_name(path: str) -> bool:
    """Whether ``path`` reads as a hub dataset name: ``owner/name`` or ``name``, no data-file suffix."""
    return HUB_NAME.fullmatch(path) is not None and Path(path).suffix.lower() not in FILE_TYPES


def _one_file_type(label: str, files: list[Path]) -> str:
    """The one file type among ``files`` (others ignored), or ``DataError`` naming what was found."""
    types = sorted({FILE_TYPES[file.suffix.lower()] for file in files if file.suffix.lower() in FILE_TYPES})
    if not types:
        raise DataError(f"{label}: none of its {len(files)} file(s) ends in {KNOWN_SUFFIXES}")
    if len(types) > 1:
        raise DataError(f"{label}: mixes file types {', '.join(types)}; a corpus takes files of one type "
                        f"(.json and .jsonl count as one): narrow the glob or split the folder")
    return types[0]


@dataclass(frozen=True)
class CorpusSpec:
    """What to prepare: the ``data`` settings that shape a token file, and where to cache it."""

    source: str
    path: str | None = None
    cache_dir: Path = DEFAULT_CACHE_DIR
    tokenizer: str = "byte"
    text_field: str = "text"
    token_dtype: str = "auto"
    validation_fraction: float = DEFAULT_VALIDATION_FRACTION
    num_proc: int | None = None

    @classmethod
    def of(cls, data) -> CorpusSpec:
        """The spec of a ``DataConfig`` (``config.data``)."""
        return cls(data.source, data.path, Path(data.cache_dir), data.tokenizer, data.text_field, data.token_dtype,
                   data.validation_fraction, data.num_proc)

    def corpus(self) -> Corpus:
        """The documents this spec names, or ``DataError`` (one line)."""
        if self.source == "python_stdlib":
            if self.path is not None:
                raise DataError(f"data.source=python_stdlib takes no data.path (got {self.path}); "
                                f"use data=text data.path=...")
            return stdlib_corpus()
        if self.source == "text":
            if not self.path:
                raise DataError("data.source=text needs data.path: a file, folder, glob or hub dataset name")
            return resolve_corpus(self.path)
        raise DataError(f"data.source={self.source!r} has no token file; token-file sources: "
                        f"{', '.join(TOKEN_SOURCES)}")


@dataclass(frozen=True)
class PreparedCorpus:
    """A prepared token file, its index (``read_index``) and the label that names its source in messages."""

    token_file: Path
    index: dict
    label: str

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

    def summary(self) -> str:
        """One line: where the tokens are, how many, from what, and the split."""
        index = self.index
        hub = index["file_type"] == "hub"
        origin = f"hub dataset {index['source_path']}" if hub else f"{index['num_files']} file(s)"
        return (f"{self.token_file}: {index['num_tokens']:,} tokens from {index['num_documents']:,} document(s) in "
                f"{origin}{skipped_rows_note(index)}; train {self.split('train')[1]:,}, validation "
                f"{self.split('validation')[1] - self.split('validation')[0]:,} "
                f"(data.validation_fraction={index['validation_fraction']})")


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


def split_bounds(num_tokens: int, validation_fraction: float) -> dict[str, list[int]]:
    """The train and validation token ranges: validation is the last ``floor(fraction * num_tokens)`` tokens."""
    num_validation = int(num_tokens * validation_fraction)
    return {"train": [0, num_tokens - num_validation], "validation": [num_tokens - num_validation, num_tokens]}


def index_path(token_file: Path) -> Path:
    """Return the JSON index that describes ``token_file``."""
    return Path(token_file).with_suffix(".json")


def read_index(token_file: Path) -> dict:
    """Return the index stored next to ``token_file``."""
    return json.loads(index_path(token_file).read_text())


def prepare_corpus(spec: CorpusSpec, progress: bool = False) -> PreparedCorpus:
    """Return the prepared token file of ``spec``, tokenising it into ``spec.cache_dir`` unless cached.

    ``progress`` shows the progress bars of ``datasets`` (loading, tokenising) on stderr.
    Raises ``DataError`` (one line) for a source that cannot be prepared.
    """
    corpus = spec.corpus()
    tokenizer = build_tokenizer(spec.tokenizer)
    dtype = token_dtype_for(spec.token_dtype, tokenizer.vocab_size)
    cache_dir = Path(spec.cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    hub_documents = _load_hub(corpus, progress) if corpus.hub_name else None
    if hub_documents is not None:
        source_fingerprint = f"hub|{corpus.hub_name}|{hub_documents._fingerprint}"
    else:
        source_fingerprint = _files_fingerprint(corpus, spec.text_field, cache_dir)
    key = _cache_key(source_fingerprint, tokenizer, dtype)
    token_file = cache_dir / f"{_cache_stem(spec, corpus, tokenizer)}-{key[:16]}.bin"
    index = _valid_index(token_file, key)
    if index is None:
        index = _build_cache(spec, corpus, hub_documents, tokenizer, dtype, token_file, progress)
        index.update(source_fingerprint=hashlib.sha256(source_fingerprint.encode()).hexdigest(), fingerprint=key,
                     **_split_entries(index["num_tokens"], spec.validation_fraction))
        _write_index(token_file, index)
    elif index["validation_fraction"] != spec.validation_fraction:
        index.update(_split_entries(index["num_tokens"], spec.validation_fraction))
        _write_index(token_file, index)  # the tokens stay; only the split moves
    check_token_ids(token_file, index, tokenizer)
    return PreparedCorpus(token_file, index, corpus.label)


def check_token_ids(token_file: Path, index: dict, tokenizer: Tokenizer) -> None:
    """Raise ``DataError`` when ``token_file`` holds an id outside ``tokenizer``'s vocabulary.

    Such a file was changed after it was built (the cache key covers the tokenizer), and a
    worker would fail on it with an index error of the embedding; the model's vocabulary
    (``model.vocab_size``) is at least the tokenizer's, which config validation checks.
    """
    largest = max_token_id(token_file, index)
    if largest >= tokenizer.vocab_size:
        raise DataError(f"{token_file}: holds token id {largest:,}, outside the vocabulary of the {tokenizer.name} "
                        f"tokenizer ({tokenizer.vocab_size:,} ids, 0-{tokenizer.vocab_size - 1:,}); it changed after "
                        f"it was built: delete it and {index_path(token_file).name} to rebuild them")


def max_token_id(token_file: Path, index: dict) -> int:
    """The largest id in ``token_file``: the index's record while the file keeps the size and mtime it was built
    with (no read, so a reused cache costs nothing), else read from the file (memory-mapped)."""
    stat = token_file.stat()
    if index.get("token_file_stat") == [stat.st_size, stat.st_mtime_ns] and isinstance(index.get("max_token_id"), int):
        return index["max_token_id"]
    return _read_max_token_id(token_file, index["dtype"])


def _read_max_token_id(token_file: Path, dtype: str) -> int:
    """The largest id in ``token_file`` (-1 when it is empty)."""
    import numpy as np

    if token_file.stat().st_size == 0:
        return -1
    return int(np.memmap(token_file, dtype=dtype, mode="r").max())


def _token_file_record(token_file: Path, dtype: str) -> dict:
    """What the index records of the token file as written: its size and mtime, and its largest id."""
    stat = token_file.stat()  # before the read: a change while reading shows as another mtime next time
    return {"token_file_stat": [stat.st_size, stat.st_mtime_ns], "max_token_id": _read_max_token_id(token_file, dtype)}


def _split_entries(num_tokens: int, validation_fraction: float) -> dict:
    return {"validation_fraction": validation_fraction, "splits": split_bounds(num_tokens, validation_fraction)}


def _cache_key(source_fingerprint: str, tokenizer: Tokenizer, dtype: str) -> str:
    """SHA-256 over the format version, the source fingerprint, the tokenizer and the token dtype."""
    identity = json.dumps(tokenizer.identity, sort_keys=True)
    header = f"v{CACHE_FORMAT_VERSION}|{source_fingerprint}|{identity}|{tokenizer.vocab_size}|{tokenizer.eod_id}"
    return hashlib.sha256(f"{header}|{dtype}".encode()).hexdigest()


def _cache_stem(spec: CorpusSpec, corpus: Corpus, tokenizer: Tokenizer) -> str:
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


def _files_fingerprint(corpus: Corpus, text_field: str, cache_dir: Path) -> str:
    """What the documents of local files depend on: their type, the text field, each file's name and content."""
    fingerprint = [corpus.file_type, "" if corpus.file_type == "text" else text_field]
    digests = FileDigests(cache_dir / DIGEST_MEMO)
    fingerprint += [f"{file.name}:{digests.digest(file)}" for file in corpus.files]
    digests.save()
    return "|".join(fingerprint)


class FileDigests:
    """SHA-256 of input files, remembered in the cache folder by (path, size, mtime).

    A reused cache is then found without reading a large corpus again (the launcher
    and then every worker look it up). A file modified in the last ``RACY_SECONDS``
    is not remembered, since its mtime may not yet tell one version from the next.
    """

    def __init__(self, memo_file: Path):
        self.memo_file = memo_file
        try:
            self.entries = json.loads(memo_file.read_text())
        except (OSError, ValueError):
            self.entries = {}
        self.changed = False

    def digest(self, file: Path) -> str:
        """The SHA-256 of ``file``'s content (read only when unknown or changed)."""
        stat, key = file.stat(), str(file.resolve())
        known = self.entries.get(key)
        if known is not None and known[:2] == [stat.st_size, stat.st_mtime_ns]:
            return known[2]
        digest = file_sha256(file)
        if time.time() - stat.st_mtime_ns / 1e9 > RACY_SECONDS:
            self.entries[key] = [stat.st_size, stat.st_mtime_ns, digest]
            self.changed = True
        return digest

    def save(self) -> None:
        """Write the memo back (atomically) when something new was learnt."""
        if self.changed:
            write_atomically(self.memo_file, lambda handle: handle.write(json.dumps(self.entries).encode()))


def _valid_index(token_file: Path, key: str) -> dict | None:
    """The index of ``token_file`` when both files exist, match ``key`` and are complete; else None."""
    if not token_file.is_file() or not index_path(token_file).is_file():
        return None
    try:
        index = read_index(token_file)
        expected_bytes = index["num_tokens"] * TOKEN_BYTES[index["dtype"]]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    complete = index.get("format_version") == CACHE_FORMAT_VERSION and token_file.stat().st_size == expected_bytes
    return index if complete and index.get("fingerprint") == key else None


def _build_cache(spec: CorpusSpec, corpus: Corpus, hub_documents, tokenizer: Tokenizer, dtype: str,
                 token_file: Path, progress: bool) -> dict:
    """Load, tokenise and write ``token_file``; return the index entries that describe its content.

    The Arrow files that ``datasets`` builds go to a scratch folder next to the cache,
    removed afterwards.
    """
    with tempfile.TemporaryDirectory(dir=token_file.parent, prefix=".hf-scratch-") as scratch, \
            _datasets_progress(progress) as datasets:
        documents = hub_documents if hub_documents is not None else _load_files(corpus, scratch)
        column = _text_column(documents, corpus, spec.text_field)
        tokenized = _tokenize(datasets, documents, corpus, column, tokenizer, dtype, spec.num_proc, scratch)
        num_tokens, num_documents = _write_tokens(tokenized.data.column("ids"), token_file, corpus.label)
        num_rows, missing = documents.num_rows, documents.data.column(column).null_count
        del tokenized, documents  # release the memory-mapped scratch files before the folder goes
    return {
        "format_version": CACHE_FORMAT_VERSION,
        "source": spec.source,
        "source_path": spec.path if corpus.hub_name or spec.path is None else str(Path(spec.path).resolve()),
        "file_type": corpus.file_type or "hub",
        "text_field": None if corpus.file_type == "text" else column,
        "num_files": len(corpus.files),
        "num_rows": num_rows,
        "num_documents": num_documents,
        "skipped_rows": {"missing": missing, "empty": num_rows - num_documents - missing},
        "num_tokens": num_tokens,
        "vocab_size": tokenizer.vocab_size,
        "eod_id": tokenizer.eod_id,
        "tokenizer": tokenizer.identity,
        "dtype": dtype,
        **_token_file_record(token_file, dtype),
    }


def _tokenize(datasets, documents, corpus: Corpus, column: str, tokenizer: Tokenizer, dtype: str,
              num_proc: int | None, scratch: str):
    """``documents.map`` of ``TokenizeBatch`` into the scratch folder; text that is not UTF-8 is one ``DataError``.

    json and parquet rows reach this step undecoded (Arrow does not check their UTF-8), so a bad
    byte fails here, in whichever process tokenises its row.
    """
    try:
        return documents.map(
            TokenizeBatch(tokenizer, dtype, column), batched=True, remove_columns=documents.column_names,
            num_proc=_num_proc(num_proc, documents), desc=f"tokenising ({tokenizer.name})",
            features=datasets.Features({"ids": datasets.Sequence(datasets.Value(dtype))}),
            cache_file_name=str(Path(scratch) / "tokens.arrow"),
        )
    except Exception as error:
        if _decode_error(error) is None:
            raise
        raise not_utf8_error(corpus, error, documents) from None


class TokenizeBatch:
    """The ``Dataset.map`` function: each text's ids plus the end-of-document id; an empty text gives none.

    A class rather than a closure so that ``num_proc`` workers receive it pickled.
    """

    def __init__(self, tokenizer: Tokenizer, dtype: str, column: str):
        self.tokenizer, self.dtype, self.column = tokenizer, dtype, column

    def __call__(self, batch: dict) -> dict:
        import numpy as np

        texts = [text or "" for text in batch[self.column]]
        eod = np.array([self.tokenizer.eod_id], dtype=self.dtype)
        return {"ids": [np.concatenate([ids.astype(self.dtype), eod]) if text else np.empty(0, dtype=self.dtype)
                        for text, ids in zip(texts, self.tokenizer.encode_batch(texts))]}


def _num_proc(requested: int | None, documents) -> int:
    """Tokenising processes: ``data.num_proc``, else 1 for a small corpus and min(4, cores) for a large one."""
    if requested is None:
        small = documents.data.nbytes < SMALL_CORPUS_BYTES
        requested = 1 if small else min(MAX_AUTO_NUM_PROC, os.cpu_count() or 1)
    return max(1, min(requested, documents.num_rows))


def _write_tokens(ids_column, token_file: Path, label: str) -> tuple[int, int]:
    """Write the flat token stream of an Arrow list column to ``token_file``; return (tokens, documents)."""
    import pyarrow.compute as compute

    lengths = compute.list_value_length(ids_column)
    num_tokens = int(compute.sum(lengths).as_py() or 0)
    num_documents = int(compute.sum(compute.greater(lengths, 0)).as_py() or 0)
    if num_tokens == 0:
        raise DataError(f"{label}: the corpus holds no text ({len(ids_column)} empty document(s))")

    def write(handle) -> None:
        for chunk in ids_column.chunks:
            chunk.flatten().to_numpy(zero_copy_only=False).tofile(handle)

    write_atomically(token_file, write)
    return num_tokens, num_documents


def _load_files(corpus: Corpus, scratch: str):
    """Load local files with the ``datasets`` builder of their type (``.txt``: one document per file)."""
    import datasets

    if corpus.file_type != "text":  # a .txt file is one document, even an empty one
        _refuse_without_records(corpus)
    # .txt is decoded strictly, as every other type: replacing bad bytes with U+FFFD would train on
    # text the file does not hold, without a word
    options = {"sample_by": "document"} if corpus.file_type == "text" else {}
    try:
        with quiet_library_logs():
            return datasets.load_dataset(corpus.file_type, data_files=[str(file) for file in corpus.files],
                                         split="train", cache_dir=scratch, **options)
    except Exception as error:  # datasets wraps parser errors in several classes; report one line
        if _is_encoding_error(error):
            raise not_utf8_error(corpus, error) from None
        if "corresponds to no data" in _one_line(error):  # e.g. a csv header alone, a json []
            raise DataError(f"{corpus.label}: its {corpus.file_type} file(s) hold no records") from None
        raise DataError(f"{corpus.label}: cannot read its {corpus.file_type} files: {_one_line(error)}") from None


def _is_encoding_error(error: BaseException) -> bool:
    """Whether a reader's error is about bytes that are not UTF-8: a ``UnicodeDecodeError`` (.txt, .csv), or a
    message that says so (the json reader's "Invalid octet in UTF-8 sequence")."""
    return _decode_error(error) is not None or ENCODING_WORDS.search(_one_line(error)) is not None


def _decode_error(error: BaseException) -> UnicodeDecodeError | None:
    """The ``UnicodeDecodeError`` that ``error`` is or was caused by (``datasets`` wraps it), or None."""
    return exception_in_chain(error, UnicodeDecodeError)


def not_utf8_error(corpus: Corpus, error: BaseException, documents=None) -> DataError:
    """The one line for a corpus that is not UTF-8: the file, and the line and byte offset of its first bad byte
    (text files), or the row and column of the first bad value (parquet files, hub datasets); when the files
    are UTF-8 after all, the reader's ``error`` in one line."""
    if corpus.file_type in TEXT_FILE_TYPES:  # read on this failing path only
        for file in corpus.files:
            found = first_invalid_utf8(file)
            if found is not None:
                line, offset, byte = found
                return DataError(f"{corpus.label}: {_file_in_message(corpus, file)} is not UTF-8: line {line} (byte "
                                 f"offset {offset}) holds 0x{byte:02x}; convert the file to UTF-8")
    found = _first_invalid_row(documents) if documents is not None else None
    if found is not None:
        row, column, byte = found
        where, row = _row_origin(corpus, row)
        return DataError(f"{corpus.label}: {where} is not UTF-8: the row at index {row} holds 0x{byte:02x} in column "
                         f"{column}; write its text as UTF-8")
    if documents is None:  # a reader's error whose words were about something else
        return DataError(f"{corpus.label}: cannot read its {corpus.file_type} files: {_one_line(error)}")
    return DataError(f"{corpus.label}: not UTF-8 text: {_one_line(_decode_error(error) or error)}")


def first_invalid_utf8(file: Path) -> tuple[int, int, int] | None:
    """(line, byte offset, byte) of the first byte of ``file`` that is not UTF-8, or None when all of it is.

    Reads in blocks; a character cut by a block's end is completed by the next block.
    """
    import codecs

    decoder = codecs.getincrementaldecoder("utf-8")()
    line, read = 1, 0
    with open(file, "rb") as handle:
        while True:
            block = handle.read(SCAN_BLOCK_BYTES)
            pending = decoder.getstate()[0]  # the start of a character cut by the last block's end
            try:
                decoder.decode(block, final=not block)
            except UnicodeDecodeError as error:  # error.object is pending + block
                return (line + error.object[:error.start].count(b"\n"), read - len(pending) + error.start,
                        error.object[error.start])
            if not block:
                return None
            line, read = line + block.count(b"\n"), read + len(block)


def _first_invalid_row(documents) -> tuple[int, str, int] | None:
    """(row, column, byte) of the first string value of ``documents`` that is not UTF-8, or None."""
    import pyarrow as pa

    for name in documents.column_names:
        column = documents.data.column(name)
        if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
            continue
        as_bytes = pa.large_binary() if pa.types.is_large_string(column.type) else pa.binary()
        start = 0
        for chunk in column.chunks:
            try:
                chunk.validate(full=True)  # checks the UTF-8 of every value, in C++
            except pa.ArrowInvalid:  # then find the row in Python, in this chunk only
                for index, value in enumerate(chunk.view(as_bytes).to_pylist()):
                    byte = _first_bad_byte(value)
                    if byte is not None:
                        return start + index, name, byte
            start += len(chunk)
    return None


def _first_bad_byte(value: bytes | None) -> int | None:
    """The first byte of ``value`` that is not UTF-8, or None (for None too)."""
    if value is None:
        return None
    try:
        value.decode("utf-8")
    except UnicodeDecodeError as error:
        return value[error.start]
    return None


def _row_origin(corpus: Corpus, row: int) -> tuple[str, int]:
    """The file that row ``row`` of a loaded corpus comes from, and the row's index in it.

    Parquet files say how many rows they hold without being read; other corpora name the
    whole corpus (a hub dataset: its train split) and the row's index in it.
    """
    if corpus.file_type == "parquet":
        import pyarrow.parquet as parquet

        for file in corpus.files:
            num_rows = parquet.ParquetFile(file).metadata.num_rows
            if row < num_rows:
                return _file_in_message(corpus, file), row
            row -= num_rows
    return ("its train split" if corpus.hub_name else "the corpus"), row


def _file_in_message(corpus: Corpus, file: Path) -> str:
    """A corpus file as a message names it: its name when ``data.path`` is that file, else its path."""
    return file.name if len(corpus.files) == 1 else str(file)


def _refuse_without_records(corpus: Corpus) -> None:
    """``DataError`` when no file of the corpus holds anything but whitespace (``datasets`` has no word for it)."""
    if not all(_holds_nothing(file) for file in corpus.files):
        return
    if len(corpus.files) == 1:
        raise DataError(f"{corpus.label}: {corpus.files[0].name} holds no records (the file is empty or blank)")
    raise DataError(f"{corpus.label}: its {len(corpus.files)} {corpus.file_type} files hold no records "
                    f"(all are empty or blank)")


def _holds_nothing(file: Path) -> bool:
    """Whether a small file holds only whitespace (a large one is left to the reader)."""
    if file.stat().st_size > EMPTY_PROBE_BYTES:
        return False
    return not file.read_bytes().strip()


def _load_hub(corpus: Corpus, progress: bool):
    """Load the ``train`` split of a hub dataset (into the ``datasets`` cache; needs the network once).

    Offline (``HF_DATASETS_OFFLINE``/``HF_HUB_OFFLINE``) only the local cache is read; online, a hub
    that does not accept a connection fails at once instead of through the library's retries.
    """
    failed = f"{corpus.label}: no such file, folder or glob, and loading it as a Hugging Face hub dataset failed"
    offline = offline_flag()
    if offline is None:
        unreachable = hub_unreachable()
        if unreachable is not None:
            raise DataError(f"{failed}: {unreachable}; with the dataset in the local cache, set HF_HUB_OFFLINE=1")
    with _datasets_progress(progress) as datasets, quiet_library_logs():
        try:
            return datasets.load_dataset(corpus.hub_name, split="train")
        except Exception as error:
            if offline is not None:
                raise DataError(f"{failed}: it is not in the local cache, and {offline} (offline) keeps the hub out "
                                f"of reach") from None
            raise DataError(f"{failed}: {_one_line(error)}") from None


def offline_flag() -> str | None:
    """The setting that makes the Hugging Face libraries offline (``HF_DATASETS_OFFLINE=1``, else
    ``HF_HUB_OFFLINE=1``, as ``datasets`` reads them), or None when they may use the network."""
    for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
        value = os.environ.get(name)
        if value is not None:
            return f"{name}={value}" if value.upper() in TRUE_VALUES else None
    return None


def hub_unreachable() -> str | None:
    """Why the Hugging Face hub (``HF_ENDPOINT``) cannot be reached now, or None when it accepts a connection."""
    from urllib.parse import urlsplit

    endpoint = os.environ.get("HF_ENDPOINT", DEFAULT_HUB_ENDPOINT)
    parts = urlsplit(endpoint)
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
        with socket.create_connection((parts.hostname or "", port), timeout=HUB_CONNECT_S):
            return None
    except (OSError, ValueError) as error:
        reason = getattr(error, "strerror", None) or str(error)
        return f"the hub {endpoint} cannot be reached ({reason})"


@contextlib.contextmanager
def quiet_library_logs() -> Iterator[None]:
    """Silence the log records of ``datasets`` and ``huggingface_hub`` for the block, then restore their levels:
    on the way to an error they print lines of their own, and ppctl reports the error in one."""
    loggers = [logging.getLogger(name) for name in LIBRARY_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def _text_column(documents, corpus: Corpus, text_field: str) -> str:
    """The column holding the text: ``text`` for ``.txt`` files, else ``data.text_field`` (checked)."""
    if corpus.file_type == "text":
        return "text"
    if text_field not in documents.column_names:
        raise DataError(f"data.text_field={text_field} is not a field of {corpus.label}; its fields: "
                        f"{', '.join(documents.column_names)}")
    feature = documents.features[text_field]
    if getattr(feature, "dtype", None) not in ("string", "large_string"):
        raise DataError(f"data.text_field={text_field} of {corpus.label} holds {feature}, not text")
    return text_field


def _one_line(error: BaseException) -> str:
    """The first line of an error, with its cause's first line when it has one."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    text = lines[0] if lines else type(error).__name__
    cause = error.__cause__ or error.__context__
    if cause is not None and str(cause).strip():
        text = f"{text.rstrip('.')}: {str(cause).strip().splitlines()[0]}"
    return text


@contextlib.contextmanager
def _datasets_progress(shown: bool) -> Iterator:
    """Import ``datasets``, show or hide its progress bars for the block, then restore their state."""
    import datasets

    were_disabled = datasets.are_progress_bars_disabled()
    datasets.enable_progress_bars() if shown else datasets.disable_progress_bars()
    try:
        yield datasets
    finally:
        datasets.disable_progress_bars() if were_disabled else datasets.enable_progress_bars()


def _write_index(token_file: Path, index: dict) -> None:
    write_atomically(index_path(token_file), lambda handle: handle.write(json.dumps(index, indent=2).encode()))
