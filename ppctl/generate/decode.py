"""The generation loop: the prompt through the KV cache as one step, then one token a step, as text as it comes.

``generate_ids`` yields each new token id (``DecoderChunk.generate_step``, ``ppctl.model.kv_cache``);
``TextStream`` turns the ids into text piece by piece, holding back an unfinished character (a multi-byte
UTF-8 character split over several tokens); ``generate`` runs both and times them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from ppctl.generate.sampling import Sampling, next_token
from ppctl.model.kv_cache import KVCache

REPLACEMENT_CHARACTER = "\ufffd"  # what a decoder shows for bytes that are not (yet) a whole character


@torch.inference_mode()
def generate_ids(chunk, prompt_ids: list[int], max_new_tokens: int, sampling: Sampling, seed: int = 0,
                 stop_ids: frozenset[int] = frozenset()) -> Iterator[int]:
    """Yield up to ``max_new_tokens`` new token ids after ``prompt_ids``, ending after one of ``stop_ids``.

    ``chunk`` is the whole model as one ``DecoderChunk``; sampling draws from a ``torch.Generator`` seeded
    with ``seed``, so a seed gives the same tokens every time.
    """
    device = next(chunk.parameters()).device
    generator = torch.Generator(device).manual_seed(seed)
    cache = KVCache(len(prompt_ids) + max_new_tokens)
    tokens = torch.tensor([prompt_ids], dtype=torch.int64, device=device)
    for _ in range(max_new_tokens):
        positions = torch.arange(cache.length, cache.length + tokens.shape[1], device=device).unsqueeze(0)
        tokens = next_token(chunk.generate_step(tokens, positions, cache), sampling, generator)
        token = int(tokens)
        yield token
        if token in stop_ids:
            return


@dataclass
class TextStream:
    """The text of the tokens after a prompt, given out as the tokens come.

    Each piece is decoded with the prompt before it (a tokenizer may join a token to what precedes it), and
    text that ends in an unfinished character waits for the next token. ``decode`` maps ids to text;
    ``known_ids``: the ids it can decode (others, beyond the tokenizer's vocabulary, are left out).
    """

    decode: Callable[[list[int]], str]
    prompt_ids: list[int]
    known_ids: int
    ids: list[int] = field(default_factory=list)
    given: int = 0  # characters of the continuation given out so far

    def __post_init__(self):
        self.prompt_text = self.decode(self.prompt_ids)

    def push(self, token_id: int) -> str:
        """Add a token; return the text it completes (maybe empty)."""
        self.ids.append(token_id)
        text = self._continuation()
        if text.endswith(REPLACEMENT_CHARACTER):
            return ""
        return self._give(text)

    def finish(self) -> str:
        """The text still held back (an unfinished character, as the decoder shows it)."""
        return self._give(self._continuation())

    @property
    def text(self) -> str:
        """The whole continuation as text."""
        return self._continuation()

    def _continuation(self) -> str:
        whole = self.decode(self.prompt_ids + [token for token in self.ids if token < self.known_ids])
        if whole.startswith(self.prompt_text):
            return whole[len(self.prompt_text):]
        return self.decode([token for token in self.ids if token < self.known_ids])

    def _give(self, text: str) -> str:
        piece = text[self.given:]
        self.given = max(self.given, len(text))
        return piece


@dataclass
class Generated:
    """What one generation gave: the new ids, their text, the time from the prompt's step to the last token, and
    why it stopped (``end_of_text`` or ``max_new_tokens``)."""

    prompt_ids: list[int]
    ids: list[int]
    text: str
    seconds: float
    stopped: str

    @property
    def tokens_per_second(self) -> float:
        """New tokens per second, the prompt's step included."""
        return len(self.ids) / self.seconds if self.seconds > 0 else float("inf")


def generate(chunk, tokenizer, prompt_ids: list[int], max_new_tokens: int, sampling: Sampling, seed: int,
             stop_ids: frozenset[int], on_text: Callable[[str], None] | None = None) -> Generated:
    """Generate after ``prompt_ids``; ``on_text`` receives each piece of text as it is complete."""
    stream = TextStream(tokenizer.decode, prompt_ids, tokenizer.vocab_size)
    started = time.perf_counter()
    for token in generate_ids(chunk, prompt_ids, max_new_tokens, sampling, seed, stop_ids):
        piece = stream.push(token)
        if piece and on_text is not None:
            on_text(piece)
    seconds = time.perf_counter() - started
    rest = stream.finish()
    if rest and on_text is not None:
        on_text(rest)
    stopped = "end_of_text" if stream.ids and stream.ids[-1] in stop_ids else "max_new_tokens"
    return Generated(prompt_ids, stream.ids, stream.text, seconds, stopped)
