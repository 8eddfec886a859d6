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

Every failure is one ``DataError`` line.
"""

from __future__ import annotations

import contextlib
import hashlib
from pathlib import Path

from ppctl.data.cache import (CACHE_FORMAT_VERSION, SIDECARS, PreparedCorpus, cache_key, cache_stem, check_token_ids,
                              commit_entry, files_fingerprint, sidecar_path, split_entries, staged_token_file,
                              token_dtype_for, token_file_record, valid_index, write_index)
from ppctl.data.corpus import INSTRUCTION_SOURCES, Corpus, CorpusSpec
from ppctl.data.hub import hub_fingerprint, load_hub
from ppctl.data.instruction import InstructionOptions, chat_template_of, template_fingerprint, tokenise_instructions
from ppctl.data.tokenise import tokenise_corpus
from ppctl.data.tokenizer import Tokenizer, build_tokenizer
from ppctl.run.interrupt import raise_swallowed_interruption


def prepare_corpus(spec: CorpusSpec, progress: bool = False) -> PreparedCorpus:
    """Return the prepared token file of ``spec``, tokenising it into ``spec.cache_dir`` unless cached.

    ``progress`` shows the progress bars of ``datasets`` (loading, tokenising) on stderr.
    Raises ``DataError`` (one line) for a source that cannot be prepared.
    """
    if spec.source == "indexed":  # a Megatron-LM indexed dataset is read as it is
        from ppctl.data.indexed import prepared_indexed

        return prepared_indexed(spec)
    corpus = spec.corpus()
    tokenizer = build_tokenizer(spec.tokenizer)
    dtype = token_dtype_for(spec.token_dtype, tokenizer.vocab_size)
    cache_dir = Path(spec.cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    if spec.source in INSTRUCTION_SOURCES:
        return _prepare_instructions(spec, corpus, tokenizer, dtype, cache_dir)
    hub_documents = load_hub(corpus, progress) if corpus.hub_name else None
    if hub_documents is not None:
        source_fingerprint = hub_fingerprint(corpus, hub_documents)
    else:
        source_fingerprint = files_fingerprint(corpus, spec.text_field, cache_dir)
    key = cache_key(source_fingerprint, tokenizer, dtype)
    token_file = cache_dir / f"{cache_stem(spec, corpus, tokenizer)}-{key[:16]}.bin"
    index = valid_index(token_file, key)
    if index is None:
        keys = {"source_fingerprint": hashlib.sha256(source_fingerprint.encode()).hexdigest(), "fingerprint": key}
        index = _build_cache(spec, corpus, hub_documents, tokenizer, dtype, token_file, keys, progress)
    elif index["validation_fraction"] != spec.validation_fraction:
        index.update(split_entries(index["num_tokens"], spec.validation_fraction))
        write_index(token_file, index)  # the tokens stay; only the split moves
    check_token_ids(token_file, index, tokenizer)
    return PreparedCorpus(token_file, index, corpus.label)


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
    check_token_ids(token_file, index, tokenizer)
    return PreparedCorpus(token_file, index, corpus.label, spec.too_long)


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


def _build_cache(spec: CorpusSpec, corpus: Corpus, hub_documents, tokenizer: Tokenizer, dtype: str,
                 token_file: Path, keys: dict, progress: bool) -> dict:
    """Tokenise the corpus into a new cache entry, ``token_file`` and its index (``keys``: its fingerprints);
    return the index.

    Both are written under temporary names and put in place at the end, so that an error or a
    signal on the way leaves the cache as it was.
    """
    with staged_token_file(token_file) as staged:
        content = tokenise_corpus(corpus, hub_documents, spec.text_field, tokenizer, dtype, spec.num_proc, staged,
                                  progress)
        index = {
            "format_version": CACHE_FORMAT_VERSION,
            "source": spec.source,
            "source_path": spec.path if corpus.hub_name or spec.path is None else str(Path(spec.path).resolve()),
            "file_type": corpus.file_type or "hub",
            "num_files": len(corpus.files),
            **content,
            "vocab_size": tokenizer.vocab_size,
            "eod_id": tokenizer.eod_id,
            "tokenizer": tokenizer.identity,
            "dtype": dtype,
            **token_file_record(staged, dtype),
            **keys,
            **split_entries(content["num_tokens"], spec.validation_fraction),
        }
        raise_swallowed_interruption()  # a signal whose exit Python swallowed meanwhile: nothing enters the cache
        commit_entry(staged, token_file, index)
    return index
