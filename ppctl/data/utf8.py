"""Text that is not UTF-8: the one line that names where its first bad byte is.

A ``.txt``, ``.json``/``.jsonl`` or ``.csv`` file is named with the line and byte offset of
its first bad byte; a parquet value (or a hub dataset's) by its file, row and column. The
files are read on the failing path only.
"""

from __future__ import annotations

import re
from pathlib import Path

from ppctl.data.corpus import Corpus, DataError, one_line
from ppctl.fileio import exception_in_chain

TEXT_FILE_TYPES = ("text", "json", "csv")  # read as UTF-8 text: a bad byte is found by line and byte offset
SCAN_BLOCK_BYTES = 1 << 20
ENCODING_WORDS = re.compile(r"utf-?8|codec|encoding", re.IGNORECASE)


def is_encoding_error(error: BaseException) -> bool:
    """Whether a reader's error is about bytes that are not UTF-8: a ``UnicodeDecodeError`` (.txt, .csv), or a
    message that says so (the json reader's "Invalid octet in UTF-8 sequence")."""
    return decode_error(error) is not None or ENCODING_WORDS.search(one_line(error)) is not None


def decode_error(error: BaseException) -> UnicodeDecodeError | None:
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
        return DataError(f"{corpus.label}: cannot read its {corpus.file_type} files: {one_line(error)}")
    return DataError(f"{corpus.label}: not UTF-8 text: {one_line(decode_error(error) or error)}")


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
