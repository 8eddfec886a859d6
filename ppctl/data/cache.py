"""The token cache: its keys, its index, what makes an entry reusable, and how an entry is put in place.

An entry is ``<name>.bin`` (a flat array of unsigned ints) with a ``<name>.json`` index
(source, tokenizer, dtype, counts, fingerprints, train/validation split). The key covers the
inputs' content, the tokenizer and the dtype; the validation fraction is not part of it:
another fraction reuses the tokens and rewrites only the index's split. A new entry is
written under temporary names and renamed into place at the end, the token file first, so
a reader never takes a half-written entry for a complete one. The index also records the
largest token id and the token file's size and mtime; a token file that changed since is
read again, and one that holds an id outside the tokenizer's vocabulary is refused.
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
TOKEN_BYTES = {"uint16": 2, "uint32": 4}  # numpy is imported only where tokens are made (config validation is quick)
SPLITS = ("train", "validation")
CACHE_FORMAT_VERSION = 3  # 3: the index records skipped rows, the largest id and the token file's stat
DIGEST_MEMO = "file-digests.json"
RACY_SECONDS = 2.0  # a file modified this recently is re-read: its mtime may not yet tell two versions apart


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


def split_entries(num_tokens: int, validation_fraction: float) -> dict:
    """The index entries of the split: the fraction and each split's token range."""
    return {"validation_fraction": validation_fraction, "splits": split_bounds(num_tokens, validation_fraction)}


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


def files_fingerprint(corpus: Corpus, text_field: str, cache_dir: Path) -> str:
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
    return index if complete and index.get("fingerprint") == key else None


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


def commit_entry(staged: Path, token_file: Path, index: dict) -> None:
    """Put a built entry in place: the staged token file renamed to ``token_file``, then its index written.

    Between the two a reader finds no index of this key, or one whose tokens are these: either way it
    takes nothing half-written for complete.
    """
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
    return read_max_token_id(token_file, index["dtype"])


def read_max_token_id(token_file: Path, dtype: str) -> int:
    """The largest id in ``token_file`` (-1 when it is empty)."""
    import numpy as np

    if token_file.stat().st_size == 0:
        return -1
    return int(np.memmap(token_file, dtype=dtype, mode="r").max())
