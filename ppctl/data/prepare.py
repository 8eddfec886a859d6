"""Turn a corpus into a cached flat token file with an index: the entry point that composes the data room.

``prepare_corpus`` resolves the spec's corpus (``corpus.py``: local files of one type, or a
hub dataset, ``hub.py``), keys the cache by the inputs' content, the tokenizer and the dtype
(``cache.py``), and reuses the entry it finds; otherwise it tokenises the corpus
(``tokenise.py``; text that is not UTF-8 is named by ``utf8.py``) into a new entry, written
under temporary names and put in place at the end, so that an error or a signal leaves the
cache as it was. Sources (``data.source``):

  * ``python_stdlib``: the top-level ``*.py`` files of this Python's standard
    library, sorted by name, one document each; no download.
  * ``text``: ``data.path``, a file, folder or glob of ``.txt`` (one document per
    file), ``.json``/``.jsonl``, ``.parquet`` or ``.csv`` files (one document per
    row, its ``data.text_field``), or a hub dataset name.

  * ``chat``, ``prompt_completion``: ``data.path``'s ``.jsonl``/``.json`` rows, with a loss
    weight per token (``instruction.py``).
  * ``indexed``: Megatron-LM indexed datasets (a prefix, a folder of pairs, a glob), read as they
    are (``prepared_indexed``): nothing is tokenised or written but each ``.bin``'s largest id.

Every failure is one ``DataError`` line.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from pathlib import Path

from ppctl.data.cache import (CACHE_FORMAT_VERSION, SIDECARS, PreparedCorpus, cache_key, cache_stem,
                              check_indexed_token_ids, check_token_ids, commit_entry, files_fingerprint, sidecar_path,
                              split_entries, staged_token_file, token_dtype_for, token_file_record, valid_index,
                              write_index)
from ppctl.data.corpus import INSTRUCTION_SOURCES, Corpus, CorpusSpec, DataError
from ppctl.data.entry import (MIB, PartialCorpus, corpus_shards, entry_index, read_shard_record, valid_entry,
                              write_entry_index)
from ppctl.data.hub import hub_fingerprint, load_hub
from ppctl.data.indexed import DTYPE_CODES, IndexedCorpus, read_indexed, write_index_file
from ppctl.data.instruction import InstructionOptions, chat_template_of, template_fingerprint, tokenise_instructions
from ppctl.data.progress import ShardProgress
from ppctl.data.shards import ShardTask
from ppctl.data.tokenise import ShardJob, ShardRunner, default_num_proc
from ppctl.data.tokenizer import Tokenizer, build_tokenizer
from ppctl.run.interrupt import raise_swallowed_interruption

# Below this much input one process tokenises faster than several (measured: see data/README.md).
SMALL_CORPUS_BYTES = 64 << 20
MAX_AUTO_NUM_PROC = 4
EMPTY_PROBE_BYTES = 1 << 16  # a file this small holding only whitespace holds no record
# Megatron-LM's indexed format has no uint32 code: its own preprocessing writes int32 above 65,500 ids, and every id
# of a vocabulary below 2**31 fits.
MEGATRON_DTYPE = {"uint32": "int32"}


def prepare_corpus(spec: CorpusSpec, progress: bool | str | None = False,
                   task: ShardTask | None = None) -> PreparedCorpus | PartialCorpus:
    """Return the prepared tokens of ``spec``, tokenising them into ``spec.cache_dir`` unless cached.

    ``progress``: ``bar`` (or True) shows a progress bar on stderr, ``lines`` one line per shard, False/None
    nothing. ``task`` prepares only that task's shards of a text corpus; the result is then a ``PartialCorpus``
    unless every shard is complete. Raises ``DataError`` (one line) for a source that cannot be prepared.
    """
    if spec.source == "indexed":  # a Megatron-LM indexed dataset is read as it is
        return prepared_indexed(spec)
    corpus = spec.corpus()
    tokenizer = build_tokenizer(spec.tokenizer)
    dtype = token_dtype_for(spec.token_dtype, tokenizer.vocab_size)
    dtype = MEGATRON_DTYPE.get(dtype, dtype)
    cache_dir = Path(spec.cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    if spec.source in INSTRUCTION_SOURCES:
        return _prepare_instructions(spec, corpus, tokenizer, dtype, cache_dir)
    mode = "bar" if progress is True else (progress or None)
    hub_documents = load_hub(corpus, mode == "bar") if corpus.hub_name else None
    if hub_documents is not None:
        source_fingerprint = hub_fingerprint(corpus, hub_documents)
    else:
        source_fingerprint = files_fingerprint(corpus, spec.text_field, cache_dir, spec.fingerprint)
    shard_bytes = max(1, int(spec.shard_mib * MIB))
    source_fingerprint += f"|shard_bytes={shard_bytes}"
    key = cache_key(source_fingerprint, tokenizer, dtype)
    folder = cache_dir / f"{cache_stem(spec, corpus, tokenizer)}-{key[:16]}"
    index = valid_entry(folder, key)
    if index is None:
        header = _entry_header(spec, corpus, tokenizer, dtype, source_fingerprint, key, shard_bytes)
        index = _build_entry(spec, corpus, hub_documents, ShardJob(
            corpus, header["text_field"], tokenizer, dtype, folder, key, hub_documents), header, mode, task)
        if isinstance(index, PartialCorpus):
            return index
    elif index["validation_fraction"] != spec.validation_fraction:
        index.update(split_entries(index["num_tokens"], spec.validation_fraction))
        write_entry_index(folder, index)  # the tokens stay; only the split moves
    prepared = PreparedCorpus(folder, index, corpus.label)
    check_token_ids(prepared, tokenizer)
    return prepared


def _entry_header(spec: CorpusSpec, corpus: Corpus, tokenizer: Tokenizer, dtype: str, source_fingerprint: str,
                  key: str, shard_bytes: int) -> dict:
    """What a text corpus's index says of its source, tokenizer and shards, before any token is read."""
    return {
        "source": spec.source,
        "source_path": spec.path if corpus.hub_name or spec.path is None else str(Path(spec.path).resolve()),
        "file_type": corpus.file_type or "hub",
        "text_field": None if corpus.file_type == "text" else spec.text_field,
        "num_files": len(corpus.files),
        "vocab_size": tokenizer.vocab_size,
        "eod_id": tokenizer.eod_id,
        "tokenizer": tokenizer.identity,
        "dtype": dtype,
        "source_fingerprint": hashlib.sha256(source_fingerprint.encode()).hexdigest(),
        "fingerprint": key,
        "shard_bytes": shard_bytes,
    }


def _build_entry(spec: CorpusSpec, corpus: Corpus, hub_documents, job: ShardJob, header: dict, mode: str | None,
                 task: ShardTask | None) -> dict | PartialCorpus:
    """Tokenise the shards of ``corpus`` not yet complete (``task``'s alone when given) into the entry folder;
    return the entry's index once every shard is complete (written), else what this task did."""
    if corpus.file_type not in (None, "text"):  # a .txt file is one document, even an empty one
        _refuse_without_records(corpus)
    shards = corpus_shards(corpus, hub_documents, header["shard_bytes"])
    job.folder.mkdir(exist_ok=True)
    mine = task.shards(shards) if task is not None else shards
    todo = [shard for shard in mine if read_shard_record(job.folder, shard, job.key) is None]
    progress = ShardProgress(mode, todo, corpus.label, len(shards))
    num_proc = default_num_proc(spec.num_proc, sum(shard.input_bytes for shard in todo), len(todo),
                                SMALL_CORPUS_BYTES, MAX_AUTO_NUM_PROC)
    try:
        ShardRunner(job, progress).run(todo, num_proc)
    finally:
        progress.close()
    records = [read_shard_record(job.folder, shard, job.key) for shard in shards]
    if any(record is None for record in records):
        tokens = sum(record["num_tokens"] for shard, record in zip(shards, records)
                     if record is not None and shard in mine)
        return PartialCorpus(job.folder, task, mine, tokens, sum(record is not None for record in records),
                             len(shards))
    index = entry_index(records, header, spec.validation_fraction, corpus.label)
    raise_swallowed_interruption()  # a signal whose exit Python swallowed meanwhile: the entry stays incomplete
    write_entry_index(job.folder, index)
    return index


def _refuse_without_records(corpus: Corpus) -> None:
    """``DataError`` when no file of the corpus holds anything but whitespace."""
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


def _prepare_instructions(spec: CorpusSpec, corpus: Corpus, tokenizer: Tokenizer, dtype: str,
                          cache_dir: Path) -> PreparedCorpus:
    """``prepare_corpus`` for ``data=chat`` and ``data=prompt_completion``: tokens, weights and document rows."""
    options = InstructionOptions(spec.source, spec.messages_field, spec.prompt_field, spec.completion_field,
                                 spec.chat_template, spec.bad_rows)
    template = chat_template_of(options, tokenizer)
    shape = f"{spec.source}|{options.fields()}|{template_fingerprint(template)}|bad_rows={spec.bad_rows}"
    source_fingerprint = f"{shape}|{files_fingerprint(corpus, '', cache_dir)}"
    key = cache_key(source_fingerprint, tokenizer, dtype)
    token_file = cache_dir / f"{cache_stem(spec, corpus, tokenizer)}-{key[:16]}.bin"
    index = valid_index(token_file, key)
    if index is None:
        keys = {"source_fingerprint": hashlib.sha256(source_fingerprint.encode()).hexdigest(), "fingerprint": key}
        index = _build_instruction_cache(spec, corpus, options, tokenizer, template, dtype, token_file, keys)
    elif index["validation_fraction"] != spec.validation_fraction:
        ends = PreparedCorpus(token_file, index, corpus.label).document_table()[:, 0]
        index.update(split_entries(index["num_tokens"], spec.validation_fraction, ends))
        write_index(token_file, index)
    prepared = PreparedCorpus(token_file, index, corpus.label, spec.too_long)
    check_token_ids(prepared, tokenizer)
    return prepared


def _build_instruction_cache(spec: CorpusSpec, corpus: Corpus, options: InstructionOptions, tokenizer: Tokenizer,
                             template, dtype: str, token_file: Path, keys: dict) -> dict:
    """Tokenise instruction rows into a new entry (tokens, ``.weights``, ``.docs``, index); return the index."""
    import numpy as np

    with contextlib.ExitStack() as stack:
        staged = {suffix: stack.enter_context(staged_token_file(sidecar_path(token_file, suffix)))
                  for suffix in SIDECARS}
        staged[""] = stack.enter_context(staged_token_file(token_file))
        content = tokenise_instructions(corpus, options, tokenizer, template, dtype, staged)
        ends = np.fromfile(staged[".docs"], dtype=np.int64).reshape(-1, 3)[:, 0]
        staged[".idx"] = stack.enter_context(staged_token_file(sidecar_path(token_file, ".idx")))
        write_index_file(staged[".idx"], np.diff(ends, prepend=0), dtype)  # Megatron-LM reads the tokens too
        index = {
            "format_version": CACHE_FORMAT_VERSION, "source": spec.source,
            "source_path": str(Path(spec.path).resolve()), "file_type": corpus.file_type,
            "num_files": len(corpus.files), **content, "vocab_size": tokenizer.vocab_size,
            "eod_id": tokenizer.eod_id, "tokenizer": tokenizer.identity, "dtype": dtype,
            **token_file_record(staged[""], dtype), **keys,
            **split_entries(content["num_tokens"], spec.validation_fraction, ends),
        }
        raise_swallowed_interruption()
        commit_entry(staged.pop(""), token_file, index, staged)
    return index


def indexed_pairs(spec: CorpusSpec) -> list[IndexedCorpus]:
    """The indexed datasets ``data.path`` names for ``data.source=indexed`` (a prefix, a folder of pairs, ppctl's
    cache entry, a glob: ``indexed_prefixes``), each read and checked, in corpus order; ``DataError`` (one line
    naming the file) for a missing, corrupt or truncated pair or one of a float dtype."""
    files = spec.corpus().files  # PREFIX.idx, PREFIX.bin of each pair, in order
    pairs = [read_indexed(idx_file) for idx_file in files[0::2]]
    for corpus in pairs:
        if corpus.dtype.kind not in "iu":
            raise DataError(f"{corpus.idx_file}: dtype {corpus.dtype.name} holds no token ids; ppctl reads integer "
                            f"dtypes ({', '.join(name for name in DTYPE_CODES.values() if 'int' in name)})")
    return pairs


def prepared_indexed(spec: CorpusSpec, pairs: list[IndexedCorpus] | None = None) -> PreparedCorpus:
    """``data.source=indexed``'s corpus (``pairs``, else ``indexed_pairs(spec)``) as prepared tokens: the pairs'
    ``.bin`` files in order are the token stream (every document in order, nothing added), split by
    ``data.validation_fraction`` as a prepared corpus is; the end-of-document id is ``data.tokenizer``'s. An id
    outside its vocabulary is refused naming the file (``check_indexed_token_ids``: read once, then remembered in
    ``data.cache_dir``). One pair is one token file; several are shards (each with its dtype) of their common
    folder. Nothing else is written."""
    pairs = indexed_pairs(spec) if pairs is None else pairs
    tokenizer = build_tokenizer(spec.tokenizer)
    check_indexed_token_ids([pair.bin_file for pair in pairs], [pair.dtype.name for pair in pairs], tokenizer,
                            spec.cache_dir)
    num_tokens = sum(pair.num_tokens for pair in pairs)
    num_documents = sum(pair.num_documents for pair in pairs)
    dtypes = {pair.dtype.name for pair in pairs}
    index = {"source": "indexed", "source_path": str(pairs[0].idx_file.with_suffix("")), "file_type": "indexed",
             "text_field": None, "num_files": 2 * len(pairs), "num_rows": num_documents,
             "num_documents": num_documents, "skipped_rows": {}, "num_tokens": num_tokens,
             "vocab_size": tokenizer.vocab_size, "eod_id": tokenizer.eod_id,
             "dtype": dtypes.pop() if len(dtypes) == 1 else "mixed",  # then each shard names its own
             **split_entries(num_tokens, spec.validation_fraction)}
    if len(pairs) == 1:
        return PreparedCorpus(pairs[0].bin_file, index, spec.label)
    folder = Path(os.path.commonpath([pair.bin_file.parent for pair in pairs]))
    index["source_path"] = str(Path(spec.path).expanduser())
    index["shards"] = [{"name": str(pair.bin_file.relative_to(folder).with_suffix("")), "num_tokens": pair.num_tokens,
                        "num_documents": pair.num_documents, "dtype": pair.dtype.name} for pair in pairs]
    return PreparedCorpus(folder, index, spec.label)
