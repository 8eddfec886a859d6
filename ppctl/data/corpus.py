"""What a data config names: a corpus of local files of one type or a hub dataset, and the spec to prepare it by.

``resolve_corpus`` turns ``data.path`` into a ``Corpus`` with file-system look-ups alone,
so config validation uses it too; nothing is read or imported beyond the standard library.
Every failure of the data room is one ``DataError`` line, defined here at its base.
"""

from __future__ import annotations

import glob
import re
import sysconfig
from dataclasses import dataclass
from pathlib import Path

TOKEN_SOURCES = ("python_stdlib", "text")
DEFAULT_CACHE_DIR = Path("data/cache")  # relative to the repository root, git-ignored
DEFAULT_VALIDATION_FRACTION = 0.05
# File suffix -> the Hugging Face ``datasets`` builder that reads it.
FILE_TYPES = {".txt": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}
KNOWN_SUFFIXES = ".txt, .json, .jsonl, .parquet or .csv"
GLOB_CHARACTERS = ("*", "?", "[")
HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")


class DataError(ValueError):
    """A data source that cannot be prepared; the message is one line naming the setting."""


def one_line(error: BaseException) -> str:
    """The first line of an error, with its cause's first line when it has one."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    text = lines[0] if lines else type(error).__name__
    cause = error.__cause__ or error.__context__
    if cause is not None and str(cause).strip():
        text = f"{text.rstrip('.')}: {str(cause).strip().splitlines()[0]}"
    return text


@dataclass(frozen=True)
class Corpus:
    """Documents to tokenise: ``files`` of one ``file_type`` (a ``FILE_TYPES`` value), or ``hub_name``.

    ``label`` names the source in messages (``data.path=...`` or ``data.source=...``).
    """

    label: str
    file_type: str | None
    files: tuple[Path, ...] = ()
    hub_name: str | None = None


def stdlib_source_files() -> list[Path]:
    """Return the top-level ``*.py`` files of the running Python's stdlib, sorted by name."""
    stdlib_dir = Path(sysconfig.get_paths()["stdlib"])
    return sorted(stdlib_dir.glob("*.py"), key=lambda file: file.name)


def stdlib_corpus() -> Corpus:
    """The embedded default: each stdlib ``*.py`` file is one plain-text document."""
    return Corpus("data.source=python_stdlib", "text", tuple(stdlib_source_files()))


def resolve_corpus(path: str) -> Corpus:
    """Return the corpus ``data.path`` names, or raise ``DataError`` (one line).

    A file is read by its suffix (any other suffix: plain text, one document); a
    folder (searched recursively, hidden entries skipped) or a glob takes its files
    with a known suffix, all of one type (``.json`` and ``.jsonl`` are one type). A
    path that exists nowhere and looks like a hub name (``owner/name`` or ``name``)
    is a hub dataset.
    """
    label = f"data.path={path}"
    target = Path(path).expanduser()
    if any(character in path for character in GLOB_CHARACTERS):
        files = sorted(Path(name) for name in glob.glob(str(target), recursive=True) if Path(name).is_file())
        if not files:
            raise DataError(f"{label}: the glob matches no file")
    elif target.is_dir():
        files = sorted(file for file in target.rglob("*") if file.is_file()
                       and not any(part.startswith(".") for part in file.relative_to(target).parts))
        if not files:
            raise DataError(f"{label}: the folder holds no file")
    elif target.is_file():
        return Corpus(label, FILE_TYPES.get(target.suffix.lower(), "text"), (target,))
    elif looks_like_hub_name(path):
        return Corpus(label, None, hub_name=path)
    else:
        raise DataError(f"{label}: no such file, folder or glob")
    known = tuple(file for file in files if file.suffix.lower() in FILE_TYPES)
    return Corpus(label, _one_file_type(label, files), known)


def looks_like_hub_name(path: str) -> bool:
    """Whether ``path`` reads as a hub dataset name: ``owner/name`` or ``name``, no data-file suffix."""
    return HUB_NAME.fullmatch(path) is not None and Path(path).suffix.lower() not in FILE_TYPES


def _one_file_type(label: str, files: list[Path]) -> str:
    """The one file type among ``files`` (others ignored), or ``DataError`` naming what was found."""
    types = sorted({FILE_TYPES[file.suffix.lower()] for file in files if file.suffix.lower() in FILE_TYPES})
    if not types:
        raise DataError(f"{label}: none of its {len(files)} file(s) ends in {KNOWN_SUFFIXES}")
    if len(types) > 1:
        raise DataError(f"{label}: mixes file types {', '.join(types)}; a corpus takes files of one type "
                        f"(.json and .jsonl count as one): narrow the glob or split the folder")
    return types[0]


@dataclass(frozen=True)
class CorpusSpec:
    """What to prepare: the ``data`` settings that shape a token file, and where to cache it."""

    source: str
    path: str | None = None
    cache_dir: Path = DEFAULT_CACHE_DIR
    tokenizer: str = "byte"
    text_field: str = "text"
    token_dtype: str = "auto"
    validation_fraction: float = DEFAULT_VALIDATION_FRACTION
    num_proc: int | None = None

    @classmethod
    def of(cls, data) -> CorpusSpec:
        """The spec of a ``DataConfig`` (``config.data``)."""
        return cls(data.source, data.path, Path(data.cache_dir), data.tokenizer, data.text_field, data.token_dtype,
                   data.validation_fraction, data.num_proc)

    @property
    def label(self) -> str:
        """How messages name this source: ``data.path=...``, or ``data.source=...`` when it has no path."""
        return f"data.path={self.path}" if self.path else f"data.source={self.source}"

    def corpus(self) -> Corpus:
        """The documents this spec names, or ``DataError`` (one line)."""
        if self.source == "python_stdlib":
            if self.path is not None:
                raise DataError(f"data.source=python_stdlib takes no data.path (got {self.path}); "
                                f"use data=text data.path=...")
            return stdlib_corpus()
        if self.source == "text":
            if not self.path:
                raise DataError("data.source=text needs data.path: a file, folder, glob or hub dataset name")
            return resolve_corpus(self.path)
        raise DataError(f"data.source={self.source!r} has no token file; token-file sources: "
                        f"{', '.join(TOKEN_SOURCES)}")
