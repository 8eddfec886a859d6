"""Megatron-LM's indexed dataset (``PREFIX.idx`` + ``PREFIX.bin``), read memory-mapped and written.

The layout (``data/README.md`` has it field by field, with what it was checked against) is, all little-endian:
the ``.idx`` holds a 34-byte header (the magic ``MMIDIDX\\x00\\x00``, version 1 as uint64, a dtype code as uint8,
the sequence count and the document-index count as uint64), then each sequence's length in tokens (int32), each
sequence's byte offset into the ``.bin`` (int64) and the document index (int64: the sequence where each document
starts, then the sequence count); the ``.bin`` holds the tokens of every sequence, back to back. A document is
its sequences in order (one sequence per document unless the preprocessing split sentences).

``read_indexed`` refuses a missing, corrupt or truncated pair in one ``DataError`` line naming the file and what
is wrong; ``write_indexed`` writes the format (one sequence per document). Pure numpy: no torch here.
"""

from __future__ import annotations

import os
import socket
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ppctl.data.corpus import DataError

INDEX_MAGIC = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequence count, document-index count: 34 bytes
DTYPE_CODES = {1: "uint8", 2: "int8", 3: "int16", 4: "int32", 5: "int64", 6: "float64", 7: "float32", 8: "uint16"}
CODE_OF_DTYPE = {name: code for code, name in DTYPE_CODES.items()}
LENGTH_BYTES, POINTER_BYTES, DOCUMENT_INDEX_BYTES, MODE_BYTES = 4, 8, 8, 1


def indexed_paths(path: str | Path) -> tuple[Path, Path]:
    """The ``.idx`` and ``.bin`` files of ``path``: a prefix (``foo``), or either file (``foo.idx``, ``foo.bin``)."""
    path = Path(path).expanduser()
    prefix = path.with_suffix("") if path.suffix in (".idx", ".bin") else path
    return prefix.with_name(prefix.name + ".idx"), prefix.with_name(prefix.name + ".bin")


@dataclass(frozen=True)
class IndexedCorpus:
    """An indexed dataset, checked: its arrays are views of the memory-mapped ``.idx``, its tokens of the ``.bin``."""

    idx_file: Path
    bin_file: Path
    dtype: np.dtype
    sequence_lengths: np.ndarray  # int32 [sequences]: tokens in each sequence
    sequence_pointers: np.ndarray  # int64 [sequences]: byte offset of each sequence in the .bin
    document_indices: np.ndarray  # int64 [documents + 1]: the first sequence of each document, then the count

    @property
    def num_documents(self) -> int:
        """How many documents the index holds (empty ones included)."""
        return len(self.document_indices) - 1

    @property
    def num_tokens(self) -> int:
        """Every token of the ``.bin``."""
        return int(self.sequence_lengths.sum(dtype=np.int64))

    def tokens(self) -> np.ndarray:
        """The ``.bin`` memory-mapped: every document's tokens in order (the sequences lie back to back)."""
        if self.num_tokens == 0:
            return np.zeros(0, dtype=self.dtype)
        return np.memmap(self.bin_file, dtype=self.dtype, mode="r", shape=(self.num_tokens,))

    def document_bounds(self) -> np.ndarray:
        """int64 ``[documents + 1]``: the token offset where each document starts, then the token count."""
        sequence_starts = np.zeros(len(self.sequence_lengths) + 1, dtype=np.int64)
        np.cumsum(self.sequence_lengths, dtype=np.int64, out=sequence_starts[1:])
        return sequence_starts[self.document_indices]

    def document(self, index: int) -> np.ndarray:
        """The tokens of document ``index``."""
        bounds = self.document_bounds()
        return np.asarray(self.tokens()[bounds[index]:bounds[index + 1]])


def read_indexed(path: str | Path) -> IndexedCorpus:
    """Open the indexed dataset ``path`` names (``indexed_paths``), or raise ``DataError`` (one line) naming the
    file and what is wrong: a missing file, the magic, the version, the dtype code, counts that overrun the
    ``.idx``, lengths or pointers that overrun the ``.bin`` or leave gaps in it, a document index out of order."""
    idx_file, bin_file = indexed_paths(path)
    for file in (idx_file, bin_file):
        if not file.is_file():
            raise DataError(f"{file}: no such file; data.path names a Megatron-LM indexed dataset by its prefix "
                            f"(PREFIX for PREFIX.idx and PREFIX.bin)")
    idx_size, bin_size = idx_file.stat().st_size, bin_file.stat().st_size
    if idx_size < HEADER.size:
        raise DataError(f"{idx_file}: holds {idx_size} bytes, fewer than the {HEADER.size} of an index header "
                        f"(truncated?)")
    with open(idx_file, "rb") as stream:
        magic, version, code, num_sequences, num_indices = HEADER.unpack(stream.read(HEADER.size))
    if magic != INDEX_MAGIC:
        raise DataError(f"{idx_file}: begins with {magic!r}, not Megatron-LM's index magic {INDEX_MAGIC!r}: "
                        f"not an indexed dataset's .idx")
    if version != INDEX_VERSION:
        raise DataError(f"{idx_file}: index version {version}; ppctl reads version {INDEX_VERSION}")
    if code not in DTYPE_CODES:
        raise DataError(f"{idx_file}: unknown dtype code {code}; codes: "
                        f"{', '.join(f'{key} {name}' for key, name in DTYPE_CODES.items())}")
    needed = HEADER.size + num_sequences * (LENGTH_BYTES + POINTER_BYTES) + num_indices * DOCUMENT_INDEX_BYTES
    if idx_size < needed:
        raise DataError(f"{idx_file}: its header counts {num_sequences:,} sequences and {num_indices:,} document "
                        f"indices, which take {needed:,} bytes, but the file holds {idx_size:,} (truncated?)")
    if idx_size not in (needed, needed + num_sequences * MODE_BYTES):  # the second: a multimodal index's modes
        raise DataError(f"{idx_file}: holds {idx_size - needed:,} bytes after the document index, which its header "
                        f"does not account for")
    buffer = np.memmap(idx_file, dtype=np.uint8, mode="r")
    lengths = np.frombuffer(buffer, dtype="<i4", count=num_sequences, offset=HEADER.size)
    pointers = np.frombuffer(buffer, dtype="<i8", count=num_sequences, offset=HEADER.size + lengths.nbytes)
    documents = np.frombuffer(buffer, dtype="<i8", count=num_indices,
                              offset=HEADER.size + lengths.nbytes + pointers.nbytes)
    corpus = IndexedCorpus(idx_file, bin_file, np.dtype(DTYPE_CODES[code]).newbyteorder("<"), lengths, pointers,
                           documents)
    _check_document_indices(corpus)
    _check_sequences(corpus, bin_size)
    return corpus


def _check_document_indices(corpus: IndexedCorpus) -> None:
    """The document index starts at sequence 0, never decreases, and ends at the sequence count."""
    documents, num_sequences, file = corpus.document_indices, len(corpus.sequence_lengths), corpus.idx_file
    if len(documents) == 0:
        raise DataError(f"{file}: the document index is empty; it holds at least 0 and the sequence count")
    if documents[0] != 0:
        raise DataError(f"{file}: the document index starts at sequence {documents[0]}, not 0")
    if len(documents) > 1 and (decreasing := np.flatnonzero(np.diff(documents) < 0)).size:
        at = int(decreasing[0]) + 1
        raise DataError(f"{file}: the document index decreases at entry {at} ({documents[at - 1]} then "
                        f"{documents[at]}); it lists each document's first sequence in order")
    if documents[-1] != num_sequences:
        raise DataError(f"{file}: the document index ends at sequence {documents[-1]}, not at the sequence count "
                        f"{num_sequences}")


def _check_sequences(corpus: IndexedCorpus, bin_size: int) -> None:
    """No length is negative; every sequence lies inside the ``.bin``, each where the one before it ends; the
    ``.bin`` holds nothing after the last."""
    lengths, pointers, itemsize = corpus.sequence_lengths, corpus.sequence_pointers, corpus.dtype.itemsize
    if (negative := np.flatnonzero(lengths < 0)).size:
        raise DataError(f"{corpus.idx_file}: sequence {negative[0]} has length {lengths[negative[0]]}")
    sizes = lengths.astype(np.int64) * itemsize
    ends = pointers + sizes
    if (overrun := np.flatnonzero((pointers < 0) | (ends > bin_size))).size:
        first = int(overrun[0])
        raise DataError(f"{corpus.bin_file}: holds {bin_size:,} bytes, but sequence {first} of {corpus.idx_file.name} "
                        f"takes bytes {pointers[first]:,} to {ends[first]:,} (truncated, or not this index's .bin?)")
    expected = np.zeros_like(pointers)
    np.cumsum(sizes[:-1], out=expected[1:])
    if (gaps := np.flatnonzero(pointers != expected)).size:
        first = int(gaps[0])
        raise DataError(f"{corpus.idx_file}: sequence {first} starts at byte {pointers[first]:,} of the .bin, not "
                        f"{expected[first]:,} where the one before it ends; ppctl reads sequences that lie back to "
                        f"back, as Megatron-LM writes them")
    total = int(sizes.sum())
    if bin_size != total:
        raise DataError(f"{corpus.bin_file}: holds {bin_size:,} bytes, but the {len(lengths):,} sequences of "
                        f"{corpus.idx_file.name} take {total:,} (not this index's .bin?)")


def check_document_ends(corpus: IndexedCorpus, eod_id: int, why: str) -> None:
    """``DataError`` (one line) unless every non-empty document's last token is ``eod_id``; ``why`` says which
    setting needs it."""
    bounds = corpus.document_bounds()
    ends = bounds[1:][bounds[1:] > bounds[:-1]]
    if ends.size == 0:
        return
    last_tokens = np.asarray(corpus.tokens()[ends - 1])
    if (wrong := np.flatnonzero(last_tokens != eod_id)).size:
        document = int(np.flatnonzero(bounds[1:] == ends[wrong[0]])[0])
        raise DataError(f"{corpus.bin_file}: document {document:,} of {corpus.num_documents:,} ends with token "
                        f"{last_tokens[wrong[0]]}, not the end-of-document id {eod_id} ({len(wrong):,} such "
                        f"document(s)); {why} needs each document to end with it (Megatron-LM's preprocess_data.py "
                        f"--append-eod), or use data.documents=joined")


def write_indexed(prefix: str | Path, documents, dtype: str = "uint16") -> tuple[Path, Path]:
    """Write ``documents`` (sequences of token ids) as the indexed dataset ``prefix`` (``.idx`` and ``.bin``), one
    sequence per document, tokens as ``dtype`` (a ``DTYPE_CODES`` name); each file is written under a temporary
    name and renamed into place. Returns the two paths."""
    with IndexedWriter(prefix, dtype) as writer:
        for document in documents:
            tokens = np.asarray(document)
            writer.add(tokens, [len(tokens)])
    return writer.idx_file, writer.bin_file


def staged_suffix(pid: int | None = None) -> str:
    """The end of a temporary file's name owned by process ``pid`` (this one by default) of this host: two
    processes writing the same pair at once (training ranks preparing one corpus) never share a temporary, and
    a parent removes only what its own ended workers left."""
    return f".{socket.gethostname()}.{os.getpid() if pid is None else pid}.tmp"


class IndexedWriter:
    """Writes an indexed dataset as documents come: ``add`` appends documents' tokens to a temporary
    ``PREFIX.bin.*`` ending in ``staged_suffix()``; a block that ends without an error writes the ``.idx`` the
    same way and renames both into place (the ``.bin`` first); an error or a signal removes both temporaries, so a
    reader never finds a half-written pair. Writers of one pair at once (in several processes) each rename their
    own (equal) bytes."""

    def __init__(self, prefix: str | Path, dtype: str):
        if dtype not in CODE_OF_DTYPE:
            raise ValueError(f"dtype {dtype!r} has no Megatron-LM code; dtypes: {', '.join(CODE_OF_DTYPE)}")
        self.idx_file, self.bin_file = indexed_paths(prefix)
        self.dtype = np.dtype(dtype).newbyteorder("<")
        self.lengths: list[np.ndarray] = []
        self.staged: list[Path] = []
        self.stream = None

    def __enter__(self) -> "IndexedWriter":
        for file in (self.bin_file, self.idx_file):  # names of this writer's own, in this process's suffix
            descriptor, name = tempfile.mkstemp(dir=file.parent, prefix=f"{file.name}.", suffix=staged_suffix())
            os.close(descriptor)
            self.staged.append(Path(name))
        self.stream = open(self.staged[0], "wb")
        return self

    def add(self, tokens, lengths) -> None:
        """Append documents: their ``tokens`` back to back and each one's length (``lengths``, summing to them)."""
        self.stream.write(np.asarray(tokens, dtype=self.dtype).tobytes())
        self.lengths.append(np.asarray(lengths, dtype="<i4"))

    def __exit__(self, kind, error, traceback) -> None:
        try:
            if kind is None:
                self.stream.flush()
                os.fsync(self.stream.fileno())  # the tokens on disk before a name says they are there
            self.stream.close()
            if kind is None:
                self._commit()
        finally:
            for staged in self.staged:
                staged.unlink(missing_ok=True)

    def _commit(self) -> None:
        """Write the index, then rename the ``.bin`` and the ``.idx`` into place."""
        lengths = np.concatenate(self.lengths) if self.lengths else np.zeros(0, dtype="<i4")
        write_index_file(self.staged[1], lengths, self.dtype.name)
        for staged, final in zip(self.staged, (self.bin_file, self.idx_file)):
            os.chmod(staged, 0o644)
            os.replace(staged, final)


def write_index_file(idx_file: Path, lengths, dtype: str) -> None:
    """Write the ``.idx`` of documents of ``lengths`` tokens of ``dtype`` lying back to back in their ``.bin``
    (one sequence per document), flushed to disk."""
    lengths = np.asarray(lengths, dtype="<i4")
    itemsize = np.dtype(dtype).itemsize
    pointers = np.zeros(len(lengths), dtype="<i8")
    np.cumsum(lengths[:-1].astype(np.int64) * itemsize, out=pointers[1:])
    document_indices = np.arange(len(lengths) + 1, dtype="<i8")
    with open(idx_file, "wb") as stream:
        stream.write(HEADER.pack(INDEX_MAGIC, INDEX_VERSION, CODE_OF_DTYPE[dtype], len(lengths),
                                 len(document_indices)))
        for array in (lengths, pointers, document_indices):
            stream.write(array.tobytes())
        stream.flush()
        os.fsync(stream.fileno())


def index_file_bytes(num_documents: int) -> int:
    """The size of the ``.idx`` of ``num_documents`` documents of one sequence each."""
    return HEADER.size + num_documents * (LENGTH_BYTES + POINTER_BYTES) + (num_documents + 1) * DOCUMENT_INDEX_BYTES
