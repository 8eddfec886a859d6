"""Tokenizers: text to token ids and back.

Two kinds: ``byte`` (UTF-8 bytes, ids 0..255, and 256 for the end of a document)
and a Hugging Face ``tokenizers`` JSON file given by its path. ``build_tokenizer`` is
the one place that maps ``data.tokenizer`` to an implementation.
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np  # imported where ids are made, so config validation stays quick

# The tokenizer file of a Hugging Face model folder (``model.init_from``, ``ppctl generate``).
FOLDER_TOKENIZER = "tokenizer.json"
# End-of-text tokens of common tokenizer files, in the order they are looked for.
END_OF_TEXT_TOKENS = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[EOS]")


class Tokenizer:
    """Interface every tokenizer implements.

    ``vocab_size`` counts every id the tokenizer can emit, the end-of-document id
    included (the model's vocabulary must be at least this large); ``eod_id`` ends
    each document in token files. ``identity`` describes the tokenizer in a cache
    index (for a file: its path and content hash).
    """

    name: str
    vocab_size: int
    eod_id: int

    @property
    def identity(self) -> dict:
        """What the cache key and index record of this tokenizer."""
        return {"name": self.name}

    @functools.cached_property
    def vocabulary_sha256(self) -> str:
        """SHA-256 of what each id stands for, the end of a document included: tokenizers with the same digest
        give each embedding row the same meaning."""
        return _sha256_of({"tokens": self.vocabulary_tokens(), "eod_id": self.eod_id})

    def vocabulary_tokens(self) -> list:
        """Every (token, id) of the vocabulary, in a fixed order."""
        raise NotImplementedError

    def encode(self, text: str) -> list[int]:
        """Return the token ids of ``text`` (no end-of-document token added)."""
        return self.encode_array(text).tolist()

    def decode(self, token_ids: list[int]) -> str:
        """Return the text of ``token_ids``; end-of-document tokens are dropped."""
        raise NotImplementedError

    def encode_array(self, text: str) -> np.ndarray:
        """Return the token ids of ``text`` as an int64 array."""
        return self.encode_batch([text])[0]

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """Return the token ids of each text (no end-of-document token added)."""
        raise NotImplementedError

    def encode_documents(self, texts: list[str]) -> list[np.ndarray]:
        """Each document's ids with the beginning- and end-of-text tokens the tokenizer itself puts around a text
        (a ``tokenizers`` file's post-processor: Llama 3's ``<|begin_of_text|>``); none for bytes."""
        return self.encode_batch(texts)


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as ids 0..255, plus id 256 as the end-of-document token."""

    name = "byte"
    vocab_size = 257
    eod_id = 256

    def vocabulary_tokens(self) -> list:
        """The 256 byte values, then the end of a document."""
        return [[f"byte {value}", value] for value in range(256)] + [["end of document", self.eod_id]]

    def decode(self, token_ids: list[int]) -> str:
        """Return the text of the byte ids; EOD is dropped, invalid UTF-8 becomes U+FFFD."""
        byte_values = bytes(int(token) for token in token_ids if int(token) != self.eod_id)
        return byte_values.decode("utf-8", errors="replace")

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """Return the UTF-8 bytes of each text as an int64 array, without Python lists."""
        import numpy as np

        return [np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64) for text in texts]


class TokenizerFile(Tokenizer):
    """A Hugging Face ``tokenizers`` JSON file (``tokenizer.json``).

    The end of a document is the file's own end-of-text token when it has one (see
    ``END_OF_TEXT_TOKENS``), else a new id equal to its vocabulary size, which then
    grows by one. ``encode`` adds no special tokens of the file's post-processor; ``encode_with_special_tokens``
    adds them, as transformers does to a prompt, and so does ``encode_documents``, which a corpus is tokenised by.
    """

    def __init__(self, path: str | Path):
        from tokenizers import Tokenizer as HFTokenizer

        self.path = Path(path).resolve()
        content = self.path.read_bytes()
        self.sha256 = hashlib.sha256(content).hexdigest()
        try:
            self._tokenizer = HFTokenizer.from_str(content.decode("utf-8"))
        except Exception as error:  # tokenizers raises plain Exceptions with long messages
            message = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise ValueError(f"data.tokenizer={path}: not a Hugging Face tokenizers file ({message})") from None
        vocab = self._tokenizer.get_vocab(with_added_tokens=True)
        file_vocab_size = max(len(vocab), max(vocab.values(), default=-1) + 1)
        own_eod = next((vocab[token] for token in END_OF_TEXT_TOKENS if token in vocab), None)
        self.name = self.path.name
        self.file_vocab_size = file_vocab_size  # the file's own ids, without an end-of-document id ppctl adds
        self.eod_id = file_vocab_size if own_eod is None else own_eod
        self.vocab_size = file_vocab_size + (own_eod is None)

    @property
    def identity(self) -> dict:
        """The file's name, absolute path and SHA-256 of its content."""
        return {"name": self.name, "path": str(self.path), "sha256": self.sha256}

    def vocabulary_tokens(self) -> list:
        """The file's vocabulary, added tokens included, in token order."""
        vocab = self._tokenizer.get_vocab(with_added_tokens=True)
        return sorted([token, token_id] for token, token_id in vocab.items())

    def decode(self, token_ids: list[int]) -> str:
        """Return the text of ``token_ids`` with the end-of-document tokens dropped."""
        return self._tokenizer.decode([int(token) for token in token_ids if int(token) != self.eod_id],
                                      skip_special_tokens=False)

    def encode_with_special_tokens(self, text: str) -> list[int]:
        """The ids of ``text`` with the special tokens the file's post-processor adds (Llama 3's
        ``<|begin_of_text|>``), as transformers' ``tokenizer(text)`` gives them."""
        return self._tokenizer.encode(text, add_special_tokens=True).ids

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """Return each text's ids (the file's pre- and post-processing, without its special tokens)."""
        import numpy as np

        encodings = self._tokenizer.encode_batch(texts, add_special_tokens=False)
        return [np.asarray(encoding.ids, dtype=np.int64) for encoding in encodings]

    def encode_documents(self, texts: list[str]) -> list[np.ndarray]:
        """Each text's ids with the special tokens of the file's post-processor, as ``tokenizer(text)`` gives them."""
        import numpy as np

        encodings = self._tokenizer.encode_batch(texts, add_special_tokens=True)
        return [np.asarray(encoding.ids, dtype=np.int64) for encoding in encodings]

    def encode_with_offsets(self, text: str, add_special_tokens: bool) -> tuple[list[int], list[tuple[int, int]],
                                                                                   list[int]]:
        """``text``'s ids, each token's character span in ``text``, and 1 for each special token the
        post-processor added (``add_special_tokens``) else 0."""
        encoding = self._tokenizer.encode(text, add_special_tokens=add_special_tokens)
        return encoding.ids, [tuple(offset) for offset in encoding.offsets], encoding.special_tokens_mask


def build_tokenizer(name: str) -> Tokenizer:
    """Return the tokenizer ``data.tokenizer`` names: ``byte`` or the path of a tokenizers JSON file."""
    if name == "byte":
        return ByteTokenizer()
    path = Path(name).expanduser()
    if not path.is_file():
        raise ValueError(f"data.tokenizer={name}: unknown tokenizer; use `byte` or the path of a Hugging Face "
                         f"tokenizers JSON file (no such file)")
    stat = path.stat()
    return _tokenizer_file(str(path.resolve()), stat.st_size, stat.st_mtime_ns)


def tokenizer_record(data) -> dict | None:
    """What a checkpoint records of the tokenizer that ``data`` (a ``DataConfig``) trains with: its identity, its
    number of ids and its ``vocabulary_sha256``; None for synthetic data, whose ids stand for no token."""
    if data.source == "synthetic":
        return None
    tokenizer = build_tokenizer(data.tokenizer)
    return {**tokenizer.identity, "vocab_size": tokenizer.vocab_size, "vocab_sha256": tokenizer.vocabulary_sha256}


def folder_tokenizer(folder: str | Path) -> TokenizerFile | None:
    """The ``tokenizer.json`` of a Hugging Face model folder, None when it has none; ``ValueError`` (one line, for
    the caller to prefix with the folder) when it is not a regular file or not a ``tokenizers`` file."""
    path = Path(folder) / FOLDER_TOKENIZER
    if not path.exists() and not path.is_symlink():
        return None
    if not path.is_file():  # a FIFO would block the read for ever
        raise ValueError(f"its {FOLDER_TOKENIZER} is not a regular file")
    resolved = str(path.resolve())
    try:
        stat = path.stat()
        return _tokenizer_file(resolved, stat.st_size, stat.st_mtime_ns)
    except OSError as error:
        raise ValueError(f"its {FOLDER_TOKENIZER} is unreadable ({type(error).__name__}: {error.strerror})") from None
    except ValueError as error:  # TokenizerFile's message names data.tokenizer: here the file is the folder's
        raise ValueError(f"its {FOLDER_TOKENIZER} is {str(error).removeprefix(f'data.tokenizer={resolved}: ')}") \
            from None


def init_from_tokenizer_problem(folder: str | Path, data) -> str | None:
    """Why a run on ``data`` (a ``DataConfig``) cannot start from the HF folder ``folder`` (None when it can): the
    folder's embedding rows stand for the tokens of its ``tokenizer.json``, and the run's ``data.tokenizer`` has
    another vocabulary (compared as ``trainer.resume_from`` compares a checkpoint's: ``vocabulary_sha256``). A folder
    without ``tokenizer.json`` gives nothing to compare and is taken as it is; synthetic data has no tokens."""
    if data.source == "synthetic":
        return None
    try:
        theirs = folder_tokenizer(folder)
    except ValueError as error:
        return f"model.init_from={folder}: {error}"
    ours = build_tokenizer(data.tokenizer)
    if theirs is None or theirs.vocabulary_sha256 == ours.vocabulary_sha256:
        return None
    sizes = (f"as many ids, {ours.vocab_size}, other tokens" if theirs.vocab_size == ours.vocab_size
             else f"{theirs.vocab_size} ids in the folder's, {ours.vocab_size} in the run's")
    return (f"model.init_from={folder}: its {FOLDER_TOKENIZER} is not this run's data.tokenizer={data.tokenizer} "
            f"({sizes}): each embedding row would be read as another token; set data.tokenizer="
            f"{Path(folder) / FOLDER_TOKENIZER} (or start from a folder of this tokenizer)")


def _sha256_of(content) -> str:
    """SHA-256 of ``content`` as canonical JSON."""
    return hashlib.sha256(json.dumps(content, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


@functools.lru_cache(maxsize=4)
def _tokenizer_file(path: str, size: int, mtime_ns: int) -> TokenizerFile:
    """Load a tokenizer file once per (path, size, mtime): config resolution, validation and preparation share it."""
    return TokenizerFile(path)
