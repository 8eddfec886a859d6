"""A corpus cut into shards, the share of one task, and the shards read back as one token stream.

A shard is a run of pieces of the corpus's files in corpus order: a byte range of a ``.jsonl`` file cut just after
a newline, a run of a parquet file's row groups, a run of a hub dataset's rows, or a whole file (``.txt``, ``.json``,
``.csv``, which cannot be cut without parsing them). ``plan_shards`` cuts by size alone (``data.shard_mib`` of
input per shard), from the files' sizes, their newlines near each cut and parquet's metadata: every task of a
preparation plans the same shards without talking to the others. ``ShardTask(index, count)`` takes the index-th of
``count`` contiguous groups of shards. ``TokenShards`` reads the shards' ``.bin`` files memory-mapped, in order, as
one stream. Pure numpy: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

NEWLINE_PROBE_BYTES = 1 << 16  # read this much at a time while looking for the newline after a cut
SPLIT_BY_LINES = (".jsonl",)  # suffixes whose files are cut at newlines (one record per line)


@dataclass(frozen=True)
class Piece:
    """Part of input file ``file`` (its index in the corpus): ``kind`` ``bytes`` ``[start, stop)`` of a line file,
    ``row_groups`` of a parquet file, ``rows`` of a hub dataset, or ``whole`` (start 0, stop its size)."""

    file: int
    kind: str
    start: int
    stop: int


@dataclass(frozen=True)
class Shard:
    """Shard ``index``: its pieces in corpus order and the input bytes they hold (about)."""

    index: int
    pieces: tuple[Piece, ...]
    input_bytes: int

    @property
    def name(self) -> str:
        """The stem of the shard's files: ``shard-00012``."""
        return f"shard-{self.index:05d}"


@dataclass(frozen=True)
class ShardTask:
    """Task ``index`` of ``count`` (a Slurm array's task): the index-th of ``count`` contiguous groups of shards."""

    index: int
    count: int

    def __post_init__(self):
        if self.count < 1 or not 0 <= self.index < self.count:
            raise ValueError(f"--task {self.index} --tasks {self.count}: the task must be 0 to tasks-1 "
                             f"(tasks >= 1)")

    def shards(self, shards: list[Shard]) -> list[Shard]:
        """This task's shards: ``[index*n/count, (index+1)*n/count)`` of the ``n`` shards (none when n < count)."""
        start, stop = (len(shards) * at // self.count for at in (self.index, self.index + 1))
        return shards[start:stop]


def plan_shards(units: list[Piece], unit_bytes: list[int], shard_bytes: int) -> list[Shard]:
    """Group ``units`` (pieces in corpus order, each of ``unit_bytes``) into shards of at most ``shard_bytes``
    (a unit larger than that is a shard alone); at least one shard, maybe empty."""
    shards, pieces, size = [], [], 0
    for unit, unit_size in zip(units, unit_bytes):
        if pieces and size + unit_size > shard_bytes:
            shards.append(Shard(len(shards), tuple(pieces), size))
            pieces, size = [], 0
        pieces.append(unit)
        size += unit_size
    shards.append(Shard(len(shards), tuple(pieces), size))
    return shards


def file_units(file_index: int, file: Path, shard_bytes: int) -> tuple[list[Piece], list[int]]:
    """The pieces one file gives and their sizes: a ``.jsonl`` file cut after the first newline at or after every
    ``shard_bytes``; a parquet file by row groups; any other file whole."""
    size = file.stat().st_size
    suffix = file.suffix.lower()
    if suffix == ".parquet":
        return _row_group_units(file_index, file)
    if suffix not in SPLIT_BY_LINES or size <= shard_bytes:
        return [Piece(file_index, "whole", 0, size)], [size]
    cuts = line_cuts(file, size, shard_bytes)
    edges = [0, *cuts, size]
    pieces = [Piece(file_index, "bytes", start, stop) for start, stop in zip(edges, edges[1:])]
    return pieces, [piece.stop - piece.start for piece in pieces]


def line_cuts(file: Path, size: int, every: int) -> list[int]:
    """The offsets just after the first newline at or after each multiple of ``every`` (increasing, inside the
    file, each once): each cut starts a line, so a piece holds whole records and exceeds ``every`` by less than a
    line."""
    cuts = []
    with open(file, "rb") as stream:
        for target in range(every, size, every):
            if cuts and target < cuts[-1]:  # inside the line the last cut ended: the same cut again
                continue
            cut = _next_line_start(stream, target, size)
            if cut is not None and cut < size:
                cuts.append(cut)
    return cuts


def _next_line_start(stream, offset: int, size: int) -> int | None:
    """The offset after the first newline at or after ``offset`` (None when there is none)."""
    stream.seek(offset)
    while offset < size:
        block = stream.read(NEWLINE_PROBE_BYTES)
        if not block:
            return None
        found = block.find(b"\n")
        if found >= 0:
            return offset + found + 1
        offset += len(block)
    return None


def _row_group_units(file_index: int, file: Path) -> tuple[list[Piece], list[int]]:
    """A parquet file's row groups, each a piece, sized by their uncompressed bytes (one piece when unreadable:
    the reader then says what is wrong)."""
    import pyarrow.parquet as parquet

    try:
        metadata = parquet.ParquetFile(file).metadata
    except Exception:  # not parquet: the shard's reader reports it in one line
        return [Piece(file_index, "whole", 0, file.stat().st_size)], [file.stat().st_size]
    groups = [metadata.row_group(group) for group in range(metadata.num_row_groups)]
    if not groups:
        return [Piece(file_index, "row_groups", 0, 0)], [0]
    return ([Piece(file_index, "row_groups", group, group + 1) for group in range(len(groups))],
            [group.total_byte_size for group in groups])


def row_units(num_rows: int, num_bytes: int, shard_bytes: int) -> tuple[list[Piece], list[int]]:
    """A hub dataset's rows as pieces of about ``shard_bytes`` each (by its mean row size)."""
    rows_per_piece = max(1, shard_bytes * max(num_rows, 1) // max(num_bytes, 1))
    starts = list(range(0, max(num_rows, 1), rows_per_piece))
    pieces = [Piece(0, "rows", start, min(start + rows_per_piece, num_rows)) for start in starts]
    mean = num_bytes / max(num_rows, 1)
    return pieces, [int((piece.stop - piece.start) * mean) for piece in pieces]


class TokenShards:
    """Token files read as one stream, in order: ``len`` is every token, ``[start:stop]`` an int64 array (a slice
    may cross files). Each file is memory-mapped once, as ``dtype`` (one per file)."""

    def __init__(self, files: list[Path], dtypes: list[str], counts: list[int]):
        self.files = [Path(file) for file in files]
        self.arrays = [np.memmap(file, dtype=np.dtype(dtype).newbyteorder("<"), mode="r", shape=(count,))
                       if count else np.zeros(0, dtype=dtype) for file, dtype, count in zip(files, dtypes, counts)]
        self.starts = np.zeros(len(self.arrays) + 1, dtype=np.int64)
        np.cumsum([len(array) for array in self.arrays], out=self.starts[1:])

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, where: slice) -> np.ndarray:
        """Tokens ``[start, stop)`` of the stream as int64 (step 1 only)."""
        start, stop, step = where.indices(len(self))
        if step != 1:
            raise ValueError("TokenShards reads contiguous slices only")
        if stop <= start:
            return np.zeros(0, dtype=np.int64)
        first = int(np.searchsorted(self.starts, start, side="right")) - 1
        last = int(np.searchsorted(self.starts, stop, side="left")) - 1
        pieces = [self.arrays[file][max(start - self.starts[file], 0):stop - self.starts[file]]
                  for file in range(first, last + 1)]
        return np.concatenate(pieces).astype(np.int64, copy=False) if len(pieces) > 1 else pieces[0].astype(np.int64)

    def view(self, start: int, stop: int) -> "TokenRange":
        """Tokens ``[start, stop)`` of the stream as a stream of their own (a split)."""
        return TokenRange(self, start, stop)


@dataclass(frozen=True)
class TokenRange:
    """Part ``[start, stop)`` of a ``TokenShards`` stream, indexed from 0."""

    shards: TokenShards
    start: int
    stop: int

    def __len__(self) -> int:
        return self.stop - self.start

    @property
    def size(self) -> int:
        """Tokens in the range (as numpy's ``size``)."""
        return len(self)

    def __getitem__(self, where: slice) -> np.ndarray:
        begin, end, _ = where.indices(len(self))
        return self.shards[self.start + begin:self.start + max(begin, end)]
