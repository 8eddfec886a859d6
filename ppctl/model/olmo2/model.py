"""The OLMo 2 family's stage chunk: Llama's (``LlamaChunk``: embedding, rotary tables, final norm, output layer) of
OLMo 2's layers (``layers.py``), its final norm scaled before the cast back as OLMo 2's norms are."""

from __future__ import annotations

import torch
from torch import nn

from ppctl.model.llama.layers import RMSNorm
from ppctl.model.llama.model import LlamaChunk
from ppctl.model.olmo2.layers import Olmo2Layer
from ppctl.model.olmo2.rules import olmo2_rule


class Olmo2Chunk(LlamaChunk):
    """One pipeline stage chunk of an OLMo 2 model on one TP rank (a ``LlamaChunk`` of ``Olmo2Layer``s)."""

    def make_layer(self, dtype: torch.dtype, recompute_attention_core: bool, mlp: nn.Module | None) -> nn.Module:
        """An OLMo 2 decoder layer (dense: OLMo 2 has no experts)."""
        config = self.config
        return Olmo2Layer(config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim,
                          config.ffn_hidden_size, config.norm_epsilon, self.tp, dtype, self.cp,
                          recompute_attention_core)

    def make_final_norm(self, dtype: torch.dtype) -> nn.Module:
        """RMSNorm, scaled before the cast back (offset 0)."""
        return RMSNorm(self.config.hidden_size, eps=self.config.norm_epsilon, dtype=dtype, offset=0.0)

    def parameter_rule(self, name: str):
        """The OLMo 2 rule of ``name`` (``ppctl.model.olmo2.rules``)."""
        return olmo2_rule(name, self.config.tie_embeddings)
