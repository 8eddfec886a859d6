"""Documents in, tokens out: each shard of a corpus read in blocks, tokenised, written as a Megatron indexed pair.

A shard (``shards.py``) is read block by block (``readers.py``: one block in memory at a time), each text
tokenised with the tokenizer's own beginning- and end-of-text tokens and followed by the end-of-document id (unless
the tokenizer already ended it with that id), and appended to ``shard-NNNNN.bin``; the ``.idx`` (one sequence per
document) and the shard's own record ``shard-NNNNN.json`` are written at its end, each put in place atomically, the
record last: a shard with its record is complete. Rows without text (the field missing or null, or empty) are no
document, and are counted. ``run_shards`` runs the shards in this process or in ``num_proc`` forked processes that
take the next shard as they finish one; an error or a signal ends them all and keeps the shards already complete.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from ppctl.data.corpus import Corpus, DataError, one_line
from ppctl.data.indexed import IndexedWriter, staged_suffix
from ppctl.data.readers import piece_blocks
from ppctl.data.shards import Shard
from ppctl.data.tokenizer import Tokenizer
from ppctl.fileio import write_atomically

STOP_WAIT_S = 5.0  # how long an ended tokenising process may take to go before it is killed
POLL_S = 0.5  # how often the parent looks for a process that died without a word
ENCODE_BATCH = 1000  # texts per encode_batch call (datasets' map batch size, which ppctl used before)


@dataclass(frozen=True)
class ShardJob:
    """What every shard of one preparation shares: the corpus, its text field (None for ``.txt``), the tokenizer,
    the token dtype, the entry folder, the entry's key (recorded in each shard) and a loaded hub dataset."""

    corpus: Corpus
    text_field: str | None
    tokenizer: Tokenizer
    dtype: str
    folder: Path
    key: str
    hub_documents: object = None


def shard_record_path(folder: Path, shard: Shard) -> Path:
    """The record that says shard ``shard`` of the entry in ``folder`` is complete."""
    return folder / f"{shard.name}.json"


def tokenise_shard(job: ShardJob, shard: Shard, report: Callable[[int, int], None]) -> dict:
    """Tokenise ``shard`` into its ``.bin``/``.idx`` pair and record; return the record. ``report(input bytes,
    tokens)`` is called after each block."""
    counts = {"num_rows": 0, "num_documents": 0, "missing": 0, "empty": 0, "num_tokens": 0, "max_token_id": -1}
    fields: dict[str, None] = {}  # every field a block held, in the order first seen
    field_seen = job.text_field is None
    reported = 0
    with IndexedWriter(job.folder / shard.name, job.dtype) as writer:
        for piece in shard.pieces:
            for block in piece_blocks(job.corpus, piece, job.text_field or "text", job.hub_documents):
                fields.update(dict.fromkeys(block.fields))
                field_seen = field_seen or (job.text_field in block.fields)
                tokens, lengths = tokenise_texts(block.texts, job.tokenizer, counts)
                writer.add(tokens.astype(job.dtype), lengths)
                reported += block.input_bytes
                report(block.input_bytes, len(tokens))
    report(max(shard.input_bytes - reported, 0), 0)  # what the blocks did not count (parquet, hub rows)
    record = {"shard": shard.name, "key": job.key, **counts, "fields": list(fields), "field_seen": field_seen,
              "dtype": job.dtype, "bin_stat": _stat(writer.bin_file)}
    write_atomically(shard_record_path(job.folder, shard), lambda handle: handle.write(json.dumps(record).encode()),
                     staged_suffix())
    return record


def tokenise_texts(texts: list, tokenizer: Tokenizer, counts: dict) -> tuple[np.ndarray, list[int]]:
    """The tokens of a block's texts, back to back, and each document's length; ``counts`` grows by the block's
    rows, documents, rows without text (None: missing; "": empty), tokens, and its largest id."""
    present = [text for text in texts if text]
    counts["num_rows"] += len(texts)
    counts["missing"] += sum(text is None for text in texts)
    counts["empty"] += sum(text == "" for text in texts)
    if not present:
        return np.zeros(0, dtype=np.int64), []
    eod = np.array([tokenizer.eod_id], dtype=np.int64)
    pieces, lengths = [], []
    for ids in _encoded(tokenizer, present):
        ended = len(ids) and int(ids[-1]) == tokenizer.eod_id  # a post-processor's ``$A </s>`` ended it already
        pieces += [ids] if ended else [ids, eod]
        lengths.append(len(ids) + (not ended))
    tokens = np.concatenate(pieces)
    counts["num_documents"] += len(lengths)
    counts["num_tokens"] += len(tokens)
    counts["max_token_id"] = max(counts["max_token_id"], int(tokens.max()))
    return tokens, lengths


def _encoded(tokenizer: Tokenizer, texts: list[str]):
    """Each text's ids, encoded ``ENCODE_BATCH`` texts at a time: a whole block in one ``encode_batch`` ran at a
    third of the speed (measured: 2,250 documents of 3.5 kB per call against 1,000)."""
    for start in range(0, len(texts), ENCODE_BATCH):
        yield from tokenizer.encode_documents(texts[start:start + ENCODE_BATCH])


def _stat(file: Path) -> list[int]:
    """``[size, mtime_ns]`` of ``file``: a shard whose ``.bin`` still has them was not changed since."""
    stat = file.stat()
    return [stat.st_size, stat.st_mtime_ns]


class ShardRunner:
    """Runs shards and says how they go (``progress``: an object with ``advance(bytes, tokens)`` and
    ``shard_done(shard, record)``)."""

    def __init__(self, job: ShardJob, progress):
        self.job, self.progress = job, progress

    def run(self, shards: list[Shard], num_proc: int) -> dict[int, dict]:
        """Tokenise ``shards`` in ``num_proc`` processes (here when 1); return each shard's record by index."""
        if num_proc <= 1 or len(shards) <= 1:
            return {shard.index: self._here(shard) for shard in shards}
        return self._in_processes(shards, num_proc)

    def _here(self, shard: Shard) -> dict:
        """One shard in this process."""
        record = tokenise_shard(self.job, shard, self.progress.advance)
        self.progress.shard_done(shard, record)
        return record

    def _in_processes(self, shards: list[Shard], num_proc: int) -> dict[int, dict]:
        """Forked processes, each taking the next shard of a queue; messages come back on another."""
        context = multiprocessing.get_context("fork")
        todo, results = context.Queue(), context.Queue()
        for shard in shards:
            todo.put(shard.index)
        workers = [context.Process(target=_worker, args=(self.job, {shard.index: shard for shard in shards}, todo,
                                                         results), daemon=True) for _ in range(num_proc)]
        for _ in workers:
            todo.put(None)
        try:
            for worker in workers:
                worker.start()
            return self._collect(shards, workers, results)
        finally:
            _end(workers)
            for queue in (todo, results):  # a feeder thread left waiting would hold the exit
                queue.cancel_join_thread()
                queue.close()
            remove_temporaries(self.job.folder, shards, [worker.pid for worker in workers if worker.pid])

    def _collect(self, shards: list[Shard], workers, results) -> dict[int, dict]:
        """Take the processes' messages until every shard is recorded; a process's error is raised here."""
        import queue

        by_index, records = {shard.index: shard for shard in shards}, {}
        while len(records) < len(shards):
            try:
                message = results.get(timeout=POLL_S)
            except queue.Empty:
                _check_alive(workers, len(records), len(shards))
                continue
            if message[0] == "block":
                self.progress.advance(message[1], message[2])
            elif message[0] == "done":
                records[message[1]] = message[2]
                self.progress.shard_done(by_index[message[1]], message[2])
            elif message[0] == "error":
                raise DataError(message[1])
        return records


def _worker(job: ShardJob, shards: dict[int, Shard], todo, results) -> None:
    """A tokenising process: shards from ``todo`` until its ``None``; each one's blocks, record or error to
    ``results``."""
    while (index := todo.get()) is not None:
        try:
            record = tokenise_shard(job, shards[index], lambda size, tokens: results.put(("block", size, tokens)))
        except DataError as error:
            results.put(("error", str(error)))
            break
        except Exception as error:  # what the parent would not otherwise learn: one line of it
            results.put(("error", f"{job.corpus.label}: {shards[index].name}: {type(error).__name__}: "
                                  f"{one_line(error)}"))
            break
        results.put(("done", index, record))
    results.close()
    results.join_thread()  # every message out before the process goes


def remove_temporaries(folder: Path, shards: list[Shard], pids: list[int]) -> None:
    """Remove what the ended processes ``pids`` of this host left of ``shards`` mid-write (their staged
    ``.bin``/``.idx``, their record's temporary); another process's temporaries (another task's, another rank's
    preparing the same corpus) are not touched."""
    for shard in shards:
        for pid in pids:
            owned = staged_suffix(pid)
            for staged in (*folder.glob(f"{shard.name}.*{owned}"), *folder.glob(f".{shard.name}.json.*{owned}")):
                staged.unlink(missing_ok=True)


def _check_alive(workers, done: int, total: int) -> None:
    """``DataError`` when every tokenising process has gone with shards left (one was killed: out of memory?)."""
    if all(worker.exitcode is not None for worker in workers):
        codes = sorted({worker.exitcode for worker in workers})
        raise DataError(f"the tokenising processes ended (exit codes {', '.join(map(str, codes))}) with "
                        f"{total - done} of {total} shard(s) left; the shards finished are kept: run it again to "
                        f"resume")


def _end(workers) -> None:
    """End the tokenising processes: SIGTERM, then SIGKILL to any still there after ``STOP_WAIT_S``."""
    for worker in workers:
        if worker.is_alive():
            worker.terminate()
    deadline = time.monotonic() + STOP_WAIT_S
    for worker in workers:
        if worker.pid is None:
            continue
        worker.join(max(0.0, deadline - time.monotonic()))
        if worker.is_alive():
            worker.kill()
            worker.join()


def default_num_proc(requested: int | None, input_bytes: int, num_shards: int, small_bytes: int,
                     max_auto: int) -> int:
    """Tokenising processes: ``data.num_proc``, else 1 below ``small_bytes`` of input and min(``max_auto``, cores)
    above (the CPUs this process may run on: a Slurm task's, not the node's); never more than the shards."""
    if requested is None:
        requested = 1 if input_bytes < small_bytes else min(max_auto, len(os.sched_getaffinity(0)))
    return max(1, min(requested, num_shards))
