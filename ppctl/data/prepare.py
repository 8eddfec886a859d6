"""Turn a text source into a cached flat token file.

A source is loaded as documents through Hugging Face ``datasets``, each document
is tokenised and followed by the end-of-document token, and the whole stream is
written once as ``<name>.bin`` (a flat array of unsigned ints) with a
``<name>.json`` sidecar (source, tokenizer, dtype, token count, fingerprint of the
inputs). Both files are written to a temporary name and renamed, so a reader
never sees a half-written cache; a later call with the same inputs reuses it.

Sources:
  * ``python_stdlib``: the top-level ``*.py`` files of this Python's standard
    library, sorted by name; present on every Python install, no download.
  * ``text_file``: one plain UTF-8 text file given by ``path`` (one document).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sysconfig
import tempfile
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from ppctl.data.tokenizer import Tokenizer, build_tokenizer

TOKEN_FILE_SOURCES = ("python_stdlib", "text_file")
CACHE_FORMAT_VERSION = 1
DEFAULT_CACHE_DIR = Path("data/cache")  # relative to the repository root, git-ignored


def stdlib_source_files() -> list[Path]:
    """Return the top-level ``*.py`` files of the running Python's stdlib, sorted by name."""
    stdlib_dir = Path(sysconfig.get_paths()["stdlib"])
    return sorted(stdlib_dir.glob("*.py"), key=lambda file: file.name)


def token_dtype(vocab_size: int) -> np.dtype:
    """Return the smallest unsigned dtype (uint16 or uint32) that holds ids below ``vocab_size``."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def sidecar_path(token_file: Path) -> Path:
    """Return the JSON sidecar that describes ``token_file``."""
    return Path(token_file).with_suffix(".json")


def read_sidecar(token_file: Path) -> dict:
    """Return the metadata stored next to ``token_file``."""
    return json.loads(sidecar_path(token_file).read_text())


def prepare_tokens(source: str, path: str | None, cache_dir: Path, tokenizer_name: str = "byte") -> Path:
    """Return the token file for ``source``, tokenising it into ``cache_dir`` unless cached.

    ``source`` is ``"python_stdlib"`` (``path`` must be None) or ``"text_file"``
    (``path`` names the file). The cache is keyed by a fingerprint of the input
    bytes and the tokenizer, so edited inputs are re-tokenised.
    """
    input_files = _input_files(source, path)
    tokenizer = build_tokenizer(tokenizer_name)
    fingerprint = _fingerprint(source, input_files, tokenizer)
    cache_dir = Path(cache_dir)
    token_file = cache_dir / f"{_cache_stem(source, input_files, tokenizer)}-{fingerprint[:16]}.bin"
    if _cache_is_valid(token_file, fingerprint):
        return token_file
    cache_dir.mkdir(parents=True, exist_ok=True)
    documents = _load_documents(input_files, cache_dir)
    tokens = _tokenize_documents(documents, tokenizer)
    metadata = {
        "format_version": CACHE_FORMAT_VERSION,
        "source": source,
        "source_path": None if path is None else str(Path(path).resolve()),
        "num_files": len(input_files),
        "num_documents": len(documents),
        "tokenizer": tokenizer.name,
        "vocab_size": tokenizer.vocab_size,
        "eod_id": tokenizer.eod_id,
        "dtype": tokens.dtype.name,
        "num_tokens": int(tokens.size),
        "fingerprint": fingerprint,
    }
    _write_atomically(token_file, tokens.tofile)
    _write_atomically(sidecar_path(token_file), lambda file: file.write(json.dumps(metadata, indent=2).encode()))
    return token_file


def _input_files(source: str, path: str | None) -> list[Path]:
    """Return the files a source reads, checking that the source and path fit together."""
    if source == "python_stdlib":
        if path is not None:
            raise ValueError(f"data source 'python_stdlib' takes no path, got path={path!r}")
        return stdlib_source_files()
    if source == "text_file":
        if path is None:
            raise ValueError("data source 'text_file' needs a path to a text file, got path=None")
        if not Path(path).is_file():
            raise FileNotFoundError(f"text file for data source 'text_file' not found: {path}")
        return [Path(path)]
    raise ValueError(f"unknown token-file source {source!r}; known sources: {', '.join(TOKEN_FILE_SOURCES)}")


def _cache_stem(source: str, input_files: list[Path], tokenizer: Tokenizer) -> str:
    """Return a readable file-name stem for the cache of this source."""
    if source == "text_file":
        return f"text_file-{input_files[0].stem}-{tokenizer.name}"
    return f"{source}-{tokenizer.name}"


def _fingerprint(source: str, input_files: list[Path], tokenizer: Tokenizer) -> str:
    """Return a SHA-256 over the cache format, source, tokenizer and every input's name and bytes."""
    digest = hashlib.sha256()
    header = f"v{CACHE_FORMAT_VERSION}|{source}|{tokenizer.name}|{tokenizer.vocab_size}|{tokenizer.eod_id}"
    digest.update(header.encode())
    for input_file in input_files:
        content = input_file.read_bytes()
        digest.update(f"|{input_file.name}|{len(content)}|".encode())
        digest.update(content)
    return digest.hexdigest()


def _cache_is_valid(token_file: Path, fingerprint: str) -> bool:
    """Return whether ``token_file`` and its sidecar exist, match ``fingerprint`` and are complete."""
    if not token_file.is_file() or not sidecar_path(token_file).is_file():
        return False
    try:
        metadata = read_sidecar(token_file)
    except (OSError, json.JSONDecodeError):
        return False
    expected_bytes = metadata.get("num_tokens", -1) * np.dtype(metadata.get("dtype", "uint16")).itemsize
    return metadata.get("fingerprint") == fingerprint and token_file.stat().st_size == expected_bytes


def _load_documents(input_files: list[Path], cache_dir: Path):
    """Load each input file as one document (a row with a ``text`` column) through ``datasets``.

    The Arrow files that ``datasets`` builds go to a scratch folder under
    ``cache_dir`` that is removed afterwards; rows stay in memory.
    """
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # everything is local; never reach a hub
    import datasets

    scratch = tempfile.TemporaryDirectory(dir=cache_dir, prefix=".hf-scratch-")
    with scratch as scratch_dir, _quiet_datasets(datasets):
        return datasets.load_dataset(
            "text", data_files=[str(file) for file in input_files], sample_by="document",
            encoding_errors="replace", split="train", cache_dir=scratch_dir, keep_in_memory=True,
        )


@contextlib.contextmanager
def _quiet_datasets(datasets_module) -> Iterator[None]:
    """Silence the progress bars of ``datasets`` for the block, then restore their state."""
    were_disabled = datasets_module.are_progress_bars_disabled()
    datasets_module.disable_progress_bars()
    try:
        yield
    finally:
        if not were_disabled:
            datasets_module.enable_progress_bars()


def _tokenize_documents(documents, tokenizer: Tokenizer) -> np.ndarray:
    """Return every document's tokens followed by the EOD token, as one flat array."""
    dtype = token_dtype(tokenizer.vocab_size)
    eod = np.array([tokenizer.eod_id], dtype=dtype)
    pieces: list[np.ndarray] = []
    for text in documents["text"]:
        pieces.append(tokenizer.encode_array(text).astype(dtype))
        pieces.append(eod)
    return np.concatenate(pieces) if pieces else np.empty(0, dtype=dtype)


def _write_atomically(final_path: Path, write: Callable) -> None:
    """Call ``write(file)`` on a temporary file next to ``final_path``, then rename it into place."""
    descriptor, temp_name = tempfile.mkstemp(dir=final_path.parent, prefix=f".{final_path.name}.", suffix=".tmp")
    try:
        with os.fdopen(descriptor, "wb") as temp_file:
            write(temp_file)
            temp_file.flush()
            os.fsync(temp_file.fileno())
        os.chmod(temp_name, 0o644)  # mkstemp creates 0600; the cache is meant to be shared
        os.replace(temp_name, final_path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp_name)
        raise
