"""The next token from the last position's logits: greedy (``temperature=0``) or sampled.

Sampling divides the logits (less their largest, which leaves the probabilities as they are and keeps a tiny
temperature from overflowing) by the temperature, keeps the ``top_k`` most likely tokens (0: all), then the
smallest set of the most likely whose probabilities reach ``top_p`` (1: all; the most likely token always
stays), and draws from what is left, renormalised, with a ``torch.Generator``: the same seed gives the same
tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen: ``temperature`` (0: greedy), ``top_k`` (0: no cut), ``top_p`` in (0, 1]."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def problem(self) -> str | None:
        """Why these settings cannot sample (one line, naming the option), or None."""
        if not math.isfinite(self.temperature) or self.temperature < 0:
            return f"--temperature={self.temperature} must be a finite number >= 0 (0: greedy)"
        if self.top_k < 0:
            return f"--top-k={self.top_k} must be >= 0 (0: no top-k cut)"
        if not 0 < self.top_p <= 1:
            return f"--top-p={self.top_p} must be in (0, 1] (1: no nucleus cut)"
        return None

    @property
    def greedy(self) -> bool:
        """Whether the most likely token is taken (no randomness)."""
        return self.temperature == 0


def next_token(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> torch.Tensor:
    """The next token id of each row of ``logits [batch, vocab]``, as ``[batch, 1]`` int64."""
    if sampling.greedy:
        return logits.argmax(dim=-1, keepdim=True)
    scores = logits.float()
    # Less the largest before the division: a tiny temperature then sends the others to -inf (greedy's limit, ties
    # drawn among) where the logits alone would overflow to inf, and inf - inf in the softmax is nan.
    scores = (scores - scores.max(dim=-1, keepdim=True).values) / sampling.temperature
    if 0 < sampling.top_k < scores.shape[-1]:
        kth = scores.topk(sampling.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, -math.inf)
    if sampling.top_p < 1:
        scores = _nucleus(scores, sampling.top_p)
    import torch  # here: the command line checks a Sampling before it imports torch (a refusal in a second)

    return torch.multinomial(scores.softmax(dim=-1), 1, generator=generator)


def _nucleus(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    """``scores`` with every token outside the smallest most-likely set of probability >= ``top_p`` at -inf."""
    sorted_scores, order = scores.sort(dim=-1, descending=True)
    probabilities = sorted_scores.softmax(dim=-1)
    before = probabilities.cumsum(dim=-1) - probabilities  # the mass of the more likely tokens
    drop = before >= top_p  # the first token has nothing before it: it always stays
    return scores.scatter(-1, order, sorted_scores.masked_fill(drop, -math.inf))
