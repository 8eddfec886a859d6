"""The memory/FLOP shape of a model: what the memory model, the FLOP count and the planner read of it (pure: no torch).

A family's ``ResolvedModel`` (``ppctl.model.family``) holds one ``ModelShape``, built once by
``memory_shape_of`` from the ``model.*`` settings, the padded vocabulary and the family's ``Architecture``;
``ppctl.plan`` (the memory model, the balancer, the search) reads it from there and never from the config.
It lives below the planner so that a family can build it without importing upwards.
"""

from __future__ import annotations

from dataclasses import dataclass

from ppctl.model.moe.shape import MoEShape, moe_shape_of


@dataclass(frozen=True)
class ModelShape:
    """What the memory of a model depends on (``model.*`` with the vocabulary padded for TP, and its family's
    ``Architecture``: norms with a shift, a gated MLP, linear biases, a fused QKV). ``kv_heads`` and ``head_dim``
    default to ``heads`` and ``hidden / heads``; ``vocab`` (the real vocabulary) to ``padded_vocab``; ``moe``: the
    experts of the MoE layers, None for a dense model."""

    hidden: int
    heads: int
    ffn: int
    padded_vocab: int
    max_seq_length: int
    learned_positions: bool = True
    rotary: bool = False
    tie_embeddings: bool = False
    kv_heads: int | None = None
    head_dim: int | None = None
    norm_has_bias: bool = True
    gated_mlp: bool = False
    linear_biases: bool = True
    fused_qkv: bool = True
    qkv_bias: bool = False
    vocab: int | None = None
    moe: MoEShape | None = None

    @property
    def attention_width(self) -> int:
        """The query heads' width: heads x head width (``hidden`` without ``head_dim``)."""
        return self.heads * (self.head_dim or self.hidden // self.heads)

    @property
    def kv_width(self) -> int:
        """The key (or value) heads' width."""
        return (self.kv_heads or self.heads) * (self.head_dim or self.hidden // self.heads)

    @property
    def norm_parameters(self) -> int:
        """One norm's parameters: scale and shift (LayerNorm) or scale alone (RMSNorm)."""
        return (2 if self.norm_has_bias else 1) * self.hidden


def memory_shape_of(settings, padded_vocab: int, architecture) -> ModelShape:
    """The ``ModelShape`` of the shared ``model.*`` settings (a ``ModelConfig``), its vocabulary padded to
    ``padded_vocab`` rows, its layers as the family's ``Architecture`` builds them, as many key/value heads as heads
    (a family with its own attention widths replaces ``kv_heads`` and ``head_dim``: ``ModelFamily.memory_shape``)."""
    return ModelShape(hidden=settings.hidden_size, heads=settings.num_heads, ffn=settings.ffn_hidden_size,
                      padded_vocab=padded_vocab, max_seq_length=settings.max_seq_length,
                      learned_positions=settings.position_embedding == "learned",
                      rotary=settings.position_embedding == "rope", tie_embeddings=settings.tie_embeddings,
                      norm_has_bias=architecture.norm_has_bias, gated_mlp=architecture.gated_mlp,
                      linear_biases=architecture.linear_biases, fused_qkv=architecture.fused_qkv,
                      qkv_bias=settings.qkv_bias, vocab=settings.vocab_size, moe=moe_shape_of(settings))
