"""GPT building blocks with Megatron tensor parallelism: embedding, attention, MLP, transformer layer.

Activations are ``[batch, seq, hidden]`` and replicated across TP ranks between
blocks (with sequence parallelism each TP rank holds ``seq / tp`` of them). Inside
attention each TP rank owns ``num_heads / tp`` heads over the whole (CP-local)
sequence; inside the MLP it owns ``ffn_hidden_size / tp`` features. With context
parallelism the sequence is this CP rank's tokens and attention reaches the rest of
it through the CP group (``ppctl.parallel.context_parallel``). No dropout: runs are
deterministic.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ppctl.autograd.checkpoint import recomputed
from ppctl.autograd.weight_grad import DefersWeightGrads, layer_norm
from ppctl.model.kv_cache import LayerCache, cached_attention
from ppctl.parallel.context_parallel import CPGroup, context_parallel_attention
from ppctl.parallel.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    TPGroup,
    VocabParallelEmbedding,
    sequence_slice,
)


def rotary_cos_sin(position_ids: torch.Tensor, head_dim: int, base: float,
                   dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Return rotary ``(cos, sin)`` of shape ``[batch, 1, seq, head_dim]`` for int64 ``position_ids [batch, seq]``.

    Angles are computed in float64 and cast to ``dtype``, so every layout that sees
    the same position ids gets bit-identical tables.
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float64, device=position_ids.device) / head_dim
    inverse_frequencies = base ** -exponents
    angles = position_ids.to(torch.float64).unsqueeze(-1) * inverse_frequencies   # [batch, seq, head_dim/2]
    angles = torch.cat([angles, angles], dim=-1).unsqueeze(1)                      # [batch, 1, seq, head_dim]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [batch, heads, seq, head_dim]`` by the position angles (rotate-half convention)."""
    first_half, second_half = x.chunk(2, dim=-1)
    rotated_half = torch.cat([-second_half, first_half], dim=-1)
    return x * cos + rotated_half * sin


def rotate_and_attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, rotary, cache: LayerCache | None,
                      core, cp: CPGroup, recompute_core: bool) -> torch.Tensor:
    """Queries and keys rotated (``rotary``: ``(cos, sin)`` or None), then attended: through ``cache`` when decoding,
    else by ``core(query, key, value, cp)``, run again in the backward with ``recompute_core``."""
    if rotary is not None:
        query, key = apply_rotary(query, *rotary), apply_rotary(key, *rotary)
    if cache is not None:
        return cached_attention(query, key, value, cache)
    if recompute_core:
        return recomputed(core, query, key, value, cp)
    return core(query, key, value, cp)


class LayerNorm(DefersWeightGrads, nn.LayerNorm):
    """``nn.LayerNorm`` (same parameters, same math) whose scale and shift gradients a pipeline B can defer to W."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Normalise ``hidden`` over its last dims."""
        return layer_norm(hidden, self.normalized_shape, self.weight, self.bias, self.eps, self.weight_grad_store)


class Embedding(nn.Module):
    """Vocab-parallel word embedding plus, for learned positions, a replicated position table."""

    def __init__(self, vocab_size: int, hidden_size: int, max_seq_length: int, learned_positions: bool,
                 tp: TPGroup, dtype: torch.dtype):
        super().__init__()
        self.tp = tp
        self.word = VocabParallelEmbedding(vocab_size, hidden_size, tp, dtype=dtype)
        self.position = nn.Embedding(max_seq_length, hidden_size, dtype=dtype) if learned_positions else None

    def forward(self, token_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """Map ``token_ids [batch, seq]`` to hidden states ``[batch, seq, hidden]`` (``seq / tp`` of them with SP)."""
        hidden = self.word(token_ids)
        if self.position is not None:
            hidden = hidden + self.position(sequence_slice(position_ids, self.tp))
        return hidden


class CausalSelfAttention(nn.Module):
    """Causal multi-head self-attention; heads split across TP ranks, the sequence across CP ranks.

    ``qkv`` is column-parallel with local rows ``[q heads of this rank; k heads; v heads]``,
    ``proj`` is row-parallel and all-reduces the per-rank partial outputs.
    ``recompute_core``: the core (scores, softmax, weighted values) keeps only the queries,
    keys and values and runs again in the backward (``model.recompute=selective``).
    ``qkv_bias``: ``qkv`` has a bias, its rows split as the weight's (GPT-2's ``c_attn.bias``).
    """

    def __init__(self, hidden_size: int, num_heads: int, tp: TPGroup, dtype: torch.dtype,
                 cp: CPGroup | None = None, recompute_core: bool = False, qkv_bias: bool = False):
        super().__init__()
        self.cp = cp or CPGroup.single()
        self.recompute_core = recompute_core
        self.local_heads = num_heads // tp.size
        self.head_dim = hidden_size // num_heads
        # No QKV bias by default: with learned positions the key bias has an exactly zero gradient
        # (softmax ignores a shift shared by a query's scores; rotary positions rotate it, so there it
        # counts) and the value bias is equivalent to the output projection's bias, so they add little
        # capacity and some rounding noise that Adam amplifies into a random walk. ``qkv_bias`` holds
        # pretrained GPT-2 checkpoints, which have one, exactly.
        self.qkv = ColumnParallelLinear(hidden_size, 3 * hidden_size, tp, bias=qkv_bias, dtype=dtype)
        self.proj = RowParallelLinear(hidden_size, hidden_size, tp, bias=True, dtype=dtype)

    def forward(self, hidden: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor] | None,
                cache: LayerCache | None = None) -> torch.Tensor:
        """Attend causally over ``hidden [batch, seq, hidden]``; ``rotary`` is ``(cos, sin)`` or None. ``cache``
        (one process, decoding): ``hidden`` holds the new positions, which also attend to the cached ones and
        join them (``ppctl.model.kv_cache``)."""
        qkv = self.qkv(hidden)  # the whole (CP-local) sequence, also under SP
        batch, seq = qkv.shape[:2]
        qkv = qkv.view(batch, seq, 3, self.local_heads, self.head_dim)
        query, key, value = (part.transpose(1, 2) for part in qkv.unbind(dim=2))  # [batch, heads, seq, head_dim]
        attended = rotate_and_attend(query, key, value, rotary, cache, context_parallel_attention, self.cp,
                                     self.recompute_core)
        attended = attended.transpose(1, 2).reshape(batch, seq, self.local_heads * self.head_dim)
        return self.proj(attended)


class MLP(nn.Module):
    """Feed-forward block: column-parallel in, GELU (``approximate``: torch's ``"none"``, exact, or ``"tanh"``),
    row-parallel out."""

    def __init__(self, hidden_size: int, ffn_hidden_size: int, tp: TPGroup, dtype: torch.dtype,
                 approximate: str = "none"):
        super().__init__()
        self.fc_in = ColumnParallelLinear(hidden_size, ffn_hidden_size, tp, bias=True, dtype=dtype)
        self.fc_out = RowParallelLinear(ffn_hidden_size, hidden_size, tp, bias=True, dtype=dtype)
        self.approximate = approximate

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Apply the MLP to ``hidden [batch, seq, hidden]``."""
        return self.fc_out(F.gelu(self.fc_in(hidden), approximate=self.approximate))


class TransformerLayer(nn.Module):
    """Pre-norm transformer layer: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``; ``mlp``: another MLP than the
    dense one (an MoE layer's)."""

    def __init__(self, hidden_size: int, num_heads: int, ffn_hidden_size: int, norm_epsilon: float,
                 tp: TPGroup, dtype: torch.dtype, cp: CPGroup | None = None, recompute_attention_core: bool = False,
                 gelu_approximate: str = "none", qkv_bias: bool = False, mlp: nn.Module | None = None):
        super().__init__()
        self.attn_norm = LayerNorm(hidden_size, eps=norm_epsilon, dtype=dtype)
        self.attention = CausalSelfAttention(hidden_size, num_heads, tp, dtype, cp, recompute_attention_core,
                                             qkv_bias)
        self.mlp_norm = LayerNorm(hidden_size, eps=norm_epsilon, dtype=dtype)
        self.mlp = mlp if mlp is not None else MLP(hidden_size, ffn_hidden_size, tp, dtype, gelu_approximate)

    def forward(self, hidden: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
                cache: LayerCache | None = None) -> torch.Tensor:
        """Return the layer output ``[batch, seq, hidden]``; ``cache``: its attention's, when decoding."""
        hidden = hidden + self.attention(self.attn_norm(hidden), rotary, cache)
        return hidden + self.mlp(self.mlp_norm(hidden))
