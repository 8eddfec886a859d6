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

Every failure is one ``DataError`` line.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from ppctl.data.cache import (CACHE_FORMAT_VERSION, PreparedCorpus, cache_key, cache_stem, check_token_ids,
                              commit_entry, files_fingerprint, split_entries, staged_token_file, token_dtype_for,
                              token_file_record, valid_index, write_index)
from ppctl.data.corpus import Corpus, CorpusSpec
from ppctl.data.hub import hub_fingerprint, load_hub
from ppctl.data.tokenise import tokenise_corpus
from ppctl.data.tokenizer import Tokenizer, build_tokenizer
from ppctl.run.interrupt import raise_swallowed_interruption


def prepare_corpus(spec: CorpusSpec, progress: bool = False) -> PreparedCorpus:
    """Return the prepared token file of ``spec``, tokenising it into ``spec.cache_dir`` unless cached.

    ``progress`` shows the progress bars of ``datasets`` (loading, tokenising) on stderr.
    Raises ``DataError`` (one line) for a source that cannot be prepared.
    """
    corpus = spec.corpus()
    tokenizer = build_tokenizer(spec.tokenizer)
    dtype = token_dtype_for(spec.token_dtype, tokenizer.vocab_size)
    cache_dir = Path(spec.cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
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
