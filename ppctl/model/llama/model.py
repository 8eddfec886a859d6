"""The Llama family's shape (``LlamaConfig``) and stage chunk (``LlamaChunk``), with Megatron tensor parallelism.

A ``LlamaChunk`` is a ``ppctl.model.chunk.DecoderChunk`` of Llama layers (``layers.py``): RMSNorm,
SwiGLU, grouped-query attention (optional q/k/v bias, as Qwen2), rotary positions of ``rope_theta``
with Llama 3's frequency scaling when given, no other biases, an untied output layer by default.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ppctl.model.chunk import DecoderChunk
from ppctl.model.llama.layers import (LlamaLayer, RMSNorm, RopeScaling, SwiGLUMLP, check_grouped_heads,
                                      llama_rotary_cos_sin)
from ppctl.model.moe.experts import SwiGLUExperts
from ppctl.model.moe.layer import MoEMLP
from ppctl.model.moe.shape import MoEShape
from ppctl.model.llama.rules import llama_rule
from ppctl.parallel.tensor_parallel import VocabParallelEmbedding


@dataclass(frozen=True)
class LlamaConfig:
    """Shape of a Llama model (the names of ``ppctl.model.gpt.model.GPTConfig`` where they mean the same).

    num_kv_heads: key/value heads (grouped-query attention; ``num_heads`` for multi-head attention).
    head_dim: width of one head (may differ from ``hidden_size / num_heads``).
    rope_theta: base of the rotary frequencies; rope_scaling: its frequency scaling (Llama 3's, linear, YaRN), or None.
    qkv_bias: biases on q, k and v (Qwen2); attention_output_bias: a bias on o_proj too (Llama's attention_bias);
    norm_epsilon: RMSNorm epsilon.
    qk_norm: each query and key head RMS-normalised before the rotation (Qwen3's ``q_norm``, ``k_norm``).
    moe: the mixture of experts some layers' MLP is (``ppctl.model.moe``; Mixtral's SwiGLU experts), or None.
    scale_embeddings: the word embeddings times ``sqrt(hidden_size)`` in the parameters' dtype (Gemma's);
    norm_offset: every RMSNorm's ``offset`` (None, Llama's; Gemma's 1: ``1 + weight``); mlp_activation: the dense
    MLP gate's (``layers.GATE_ACTIVATIONS``: ``silu``, SwiGLU; ``gelu_tanh``, Gemma's GeGLU). Defaults: Llama's.
    """

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    max_seq_length: int
    padded_vocab_size: int
    tie_embeddings: bool = False
    norm_epsilon: float = 1e-5
    init_std: float = 0.02
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    qkv_bias: bool = False
    moe: MoEShape | None = None
    qk_norm: bool = False
    scale_embeddings: bool = False
    norm_offset: float | None = None
    mlp_activation: str = "silu"
    attention_output_bias: bool = False


def check_tp_divides(config: LlamaConfig, tp_size: int) -> None:
    """Raise ValueError (one line) unless heads, KV groups, MLP width and padded vocabulary split over ``tp_size``."""
    check_grouped_heads(config.num_heads, config.num_kv_heads, tp_size)
    for field in ("ffn_hidden_size", "padded_vocab_size"):
        if getattr(config, field) % tp_size != 0:
            raise ValueError(f"model.{field}={getattr(config, field)} must be a multiple of parallel.tp={tp_size}")


class WordEmbedding(nn.Module):
    """The vocab-parallel word embedding alone (positions are rotary, inside the layers); ``scale``: its vectors
    times ``scale`` rounded to their dtype (Gemma's ``sqrt(hidden_size)``, as transformers rounds it), None: not
    scaled."""

    def __init__(self, vocab_size: int, hidden_size: int, tp, dtype: torch.dtype, scale: float | None = None):
        super().__init__()
        self.word = VocabParallelEmbedding(vocab_size, hidden_size, tp, dtype=dtype)
        self.scale = scale

    def forward(self, token_ids: torch.Tensor, _position_ids: torch.Tensor | None) -> torch.Tensor:
        """Map ``token_ids [batch, seq]`` to hidden states (``seq / tp`` of them with SP)."""
        hidden = self.word(token_ids)
        if self.scale is None:
            return hidden
        return hidden * torch.tensor(self.scale, dtype=hidden.dtype, device=hidden.device)


class LlamaChunk(DecoderChunk):
    """One pipeline stage chunk of a Llama model on one TP rank (``DecoderChunk``)."""

    check_tp_divides = staticmethod(check_tp_divides)

    def make_embedding(self, dtype: torch.dtype) -> nn.Module:
        """The word embedding (no position table), scaled by ``sqrt(hidden_size)`` with ``scale_embeddings``."""
        config = self.config
        scale = config.hidden_size ** 0.5 if config.scale_embeddings else None
        return WordEmbedding(config.padded_vocab_size, config.hidden_size, self.tp, dtype, scale)

    def make_layer(self, dtype: torch.dtype, recompute_attention_core: bool, mlp: nn.Module | None) -> nn.Module:
        """A pre-norm Llama decoder layer."""
        config = self.config
        return LlamaLayer(config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim,
                          config.ffn_hidden_size, config.norm_epsilon, self.tp, dtype, self.cp, config.qkv_bias,
                          recompute_attention_core, mlp, qk_norm=config.qk_norm, norm_offset=config.norm_offset,
                          activation=config.mlp_activation, attention_output_bias=config.attention_output_bias)

    def make_moe_mlp(self, dtype: torch.dtype) -> nn.Module:
        """Experts as SwiGLU MLPs (Mixtral's); the shared experts as one dense SwiGLU MLP."""
        config, moe = self.config, self.config.moe
        local_experts = len(self.ep.local_experts(moe.num_experts))  # this EP rank's share
        experts = SwiGLUExperts(local_experts, config.hidden_size, moe.expert_ffn_hidden_size, dtype)
        shared = (SwiGLUMLP(config.hidden_size, moe.shared_ffn_hidden_size, self.tp, dtype)
                  if moe.shared_experts else None)
        return MoEMLP(config.hidden_size, moe, experts, shared, dtype, self.ep, self.groups.token_split)

    def make_final_norm(self, dtype: torch.dtype) -> nn.Module:
        """RMSNorm (of ``norm_offset``)."""
        config = self.config
        return RMSNorm(config.hidden_size, eps=config.norm_epsilon, dtype=dtype, offset=config.norm_offset)

    def parameter_rule(self, name: str):
        """The Llama rule of ``name`` (``ppctl.model.llama.rules``)."""
        return llama_rule(name, self.config.tie_embeddings)

    @property
    def layers_read_positions(self) -> bool:
        """Its layers rotate queries and keys by position."""
        return bool(self.layer_ids)

    def rotary_tables(self, position_ids: torch.Tensor, dtype: torch.dtype):
        """Rotary ``(cos, sin)`` of ``rope_theta``, scaled as Llama 3 when ``rope_scaling`` is set."""
        config = self.config
        return llama_rotary_cos_sin(position_ids, config.head_dim, config.rope_theta, config.rope_scaling, dtype)
