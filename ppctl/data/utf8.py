"""Text that is not UTF-8: the one line that names where its first bad byte is.

A ``.txt``, ``.json``/``.jsonl`` or ``.csv`` file is named with the line and byte offset of
its first bad byte (a parquet value, or a hub dataset's, is named by its row and column where
``readers.py`` reads it). The files are read on the failing path only.
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


def not_utf8_error(corpus: Corpus, error: BaseException) -> DataError:
    """The one line for a text corpus that is not UTF-8: the file, and the line and byte offset of its first bad
    byte; when the files are UTF-8 after all, the reader's ``error`` in one line. (A parquet value or a hub dataset's
    is named by its row and column where it is read: ``readers.py``.)"""
    if corpus.file_type in TEXT_FILE_TYPES:  # read on this failing path only
        for file in corpus.files:
            found = first_invalid_utf8(file)
            if found is not None:
                line, offset, byte = found
                return DataError(f"{corpus.label}: {file_in_message(corpus, file)} is not UTF-8: line {line} (byte "
                                 f"offset {offset}) holds 0x{byte:02x}; convert the file to UTF-8")
    return DataError(f"{corpus.label}: cannot read its {corpus.file_type} files: {one_line(error)}")


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


def file_in_message(corpus: Corpus, file: Path) -> str:
    """A corpus file as a message names it: its name when ``data.path`` is that file, else its path."""
    return file.name if len(corpus.files) == 1 else str(file)
