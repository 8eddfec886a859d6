"""A piece of a corpus read as blocks of texts, streaming: memory holds one block, never a file or the corpus.

Each file type is read as the Hugging Face ``datasets`` builder of that type reads it (ppctl read corpora through
them before), so rows, nulls and errors keep their meaning: ``.jsonl`` and ``.json`` by pyarrow's JSON reader (a
``.json`` file that is not JSON lines: a list of records, parsed whole), ``.csv`` by pandas in chunks of 10,000
rows (an empty cell, ``NA``, ``null``... is null), parquet by row-group batches, ``.txt`` whole as one document
(strict UTF-8). A row's text is None when the field is missing or null. Every failure is one ``DataError`` line.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from ppctl.data.corpus import Corpus, DataError, one_line
from ppctl.data.shards import Piece
from ppctl.data.utf8 import file_in_message, is_encoding_error, not_utf8_error

BLOCK_BYTES = 8 << 20  # input bytes per block of a line file: tokenised and written before the next is read
CSV_CHUNK_ROWS = 10_000  # datasets' own chunk size for csv
BATCH_ROWS = 4096  # rows per batch of a parquet file or a hub dataset
TEXT_TYPES = ("string", "large_string", "null")


@dataclass(frozen=True)
class TextBlock:
    """Rows of one block: each row's text (None: the field missing or null) and the fields the block holds."""

    texts: list
    fields: tuple[str, ...]
    input_bytes: int = 0  # the input bytes it was read from, where known (progress)


def piece_blocks(corpus: Corpus, piece: Piece, text_field: str, hub_documents=None) -> Iterator[TextBlock]:
    """The blocks of ``piece`` of ``corpus`` (``hub_documents``: the loaded hub dataset a ``rows`` piece reads)."""
    if piece.kind == "rows":
        yield from _arrow_blocks(hub_documents.data.slice(piece.start, piece.stop - piece.start), text_field,
                                 corpus, "its train split", piece.start)
        return
    file = corpus.files[piece.file]
    if corpus.file_type == "text":
        yield TextBlock([_read_text(corpus, file)], ("text",), file.stat().st_size)
    elif corpus.file_type == "parquet":
        yield from _parquet_blocks(corpus, file, piece, text_field)
    elif corpus.file_type == "csv":
        yield from _csv_blocks(corpus, file, text_field)
    elif piece.kind == "whole" and file.suffix.lower() != ".jsonl":
        yield _json_file_block(corpus, file, text_field)
    else:
        for data in line_blocks(file, piece.start, piece.stop if piece.kind == "bytes" else file.stat().st_size):
            block = _json_lines_block(corpus, data, text_field)
            yield TextBlock(block.texts, block.fields, len(data))


def line_blocks(file: Path, start: int, stop: int, block_bytes: int = BLOCK_BYTES) -> Iterator[bytes]:
    """Bytes ``[start, stop)`` of ``file`` in blocks of about ``block_bytes``, each ending after a newline (the
    last: where the range ends)."""
    with open(file, "rb") as stream:
        stream.seek(start)
        carry, left = b"", stop - start
        while left > 0:
            data = stream.read(min(block_bytes, left))
            left -= len(data)
            if not data:
                break
            data = carry + data
            cut = data.rfind(b"\n") + 1 if left > 0 else len(data)
            carry = data[cut:]
            if cut:
                yield data[:cut]
        if carry:
            yield carry


def _read_text(corpus: Corpus, file: Path) -> str:
    """A ``.txt`` (or other plain) file's text, strict UTF-8."""
    try:
        return file.read_bytes().decode("utf-8")
    except UnicodeDecodeError as error:
        raise not_utf8_error(corpus, error) from None


def _json_lines_block(corpus: Corpus, data: bytes, text_field: str) -> TextBlock:
    """One block of JSON lines parsed by pyarrow (blank lines hold no record)."""
    import pyarrow as pa

    if not data.strip():
        return TextBlock([], ())
    try:
        table = _parse_json_lines(data)
    except pa.ArrowInvalid as error:
        if is_encoding_error(error):
            raise not_utf8_error(corpus, error) from None
        raise DataError(f"{corpus.label}: cannot read its json files: {one_line(error)}") from None
    return _table_block(table, text_field, corpus)


def _parse_json_lines(data: bytes):
    """pyarrow's table of JSON lines ``data`` (one block: a line of any length)."""
    import pyarrow as pa
    import pyarrow.json as pajson

    return pajson.read_json(pa.py_buffer(data), read_options=pajson.ReadOptions(block_size=len(data) + 1))


def _json_file_block(corpus: Corpus, file: Path, text_field: str) -> TextBlock:
    """A ``.json`` file: JSON lines when pyarrow reads it so, else one JSON list of records (``datasets``' order)."""
    import pyarrow as pa

    data = file.read_bytes()
    if not data.strip():
        return TextBlock([], ())
    try:
        return _table_block(_parse_json_lines(data), text_field, corpus)
    except pa.ArrowInvalid as error:
        if is_encoding_error(error):
            raise not_utf8_error(corpus, error) from None
    try:
        records = json.loads(data)
    except UnicodeDecodeError as error:
        raise not_utf8_error(corpus, error) from None
    except ValueError as error:
        raise DataError(f"{corpus.label}: cannot read its json files: {file.name}: {one_line(error)}") from None
    if not isinstance(records, list) or not all(isinstance(record, dict) for record in records):
        raise DataError(f"{corpus.label}: cannot read its json files: {file.name} holds neither JSON lines nor a "
                        f"list of records")
    try:
        table = pa.Table.from_pylist(records)
    except (pa.ArrowInvalid, pa.ArrowTypeError) as error:
        raise DataError(f"{corpus.label}: cannot read its json files: {file.name}: {one_line(error)}") from None
    return _table_block(table, text_field, corpus)


def _table_block(table, text_field: str, corpus: Corpus) -> TextBlock:
    """The rows of an Arrow table: its ``text_field`` column checked to hold text."""
    fields = tuple(table.column_names)
    if text_field not in fields:
        return TextBlock([None] * table.num_rows, fields)
    column = table.column(text_field)
    _check_text_type(column.type, text_field, corpus)
    try:
        return TextBlock(column.to_pylist(), fields)
    except UnicodeDecodeError as error:  # the JSON reader keeps a string's bytes as they are
        raise not_utf8_error(corpus, error) from None


def _check_text_type(arrow_type, text_field: str, corpus: Corpus) -> None:
    """``DataError`` unless a column of ``arrow_type`` holds text (or only nulls)."""
    import pyarrow as pa

    if not (pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type) or pa.types.is_null(arrow_type)):
        raise DataError(f"data.text_field={text_field} of {corpus.label} holds Value('{arrow_type}'), not text")


def _arrow_blocks(table, text_field: str, corpus: Corpus, where: str, first_row: int) -> Iterator[TextBlock]:
    """Batches of an Arrow table (a hub dataset's, a parquet file's), each value's UTF-8 checked first."""
    fields = tuple(table.column_names)
    if text_field not in fields:
        yield TextBlock([None] * table.num_rows, fields)
        return
    for start in range(0, table.num_rows, BATCH_ROWS):
        column = table.column(text_field).slice(start, BATCH_ROWS)
        yield TextBlock(_checked_texts(column, text_field, corpus, where, first_row + start), fields)


def _checked_texts(column, text_field: str, corpus: Corpus, where: str, first_row: int) -> list:
    """A column's values as Python text, each value's UTF-8 checked (Arrow does not check a file's strings)."""
    import pyarrow as pa

    _check_text_type(column.type, text_field, corpus)
    for chunk_start, chunk in _chunks(column):
        try:
            chunk.validate(full=True)
        except pa.ArrowInvalid:
            row, byte = _first_bad_value(chunk)
            raise DataError(f"{corpus.label}: {where} is not UTF-8: the row at index {first_row + chunk_start + row} "
                            f"holds 0x{byte:02x} in column {text_field}; write its text as UTF-8") from None
    return column.to_pylist()


def _chunks(column):
    """(offset, chunk) of a chunked column, or the one array."""
    chunks = getattr(column, "chunks", [column])
    offset = 0
    for chunk in chunks:
        yield offset, chunk
        offset += len(chunk)


def _first_bad_value(chunk) -> tuple[int, int]:
    """(row, byte) of the first value of a string array that is not UTF-8."""
    import pyarrow as pa

    as_bytes = pa.large_binary() if pa.types.is_large_string(chunk.type) else pa.binary()
    for row, value in enumerate(chunk.view(as_bytes).to_pylist()):
        if value is not None:
            try:
                value.decode("utf-8")
            except UnicodeDecodeError as error:
                return row, value[error.start]
    return 0, 0


def _parquet_blocks(corpus: Corpus, file: Path, piece: Piece, text_field: str) -> Iterator[TextBlock]:
    """The row groups of a parquet piece in batches."""
    import pyarrow as pa
    import pyarrow.parquet as parquet

    try:
        reader = parquet.ParquetFile(file)
    except (pa.ArrowInvalid, OSError) as error:
        raise DataError(f"{corpus.label}: cannot read its parquet files: {one_line(error)}") from None
    metadata, fields = reader.metadata, tuple(reader.schema_arrow.names)
    groups = range(piece.start, piece.stop) if piece.kind == "row_groups" else range(metadata.num_row_groups)
    first_row = sum(metadata.row_group(group).num_rows for group in range(groups.start))
    where = file_in_message(corpus, file)
    for group in groups:
        num_rows = metadata.row_group(group).num_rows
        if text_field not in fields:
            yield TextBlock([None] * num_rows, fields)
        else:
            table = reader.read_row_group(group, columns=[text_field])
            yield from (TextBlock(block.texts, fields)
                        for block in _arrow_blocks(table, text_field, corpus, where, first_row))
        first_row += num_rows


def _csv_blocks(corpus: Corpus, file: Path, text_field: str) -> Iterator[TextBlock]:
    """A csv file in chunks of rows read by pandas, as ``datasets``' csv builder reads it."""
    import pandas

    try:
        chunks = pandas.read_csv(file, iterator=True, chunksize=CSV_CHUNK_ROWS)
        for chunk in chunks:
            yield _csv_block(chunk, text_field, corpus)
    except UnicodeDecodeError as error:
        raise not_utf8_error(corpus, error) from None
    except pandas.errors.EmptyDataError:
        return
    except (pandas.errors.ParserError, ValueError) as error:
        if isinstance(error, DataError):
            raise
        raise DataError(f"{corpus.label}: cannot read its csv files: {one_line(error)}") from None


def _csv_block(chunk, text_field: str, corpus: Corpus) -> TextBlock:
    """One pandas chunk's rows: NaN is null; a column of numbers is no text."""
    fields = tuple(str(name) for name in chunk.columns)
    if text_field not in fields:
        return TextBlock([None] * len(chunk), fields)
    import pandas

    column = chunk[text_field]
    is_text = pandas.api.types.is_object_dtype(column) or pandas.api.types.is_string_dtype(column)
    if not is_text and not column.isna().all():
        raise DataError(f"data.text_field={text_field} of {corpus.label} holds Value('{column.dtype}'), not text")
    return TextBlock([value if isinstance(value, str) else None for value in column.tolist()], fields)
