"""GPT building blocks with Megatron tensor parallelism: embedding, attention, MLP, transformer layer.

Activations are ``[batch, seq, hidden]`` and replicated across TP ranks between
blocks (with sequence parallelism each TP rank holds ``seq / tp`` of them). Inside
attention each TP rank owns ``num_heads / tp`` heads over the whole (CP-local)
sequence (under grouped-query attention, ``num_kv_heads / tp`` whole key/value heads and
the query heads that read them); inside the MLP it owns ``ffn_hidden_size / tp`` features.
With context parallelism the sequence is this CP rank's tokens and attention reaches the
rest of it through the CP group (``ppctl.parallel.context_parallel``). No dropout: runs
are deterministic. Optional hooks, off by default (GPT-NeoX's): a parallel residual, a
rotary embedding over the first part of each head, a QKV fused per head.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ppctl.autograd.checkpoint import recomputed
from ppctl.autograd.weight_grad import DefersWeightGrads, layer_norm
from ppctl.model.attention_mask import DocumentMask, attend
from ppctl.model.kv_cache import LayerCache, cached_attention
from ppctl.parallel.context_parallel import CPGroup
from ppctl.parallel.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    TPGroup,
    VocabParallelEmbedding,
    enter_tp_region,
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
    """Rotate ``x [batch, heads, seq, head_dim]`` by the position angles (rotate-half convention). Tables narrower
    than a head (partial rotary, GPT-NeoX's) rotate its first ``cos.shape[-1]`` dims and pass the rest unchanged."""
    rotary_dim = cos.shape[-1]
    if rotary_dim < x.shape[-1]:
        return torch.cat([apply_rotary(x[..., :rotary_dim], cos, sin), x[..., rotary_dim:]], dim=-1)
    first_half, second_half = x.chunk(2, dim=-1)
    rotated_half = torch.cat([-second_half, first_half], dim=-1)
    return x * cos + rotated_half * sin


def rotate_and_attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, rotary, cache: LayerCache | None,
                      core, cp: CPGroup, recompute_core: bool, mask: DocumentMask | None = None) -> torch.Tensor:
    """Queries and keys rotated (``rotary``: ``(cos, sin)`` or None), then attended: through ``cache`` when decoding,
    else by ``core(query, key, value, cp, mask)`` (``mask``: the microbatch's documents kept apart, or None), run
    again in the backward with ``recompute_core``."""
    if rotary is not None:
        query, key = apply_rotary(query, *rotary), apply_rotary(key, *rotary)
    if cache is not None:
        return cached_attention(query, key, value, cache)
    if recompute_core:
        return recomputed(core, query, key, value, cp, mask)
    return core(query, key, value, cp, mask)


def repeated_kv_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cp: CPGroup,
                          mask: DocumentMask | None = None) -> torch.Tensor:
    """Causal attention of ``query [batch, heads, seq, d]`` over ``key``/``value [batch, kv_heads, seq, d]``: each
    key/value head repeated to the ``heads / kv_heads`` consecutive query heads it serves, then attention through the
    CP group like any other (block-causal under ``mask``)."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    return attend(query, key, value, cp, mask)


def check_kv_heads(num_heads: int, num_kv_heads: int, tp_size: int) -> None:
    """Raise ValueError (one line) unless key/value heads serve whole groups of query heads and each TP rank owns
    whole key/value heads."""
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads} (each key/value "
                         f"head serves num_heads / num_kv_heads query heads)")
    if num_kv_heads % tp_size:
        raise ValueError(f"num_kv_heads={num_kv_heads} must be divisible by tp={tp_size} (each TP rank owns whole "
                         f"key/value heads)")


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
    ``num_kv_heads`` below ``num_heads`` (grouped-query attention, StarCoder2's): ``query``,
    ``key`` and ``value`` are column-parallel apart instead of ``qkv`` (each TP rank owning
    whole key/value heads and the query heads reading them, as Llama's ``q_proj``, ``k_proj``
    and ``v_proj``). ``qkv_per_head`` (GPT-NeoX's ``query_key_value``): ``qkv``'s rows are
    ``[q, k, v]`` of head 0, then of head 1, ..., so a contiguous row range holds whole heads.
    """

    def __init__(self, hidden_size: int, num_heads: int, tp: TPGroup, dtype: torch.dtype,
                 cp: CPGroup | None = None, recompute_core: bool = False, qkv_bias: bool = False,
                 num_kv_heads: int | None = None, qkv_per_head: bool = False):
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        check_kv_heads(num_heads, num_kv_heads, tp.size)
        self.tp, self.cp = tp, cp or CPGroup.single()
        self.recompute_core = recompute_core
        self.local_heads, self.local_kv_heads = num_heads // tp.size, num_kv_heads // tp.size
        self.head_dim = hidden_size // num_heads
        self.grouped, self.qkv_per_head = num_kv_heads != num_heads, qkv_per_head
        # No QKV bias by default: with learned positions the key bias has an exactly zero gradient
        # (softmax ignores a shift shared by a query's scores; rotary positions rotate it, so there it
        # counts) and the value bias is equivalent to the output projection's bias, so they add little
        # capacity and some rounding noise that Adam amplifies into a random walk. ``qkv_bias`` holds
        # pretrained GPT-2 checkpoints, which have one, exactly.
        if self.grouped:
            kv_width = num_kv_heads * self.head_dim
            self.query = ColumnParallelLinear(hidden_size, hidden_size, tp, bias=qkv_bias, dtype=dtype)
            self.key = ColumnParallelLinear(hidden_size, kv_width, tp, bias=qkv_bias, dtype=dtype)
            self.value = ColumnParallelLinear(hidden_size, kv_width, tp, bias=qkv_bias, dtype=dtype)
        else:
            self.qkv = ColumnParallelLinear(hidden_size, 3 * hidden_size, tp, bias=qkv_bias, dtype=dtype)
        self.proj = RowParallelLinear(hidden_size, hidden_size, tp, bias=True, dtype=dtype)

    def _queries_keys_values(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This rank's queries, keys and values of ``hidden``, each ``[batch, heads, seq, head_dim]``."""
        if self.grouped:
            entered = enter_tp_region(hidden, self.tp)  # one collective for the three projections, as a fused one
            return tuple(projection(entered, entered=True).unflatten(-1, (heads, self.head_dim)).transpose(1, 2)
                         for projection, heads in ((self.query, self.local_heads), (self.key, self.local_kv_heads),
                                                   (self.value, self.local_kv_heads)))
        qkv = self.qkv(hidden)  # the whole (CP-local) sequence, also under SP
        batch, seq = qkv.shape[:2]
        if self.qkv_per_head:
            parts = qkv.view(batch, seq, self.local_heads, 3, self.head_dim).unbind(dim=3)
        else:
            parts = qkv.view(batch, seq, 3, self.local_heads, self.head_dim).unbind(dim=2)
        return tuple(part.transpose(1, 2) for part in parts)

    def forward(self, hidden: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor] | None,
                cache: LayerCache | None = None, mask: DocumentMask | None = None) -> torch.Tensor:
        """Attend causally over ``hidden [batch, seq, hidden]``; ``rotary`` is ``(cos, sin)`` or None. ``cache``
        (one process, decoding): ``hidden`` holds the new positions, which also attend to the cached ones and
        join them (``ppctl.model.kv_cache``). ``mask``: no token attends across a document (``DocumentMask``)."""
        query, key, value = self._queries_keys_values(hidden)
        core = repeated_kv_attention if self.grouped else attend
        attended = rotate_and_attend(query, key, value, rotary, cache, core, self.cp, self.recompute_core, mask)
        batch, seq = attended.shape[0], attended.shape[2]
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
    dense one (an MoE layer's). ``parallel_residual`` (GPT-NeoX's): both blocks read the layer's input,
    ``x + attn(attn_norm(x)) + mlp(mlp_norm(x))``. ``num_kv_heads`` and ``qkv_per_head``: the attention's
    (``CausalSelfAttention``)."""

    def __init__(self, hidden_size: int, num_heads: int, ffn_hidden_size: int, norm_epsilon: float,
                 tp: TPGroup, dtype: torch.dtype, cp: CPGroup | None = None, recompute_attention_core: bool = False,
                 gelu_approximate: str = "none", qkv_bias: bool = False, mlp: nn.Module | None = None, *,
                 num_kv_heads: int | None = None, qkv_per_head: bool = False, parallel_residual: bool = False):
        super().__init__()
        self.parallel_residual = parallel_residual
        self.attn_norm = LayerNorm(hidden_size, eps=norm_epsilon, dtype=dtype)
        self.attention = CausalSelfAttention(hidden_size, num_heads, tp, dtype, cp, recompute_attention_core,
                                             qkv_bias, num_kv_heads, qkv_per_head)
        self.mlp_norm = LayerNorm(hidden_size, eps=norm_epsilon, dtype=dtype)
        self.mlp = mlp if mlp is not None else MLP(hidden_size, ffn_hidden_size, tp, dtype, gelu_approximate)

    def forward(self, hidden: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
                cache: LayerCache | None = None, mask: DocumentMask | None = None) -> torch.Tensor:
        """Return the layer output ``[batch, seq, hidden]``; ``cache``: its attention's, when decoding; ``mask``:
        its attention's documents kept apart."""
        attended = self.attention(self.attn_norm(hidden), rotary, cache, mask)
        if self.parallel_residual:
            return self.mlp(self.mlp_norm(hidden)) + attended + hidden  # transformers' order of the sum
        hidden = hidden + attended
        return hidden + self.mlp(self.mlp_norm(hidden))
