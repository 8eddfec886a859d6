"""The Gemma family's stage chunk: Llama's (``LlamaChunk``, Gemma's hooks on in its ``LlamaConfig``), its norms'
weights starting at 0 (``rules.py``)."""

from __future__ import annotations

from ppctl.model.gemma.rules import gemma_rule
from ppctl.model.llama.model import LlamaChunk


class GemmaChunk(LlamaChunk):
    """One pipeline stage chunk of a Gemma model on one TP rank: a ``LlamaChunk`` of Gemma's rules."""

    def parameter_rule(self, name: str):
        """The Gemma rule of ``name`` (``ppctl.model.gemma.rules``)."""
        return gemma_rule(name, self.config.tie_embeddings)
