"""The GPT family's shape (``GPTConfig``) and stage chunk (``GPTChunk``), with Megatron tensor parallelism.

A ``GPTChunk`` is a ``ppctl.model.chunk.DecoderChunk`` of GPT layers (``ppctl.model.layers``): the
word/position embedding on the first stage, LayerNorm and a GELU MLP (exact or tanh-approximated), fused QKV
(with a bias when ``qkv_bias``), learned or rotary positions, the final norm, output layer and vocab-parallel loss
on the last. Grouped-query attention (``num_kv_heads``, StarCoder2's) projects q, k and v apart. GPT-NeoX's hooks,
off by default (``ppctl.model.gpt_neox`` sets them): a parallel residual, rotary positions over the first
``partial_rotary_factor`` of each head, a QKV fused per head.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ppctl.model.chunk import DecoderChunk
from ppctl.model.gpt.rules import gpt_rule
from ppctl.model.layers import MLP, Embedding, LayerNorm, TransformerLayer, rotary_cos_sin
from ppctl.model.moe.experts import GeluExperts
from ppctl.model.moe.layer import MoEMLP
from ppctl.model.moe.shape import MoEShape

POSITION_EMBEDDINGS = ("learned", "rope")
# model.activation -> torch's F.gelu(approximate=...): the exact GELU, or 0.5x(1 + tanh(sqrt(2/pi)(x + 0.044715x^3))).
GELU_APPROXIMATIONS = {"gelu": "none", "gelu_tanh": "tanh"}


@dataclass(frozen=True)
class GPTConfig:
    """Shape of the GPT model.

    num_layers: transformer layers in the whole model.
    hidden_size: width of the residual stream.
    num_heads: attention heads (divides hidden_size; TP splits them).
    ffn_hidden_size: MLP inner width (TP splits it).
    activation: the MLP's GELU, "gelu" (exact) or "gelu_tanh" (its tanh approximation, GPT-2's).
    vocab_size: the tokenizer's vocabulary: the classes the model predicts.
    padded_vocab_size: rows of the embedding and output layer (>= vocab_size, a multiple of tp;
        default vocab_size). Padded rows start at zero and never enter the math: no token
        looks them up and the cross-entropy excludes their logits, so the model is the same
        whatever the padding (Megatron-LM lets them into the softmax).
    max_seq_length: longest sequence (size of the learned position table).
    position_embedding: "learned" (table added to the embedding) or "rope" (rotary on q and k).
    tie_embeddings: the output layer reuses (or, on another stage, starts equal to) the word embedding.
    norm_epsilon: LayerNorm epsilon.
    init_std: standard deviation of the normal weight initialisation.
    rope_base: base of the rotary frequencies.
    qkv_bias: the fused QKV projection has a bias (GPT-2's ``c_attn.bias``), starting at zero.
    moe: the mixture of experts some layers' MLP is (``ppctl.model.moe``), or None (dense).
    num_kv_heads: key/value heads of grouped-query attention (divides num_heads; TP splits them whole); None:
        num_heads (one fused QKV).
    partial_rotary_factor: the fraction of each head's dims rotary positions rotate (its first
        ``int(head_dim * factor)``, an even number), the rest passed unchanged (GPT-NeoX's ``rotary_pct``).
    parallel_residual: attention and MLP both read the layer's input (GPT-NeoX's ``use_parallel_residual``).
    qkv_per_head: the fused QKV's rows are ``[q, k, v]`` head by head (GPT-NeoX's ``query_key_value``) rather
        than ``[q; k; v]``.
    """

    num_layers: int
    hidden_size: int
    num_heads: int
    ffn_hidden_size: int
    vocab_size: int
    max_seq_length: int
    activation: str = "gelu"
    position_embedding: str = "learned"
    tie_embeddings: bool = False
    norm_epsilon: float = 1e-5
    init_std: float = 0.02
    rope_base: float = 10000.0
    qkv_bias: bool = False
    padded_vocab_size: int | None = None
    moe: MoEShape | None = None
    num_kv_heads: int | None = None
    partial_rotary_factor: float = 1.0
    parallel_residual: bool = False
    qkv_per_head: bool = False

    def __post_init__(self):
        if self.padded_vocab_size is None:
            object.__setattr__(self, "padded_vocab_size", self.vocab_size)
        for field in ("num_layers", "hidden_size", "num_heads", "ffn_hidden_size", "vocab_size", "max_seq_length"):
            if getattr(self, field) < 1:
                raise ValueError(f"GPTConfig.{field} must be >= 1, got {getattr(self, field)}")
        if self.padded_vocab_size < self.vocab_size:
            raise ValueError(f"GPTConfig.padded_vocab_size {self.padded_vocab_size} must be >= "
                             f"vocab_size {self.vocab_size}")
        if self.hidden_size % self.num_heads != 0:
            raise ValueError(f"GPTConfig: hidden_size {self.hidden_size} must be a multiple of "
                             f"num_heads {self.num_heads}")
        if self.activation not in GELU_APPROXIMATIONS:
            raise ValueError(f"GPTConfig.activation must be one of {tuple(GELU_APPROXIMATIONS)}, "
                             f"got {self.activation!r}")
        if self.position_embedding not in POSITION_EMBEDDINGS:
            raise ValueError(f"GPTConfig.position_embedding must be one of {POSITION_EMBEDDINGS}, "
                             f"got {self.position_embedding!r}")
        if self.position_embedding == "rope" and (self.rotary_dim % 2 != 0 or self.rotary_dim < 2):
            raise ValueError(f"GPTConfig: rope needs an even number of rotated dims per head, got {self.rotary_dim}")
        if self.num_heads % self.kv_heads != 0:
            raise ValueError(f"GPTConfig: num_heads {self.num_heads} must be a multiple of num_kv_heads "
                             f"{self.kv_heads}")
        if self.qkv_per_head and self.kv_heads != self.num_heads:
            raise ValueError("GPTConfig: a QKV fused per head has as many key/value heads as heads")

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.hidden_size // self.num_heads

    @property
    def kv_heads(self) -> int:
        """Key/value heads: ``num_kv_heads``, or ``num_heads`` when unset."""
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

    @property
    def rotary_dim(self) -> int:
        """The dims of each head rotary positions rotate: its first ``int(head_dim * partial_rotary_factor)``
        (truncated, as transformers' GPT-NeoX)."""
        return int(self.head_dim * self.partial_rotary_factor)


def check_tp_divides(config: GPTConfig, tp_size: int) -> None:
    """Raise ValueError unless heads (whole key/value heads), MLP width and padded vocabulary split evenly over
    ``tp_size`` ranks."""
    for field in ("num_heads", "kv_heads", "ffn_hidden_size", "padded_vocab_size"):
        if getattr(config, field) % tp_size != 0:
            name = "num_kv_heads" if field == "kv_heads" else field
            raise ValueError(f"model.{name}={getattr(config, field)} must be a multiple of parallel.tp={tp_size}")


class GPTChunk(DecoderChunk):
    """One pipeline stage chunk of the GPT model on one TP rank (``DecoderChunk``): LayerNorm, a GELU MLP (exact or
    tanh), fused QKV, learned or rotary positions."""

    check_tp_divides = staticmethod(check_tp_divides)

    def make_embedding(self, dtype: torch.dtype) -> nn.Module:
        """Word embedding, plus a learned position table unless positions are rotary."""
        config = self.config
        return Embedding(config.padded_vocab_size, config.hidden_size, config.max_seq_length,
                         config.position_embedding == "learned", self.tp, dtype)

    def make_layer(self, dtype: torch.dtype, recompute_attention_core: bool, mlp: nn.Module | None) -> nn.Module:
        """A pre-norm GPT layer."""
        config = self.config
        return TransformerLayer(config.hidden_size, config.num_heads, config.ffn_hidden_size, config.norm_epsilon,
                                self.tp, dtype, self.cp, recompute_attention_core,
                                GELU_APPROXIMATIONS[config.activation], config.qkv_bias, mlp,
                                num_kv_heads=config.num_kv_heads, qkv_per_head=config.qkv_per_head,
                                parallel_residual=config.parallel_residual)

    def make_moe_mlp(self, dtype: torch.dtype) -> nn.Module:
        """Experts as GELU MLPs with biases; the shared experts as one dense GPT MLP."""
        config, moe = self.config, self.config.moe
        approximate = GELU_APPROXIMATIONS[config.activation]
        local_experts = len(self.ep.local_experts(moe.num_experts))  # this EP rank's share
        experts = GeluExperts(local_experts, config.hidden_size, moe.expert_ffn_hidden_size, dtype, approximate)
        shared = (MLP(config.hidden_size, moe.shared_ffn_hidden_size, self.tp, dtype, approximate)
                  if moe.shared_experts else None)
        return MoEMLP(config.hidden_size, moe, experts, shared, dtype, self.ep, self.groups.token_split)

    def make_final_norm(self, dtype: torch.dtype) -> nn.Module:
        """LayerNorm."""
        return LayerNorm(self.config.hidden_size, eps=self.config.norm_epsilon, dtype=dtype)

    def parameter_rule(self, name: str):
        """The GPT rule of ``name`` (``ppctl.model.gpt.rules``)."""
        return gpt_rule(name, self.config.tie_embeddings, self.config.qkv_per_head)

    @property
    def layers_read_positions(self) -> bool:
        """Whether its layers read the tokens' positions (rotary), beyond the embedding."""
        return self.config.position_embedding == "rope" and bool(self.layer_ids)

    def rotary_tables(self, position_ids: torch.Tensor, dtype: torch.dtype):
        """Rotary ``(cos, sin)`` of ``model.rope_base`` over the rotated dims of a head (``rotary_dim``)."""
        return rotary_cos_sin(position_ids, self.config.rotary_dim, self.config.rope_base, dtype)
