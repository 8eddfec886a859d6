"""Tokenizers: text to token ids and back.

Only a byte-level tokenizer exists today; ``build_tokenizer`` is the one place
that maps a configured name to an implementation, so adding another tokenizer
means one new class and one new branch there.
"""

from __future__ import annotations

import numpy as np

KNOWN_TOKENIZERS = ("byte",)


class Tokenizer:
    """Interface every tokenizer implements.

    ``vocab_size`` counts every id the tokenizer can emit (the model's vocabulary
    must be at least this large); ``eod_id`` separates documents in token files.
    """

    name: str
    vocab_size: int
    eod_id: int

    def encode(self, text: str) -> list[int]:
        """Return the token ids of ``text`` (no end-of-document token added)."""
        raise NotImplementedError

    def decode(self, token_ids: list[int]) -> str:
        """Return the text of ``token_ids``; end-of-document tokens are dropped."""
        raise NotImplementedError

    def encode_array(self, text: str) -> np.ndarray:
        """Return the token ids of ``text`` as an int64 array (override when faster)."""
        return np.asarray(self.encode(text), dtype=np.int64)


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as ids 0..255, plus id 256 as the end-of-document token."""

    name = "byte"
    vocab_size = 257
    eod_id = 256

    def encode(self, text: str) -> list[int]:
        """Return the UTF-8 bytes of ``text`` as ids 0..255."""
        return list(text.encode("utf-8"))

    def decode(self, token_ids: list[int]) -> str:
        """Return the text of the byte ids; EOD is dropped, invalid UTF-8 becomes U+FFFD."""
        byte_values = bytes(int(token) for token in token_ids if int(token) != self.eod_id)
        return byte_values.decode("utf-8", errors="replace")

    def encode_array(self, text: str) -> np.ndarray:
        """Return the UTF-8 bytes of ``text`` as an int64 array, without a Python list."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)


def build_tokenizer(name: str) -> Tokenizer:
    """Return the tokenizer called ``name`` (one of ``KNOWN_TOKENIZERS``)."""
    if name == "byte":
        return ByteTokenizer()
    raise ValueError(f"unknown tokenizer {name!r}; known tokenizers: {', '.join(KNOWN_TOKENIZERS)}")
