"""A text corpus's cache entry: a folder of shards in Megatron-LM's indexed format, and the index that completes it.

The folder ``<stem>-<key16>/`` holds ``shard-NNNNN.bin`` + ``.idx`` (each pair an indexed dataset Megatron-LM reads
as it is) with ppctl's record of the shard, ``shard-NNNNN.json``, beside them, and ``index.json`` once every
shard is complete. Shards are independent: any process or Slurm task (``ShardTask``) may write any of them, a
shard left incomplete by an error or a signal is redone alone, and whoever completes the last writes the index,
from the shards' records alone, so every way of preparing a corpus writes the same bytes. ``data/README.md`` has
the fields.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ppctl.data.cache import CACHE_FORMAT_VERSION, TOKEN_BYTES, split_entries
from ppctl.data.corpus import Corpus, DataError
from ppctl.data.indexed import index_file_bytes
from ppctl.data.shards import Shard, ShardTask, file_units, plan_shards, row_units
from ppctl.data.tokenise import shard_record_path
from ppctl.fileio import write_atomically

ENTRY_INDEX = "index.json"
MIB = 1 << 20


def corpus_shards(corpus: Corpus, hub_documents, shard_bytes: int) -> list[Shard]:
    """The shards of ``corpus`` (its files, or the loaded hub dataset's rows), ``shard_bytes`` of input each."""
    if hub_documents is not None:
        units, sizes = row_units(hub_documents.num_rows, hub_documents.data.nbytes, shard_bytes)
        return plan_shards(units, sizes, shard_bytes)
    units, sizes = [], []
    for index, file in enumerate(corpus.files):
        file_pieces, file_sizes = file_units(index, file, shard_bytes)
        units += file_pieces
        sizes += file_sizes
    return plan_shards(units, sizes, shard_bytes)


def entry_index_path(folder: Path) -> Path:
    """The index that says the entry in ``folder`` is complete."""
    return folder / ENTRY_INDEX


def read_shard_record(folder: Path, shard: Shard, key: str) -> dict | None:
    """Shard ``shard``'s record when the shard is complete for ``key`` (its record there, its ``.bin`` and ``.idx``
    of the sizes it gives); else None."""
    try:
        record = json.loads(shard_record_path(folder, shard).read_text())
        complete = record["key"] == key and _pair_sizes_match(folder, shard, record)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return record if complete else None


def _pair_sizes_match(folder: Path, shard: Shard, record: dict) -> bool:
    """Whether the shard's ``.bin`` holds its tokens and its ``.idx`` its documents, to the byte."""
    bin_file, idx_file = (folder / f"{shard.name}{suffix}" for suffix in (".bin", ".idx"))
    idx_bytes = index_file_bytes(record["num_documents"])
    return (bin_file.is_file() and bin_file.stat().st_size == record["num_tokens"] * TOKEN_BYTES[record["dtype"]]
            and idx_file.is_file() and idx_file.stat().st_size == idx_bytes)


def valid_entry(folder: Path, key: str) -> dict | None:
    """The index of the entry in ``folder`` when it is complete for ``key``: its index there, and each shard's
    ``.bin`` and ``.idx`` of the sizes the index gives (no shard record is read: a corpus of thousands of shards is
    looked up by every worker); else None."""
    try:
        index = json.loads(entry_index_path(folder).read_text())
        if index.get("format_version") != CACHE_FORMAT_VERSION or index.get("fingerprint") != key:
            return None
        complete = all(_pair_sizes_match(folder, Shard(number, (), 0), {**shard, "dtype": index["dtype"]})
                       for number, shard in enumerate(index["shards"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return index if complete else None


@dataclass(frozen=True)
class PartialCorpus:
    """A preparation task's result while other shards are still missing: what it did and what is left."""

    folder: Path
    task: ShardTask
    written: list[Shard]
    tokens: int
    complete: int
    total: int

    def summary(self, seq_length: int | None = None) -> str:
        """One line: this task's shards and tokens, and how many of the corpus's shards are complete."""
        span = (f"shards {self.written[0].index}-{self.written[-1].index}" if self.written else "no shard")
        return (f"{self.folder}: task {self.task.index} of {self.task.count} wrote {span} ({self.tokens:,} tokens); "
                f"{self.complete} of {self.total} shard(s) of the corpus are complete: it is ready once every task "
                f"has run")


def entry_index(records: list[dict], header: dict, validation_fraction: float, label: str) -> dict:
    """The index of a complete entry, from its shards' records in order and ``header`` (what the corpus and the
    tokenizer say); ``DataError`` for a corpus without the text field, records or text."""
    fields = list(dict.fromkeys(field for record in records for field in record["fields"]))
    num_rows = sum(record["num_rows"] for record in records)
    text_field = header["text_field"]
    if text_field is not None and num_rows and not any(record["field_seen"] for record in records):
        raise DataError(f"data.text_field={text_field} is not a field of {label}; its fields: {', '.join(fields)}")
    if num_rows == 0:
        raise DataError(f"{label}: its {header['file_type']} file(s) hold no records")
    totals = {name: sum(record[name] for record in records)
              for name in ("num_documents", "num_tokens", "missing", "empty")}
    if totals["num_tokens"] == 0:
        raise DataError(f"{label}: the corpus holds no text ({num_rows} empty document(s))")
    return {
        "format_version": CACHE_FORMAT_VERSION, **header, "num_rows": num_rows,
        "num_documents": totals["num_documents"],
        "skipped_rows": {"missing": totals["missing"], "empty": totals["empty"]},
        "num_tokens": totals["num_tokens"],
        "max_token_id": max(record["max_token_id"] for record in records),
        "shards": [{"name": record["shard"], "num_tokens": record["num_tokens"],
                    "num_documents": record["num_documents"]} for record in records],
        **split_entries(totals["num_tokens"], validation_fraction),
    }


def write_entry_index(folder: Path, index: dict) -> None:
    """Write the entry's index (atomically): from now on the entry is complete."""
    write_atomically(entry_index_path(folder), lambda handle: handle.write(json.dumps(index, indent=2).encode()))
