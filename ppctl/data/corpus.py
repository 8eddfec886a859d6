"""What a data config names: a corpus of local files of one type or a hub dataset, and the spec to prepare it by.

``resolve_corpus`` turns ``data.path`` into a ``Corpus`` with file-system look-ups alone,
so config validation uses it too; nothing is read or imported beyond the standard library.
Every failure of the data room is one ``DataError`` line, defined here at its base.
"""

from __future__ import annotations

import glob
import json
import math
import re
import sysconfig
from dataclasses import dataclass, replace
from pathlib import Path

TOKEN_SOURCES = ("python_stdlib", "text", "chat", "prompt_completion")
INSTRUCTION_SOURCES = ("chat", "prompt_completion")  # jsonl rows with a loss weight per token
BLEND_SOURCES = ("python_stdlib", "text", "chat", "prompt_completion", "indexed")  # what a blend's entries read
MIN_BLEND_SOURCES = 2
DEFAULT_CACHE_DIR = Path("data/cache")  # relative to the repository root, git-ignored
DEFAULT_VALIDATION_FRACTION = 0.05
# File suffix -> the Hugging Face ``datasets`` builder that reads it.
FILE_TYPES = {".txt": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}
KNOWN_SUFFIXES = ".txt, .json, .jsonl, .parquet or .csv"
GLOB_CHARACTERS = ("*", "?", "[")
INDEXED_SUFFIXES = (".idx", ".bin")  # an indexed dataset's pair: PREFIX.idx, PREFIX.bin
ENTRY_SHARD_RECORD = re.compile(r"shard-\d+\.json")  # ppctl's record of a complete shard of an entry
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


def indexed_prefixes(path: str) -> list[Path]:
    """The prefixes of the indexed datasets ``data.path`` names, in the order they are read as one corpus.

    A glob: every pair one of its matches belongs to (``corpus/part-*``, ``corpus/*.idx``; ``**`` descends), sorted
    by path. A folder: ppctl's cache entry (``index.json``) in its shards' order; any other folder, the pairs in it
    (not in its subfolders: a glob with ``**`` reaches those), sorted by name. Anything else: one pair, by its prefix
    or either file's path. A ``.bin`` or ``.idx`` found without its other half is named when it is read. ``DataError``
    (one line) when a glob or a folder holds no pair.
    """
    label = f"data.path={path}"
    target = Path(path).expanduser()
    if any(character in path for character in GLOB_CHARACTERS):
        prefixes = _pair_prefixes(Path(name) for name in glob.glob(str(target), recursive=True))
        if not prefixes:
            raise DataError(f"{label}: the glob matches no .idx or .bin file of an indexed dataset")
        return prefixes
    if not target.is_dir():
        return [target.with_suffix("") if target.suffix in INDEXED_SUFFIXES else target]
    entry_index = target / "index.json"
    if entry_index.is_file():  # ppctl's own entry: its shards, in the order its index lists them
        try:
            return [target / shard["name"] for shard in json.loads(entry_index.read_text())["shards"]]
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise DataError(f"{entry_index}: not the index of a ppctl cache entry (no shard list: {error})") from None
    names = list(target.iterdir())
    if any(ENTRY_SHARD_RECORD.fullmatch(name.name) for name in names):
        raise DataError(f"{label}: a ppctl cache entry without its index.json: its preparation has not finished "
                        f"(run ppctl prepare-data, or every task of its array, to complete it)")
    prefixes = _pair_prefixes(names)
    if not prefixes:
        raise DataError(f"{label}: the folder holds no .idx or .bin file of an indexed dataset (its subfolders are "
                        f"not searched: name them with a glob such as {Path(path) / '**' / '*.idx'})")
    return prefixes


def _pair_prefixes(names) -> list[Path]:
    """The sorted prefixes of the visible ``.idx`` and ``.bin`` files among ``names`` (each once)."""
    return sorted({name.with_suffix("") for name in names if name.suffix in INDEXED_SUFFIXES
                   and not name.name.startswith(".") and name.is_file()})


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
    messages_field: str = "messages"
    prompt_field: str = "prompt"
    completion_field: str = "completion"
    chat_template: str | None = None
    bad_rows: str = "refuse"
    too_long: str = "truncate"
    packing: str = "packed"
    shard_mib: float = 64.0
    fingerprint: str = "content"

    @classmethod
    def of(cls, data) -> CorpusSpec:
        """The spec of a ``DataConfig`` (``config.data``)."""
        return cls(data.source, data.path, Path(data.cache_dir), data.tokenizer, data.text_field, data.token_dtype,
                   data.validation_fraction, data.num_proc, data.messages_field, data.prompt_field,
                   data.completion_field, data.chat_template, data.bad_rows, data.too_long, data.packing,
                   data.shard_mib, data.fingerprint)

    @property
    def label(self) -> str:
        """How messages name this source: ``data.path=...``, or ``data.source=...`` when it has no path."""
        return f"data.path={self.path}" if self.path else f"data.source={self.source}"

    def _instruction_corpus(self) -> Corpus:
        """The local ``.jsonl``/``.json`` files of ``data=chat`` or ``data=prompt_completion``."""
        if not self.path:
            raise DataError(f"data.source={self.source} needs data.path: a .jsonl (or .json) file, folder or glob")
        corpus = resolve_corpus(self.path)
        if corpus.file_type != "json":
            what = "a hub dataset name" if corpus.hub_name else f"{corpus.file_type} file(s)"
            raise DataError(f"{corpus.label}: data.source={self.source} reads local .jsonl or .json files, not "
                            f"{what}")
        return corpus

    def _indexed_corpus(self) -> Corpus:
        """``data=indexed``'s ``.idx`` and ``.bin`` files, each pair in corpus order (``indexed_prefixes``), found by
        name alone (read: ``indexed.py``)."""
        if not self.path:
            raise DataError("data.source=indexed needs data.path: the prefix of a Megatron-LM indexed dataset "
                            "(PREFIX for PREFIX.idx and PREFIX.bin), a folder of them or a glob")
        files = []
        for prefix in indexed_prefixes(self.path):
            for file in (prefix.with_name(prefix.name + suffix) for suffix in INDEXED_SUFFIXES):
                if not file.is_file():
                    raise DataError(f"{file}: no such file; data.source=indexed reads PREFIX.idx and PREFIX.bin "
                                    f"(data.path=PREFIX, either file, a folder of pairs or a glob)")
                files.append(file)
        return Corpus(self.label, "indexed", tuple(files))

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
        if self.source in INSTRUCTION_SOURCES:
            return self._instruction_corpus()
        if self.source == "indexed":
            return self._indexed_corpus()
        raise DataError(f"data.source={self.source!r} has no token file; token-file sources: "
                        f"{', '.join(TOKEN_SOURCES)}")


@dataclass(frozen=True)
class BlendSpec:
    """A blend (``data.blend``): the spec of each source, in the order given, and its weight.

    Each source shares the ``data`` settings that shape a token file (tokenizer, dtype, cache,
    text field, validation fraction) and takes its own ``source`` and ``path``.
    """

    specs: tuple[CorpusSpec, ...]
    weights: tuple[float, ...]

    @classmethod
    def of(cls, data) -> BlendSpec | None:
        """The blend of a ``DataConfig``, or None when ``data.blend`` is empty (one source)."""
        if not data.blend:
            return None
        shared = CorpusSpec.of(data)
        return cls(tuple(replace(shared, source=entry.source, path=entry.path) for entry in data.blend),
                   tuple(float(entry.weight) for entry in data.blend))

    def label(self, index: int) -> str:
        """How messages name source ``index``: ``data.blend[1] (data.path=...)``."""
        return f"data.blend[{index}] ({self.specs[index].label})"

    def check(self) -> None:
        """Raise ``DataError`` (one line) unless the blend can be drawn from: at least two sources, each
        weight finite and > 0, each source a token-file source whose documents can be found."""
        if len(self.specs) < MIN_BLEND_SOURCES:
            raise DataError(f"data.blend holds {len(self.specs)} source(s); a blend takes at least "
                            f"{MIN_BLEND_SOURCES} (for one, set data.source and data.path instead)")
        for index, (spec, weight) in enumerate(zip(self.specs, self.weights)):
            if not (math.isfinite(weight) and weight > 0):
                raise DataError(f"data.blend[{index}].weight={weight} must be a finite number > 0")
            if spec.source not in BLEND_SOURCES:
                raise DataError(f"data.blend[{index}].source={spec.source!r}: a blend draws from token files; "
                                f"sources: {', '.join(BLEND_SOURCES)}")
            try:
                spec.corpus()
            except DataError as error:
                raise DataError(f"data.blend[{index}]: {error}") from None


def data_spec_of(data) -> CorpusSpec | BlendSpec:
    """What a ``DataConfig`` reads: its blend when ``data.blend`` is set, else its one source."""
    return BlendSpec.of(data) or CorpusSpec.of(data)
