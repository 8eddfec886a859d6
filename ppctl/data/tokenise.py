"""Documents in, tokens out: a corpus's files loaded, tokenised with ``Dataset.map``, written as one flat file.

Files are read with the ``datasets`` builder of their type (``.txt``: one document per
file), their Arrow scratch files in a folder next to the cache, removed afterwards (also when a
signal comes during the removal). Each
document's tokens are followed by the end-of-document id; rows without text (no value in
the text field, or an empty one) are no document, and are counted. ``tokenizer.py`` says
what a token is; this module runs a tokenizer over a corpus, in ``data.num_proc`` processes.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

from ppctl.data.corpus import Corpus, DataError, one_line
from ppctl.data.hub import datasets_progress, quiet_library_logs
from ppctl.data.tokenizer import Tokenizer
from ppctl.data.utf8 import decode_error, is_encoding_error, not_utf8_error
from ppctl.fileio import exception_in_chain

# Below this much text one process tokenises faster than several (measured: see data/README.md).
SMALL_CORPUS_BYTES = 64 << 20
MAX_AUTO_NUM_PROC = 4
EMPTY_PROBE_BYTES = 1 << 16  # a file this small holding only whitespace holds no record
INTERRUPTIONS = (KeyboardInterrupt, SystemExit)  # what a signal's handler raises to end the process


def tokenise_corpus(corpus: Corpus, hub_documents, text_field: str, tokenizer: Tokenizer, dtype: str,
                    num_proc: int | None, token_file: Path, progress: bool) -> dict:
    """Tokenise ``corpus`` (its files, or the loaded ``hub_documents``) into ``token_file``; return what the index
    says of the content: the text field, the rows read, documents, rows skipped, tokens.

    The Arrow files that ``datasets`` builds go to a scratch folder next to ``token_file``,
    removed afterwards, also when an error or a signal ends the step.
    """
    with _scratch_folder(token_file.parent) as scratch, datasets_progress(progress) as datasets:
        documents = hub_documents if hub_documents is not None else _load_files(corpus, scratch)
        column = _text_column(documents, corpus, text_field)
        tokenized = _tokenize(datasets, documents, corpus, column, tokenizer, dtype, num_proc, scratch)
        num_tokens, num_documents = _write_tokens(tokenized.data.column("ids"), token_file, corpus.label)
        num_rows, missing = documents.num_rows, documents.data.column(column).null_count
        del tokenized, documents  # release the memory-mapped scratch files before the folder goes
    return {
        "text_field": None if corpus.file_type == "text" else column,
        "num_rows": num_rows,
        "num_documents": num_documents,
        "skipped_rows": {"missing": missing, "empty": num_rows - num_documents - missing},
        "num_tokens": num_tokens,
    }


@contextlib.contextmanager
def _scratch_folder(parent: Path) -> Iterator[str]:
    """A hidden scratch folder in ``parent``, removed on the way out, whatever ends the block."""
    scratch = tempfile.mkdtemp(dir=parent, prefix=".hf-scratch-")
    try:
        yield scratch
    finally:
        _remove_whatever_interrupts(scratch)


def _remove_whatever_interrupts(folder: str) -> None:
    """Remove ``folder``; a signal's exit that comes meanwhile is raised once it is gone.

    A signal comes where it will: a second Ctrl-C, or the first one raised again after Python swallowed it in
    a finalizer (``ppctl.run.interrupt.RaiseSwallowedAgain``), can land in the removal, which would stop
    half-way and leave the folder in the cache.
    """
    interruption = None
    while True:
        try:
            shutil.rmtree(folder, ignore_errors=True)
            break
        except INTERRUPTIONS as error:
            interruption = error
    if interruption is not None:
        raise interruption


def _tokenize(datasets, documents, corpus: Corpus, column: str, tokenizer: Tokenizer, dtype: str,
              num_proc: int | None, scratch: str):
    """``documents.map`` of ``TokenizeBatch`` into the scratch folder; text that is not UTF-8 is one ``DataError``.

    json and parquet rows reach this step undecoded (Arrow does not check their UTF-8), so a bad
    byte fails here, in whichever process tokenises its row.
    """
    try:
        return documents.map(
            TokenizeBatch(tokenizer, dtype, column), batched=True, remove_columns=documents.column_names,
            num_proc=_num_proc(num_proc, documents), desc=f"tokenising ({tokenizer.name})",
            features=datasets.Features({"ids": datasets.Sequence(datasets.Value(dtype))}),
            cache_file_name=str(Path(scratch) / "tokens.arrow"),
        )
    except BaseException as error:
        interruption = exception_in_chain(error, INTERRUPTIONS)
        if interruption is not None and interruption is not error:
            # a signal ended the map while its pool ran, and the pool's clean-up raised an error of its own
            # (multiprocess's TimeoutError) over it: the interruption is what happened
            raise interruption from None
        if not isinstance(error, Exception) or decode_error(error) is None:
            raise
        raise not_utf8_error(corpus, error, documents) from None


class TokenizeBatch:
    """The ``Dataset.map`` function: each text's ids (with the beginning- and end-of-text tokens the tokenizer's
    post-processor puts around it), then the end-of-document id unless the post-processor already ended it with
    that id; an empty text gives none.

    A class rather than a closure so that ``num_proc`` workers receive it pickled.
    """

    def __init__(self, tokenizer: Tokenizer, dtype: str, column: str):
        self.tokenizer, self.dtype, self.column = tokenizer, dtype, column

    def __call__(self, batch: dict) -> dict:
        import numpy as np

        texts = [text or "" for text in batch[self.column]]
        return {"ids": [ended_document(ids, self.tokenizer.eod_id).astype(self.dtype) if text
                        else np.empty(0, dtype=self.dtype)
                        for text, ids in zip(texts, self.tokenizer.encode_documents(texts))]}


def ended_document(ids, eod_id: int):
    """``ids`` followed by ``eod_id``, unless they already end with it (a post-processor's ``$A </s>``)."""
    import numpy as np

    if len(ids) and int(ids[-1]) == eod_id:
        return np.asarray(ids, dtype=np.int64)
    return np.concatenate([np.asarray(ids, dtype=np.int64), np.array([eod_id], dtype=np.int64)])


def _num_proc(requested: int | None, documents) -> int:
    """Tokenising processes: ``data.num_proc``, else 1 for a small corpus and min(4, cores) for a large one."""
    if requested is None:
        small = documents.data.nbytes < SMALL_CORPUS_BYTES
        requested = 1 if small else min(MAX_AUTO_NUM_PROC, os.cpu_count() or 1)
    return max(1, min(requested, documents.num_rows))


def _write_tokens(ids_column, token_file: Path, label: str) -> tuple[int, int]:
    """Write the flat token stream of an Arrow list column to ``token_file``; return (tokens, documents)."""
    import pyarrow.compute as compute

    lengths = compute.list_value_length(ids_column)
    num_tokens = int(compute.sum(lengths).as_py() or 0)
    num_documents = int(compute.sum(compute.greater(lengths, 0)).as_py() or 0)
    if num_tokens == 0:
        raise DataError(f"{label}: the corpus holds no text ({len(ids_column)} empty document(s))")
    with open(token_file, "wb") as handle:
        for chunk in ids_column.chunks:
            chunk.flatten().to_numpy(zero_copy_only=False).tofile(handle)
        handle.flush()
        os.fsync(handle.fileno())
    return num_tokens, num_documents


def _load_files(corpus: Corpus, scratch: str):
    """Load local files with the ``datasets`` builder of their type (``.txt``: one document per file)."""
    import datasets

    if corpus.file_type != "text":  # a .txt file is one document, even an empty one
        _refuse_without_records(corpus)
    # .txt is decoded strictly, as every other type: replacing bad bytes with U+FFFD would train on
    # text the file does not hold, without a word
    options = {"sample_by": "document"} if corpus.file_type == "text" else {}
    try:
        with quiet_library_logs():
            return datasets.load_dataset(corpus.file_type, data_files=[str(file) for file in corpus.files],
                                         split="train", cache_dir=scratch, **options)
    except Exception as error:  # datasets wraps parser errors in several classes; report one line
        if is_encoding_error(error):
            raise not_utf8_error(corpus, error) from None
        if "corresponds to no data" in one_line(error):  # e.g. a csv header alone, a json []
            raise DataError(f"{corpus.label}: its {corpus.file_type} file(s) hold no records") from None
        raise DataError(f"{corpus.label}: cannot read its {corpus.file_type} files: {one_line(error)}") from None


def _refuse_without_records(corpus: Corpus) -> None:
    """``DataError`` when no file of the corpus holds anything but whitespace (``datasets`` has no word for it)."""
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


def _text_column(documents, corpus: Corpus, text_field: str) -> str:
    """The column holding the text: ``text`` for ``.txt`` files, else ``data.text_field`` (checked)."""
    if corpus.file_type == "text":
        return "text"
    if text_field not in documents.column_names:
        raise DataError(f"data.text_field={text_field} is not a field of {corpus.label}; its fields: "
                        f"{', '.join(documents.column_names)}")
    feature = documents.features[text_field]
    if getattr(feature, "dtype", None) not in ("string", "large_string"):
        raise DataError(f"data.text_field={text_field} of {corpus.label} holds {feature}, not text")
    return text_field
