"""OLMo 2's layer: Llama's attention and SwiGLU MLP, normalised after each (not before), and its queries and keys
RMS-normalised over their whole width before they are split into heads.

``Olmo2Layer`` computes ``x + post_attention_layernorm(self_attn(x))``, then ``x + post_feedforward_layernorm(
mlp(x))``: no norm on the way in. ``Olmo2Attention`` normalises the projected queries (``num_heads * head_dim``
wide) and keys (``num_kv_heads * head_dim``) each by one root mean square over the whole width, then splits them into
heads and rotates them. Under TP each rank holds its heads' slice of that width (and of the norm's weight): the sum of
squares is all-reduced over the TP group (``sum_over_tp``, whose backward all-reduces the gradient too: each rank's
slice reads the one sum). Every norm scales in float32 or wider before the cast back, as OLMo 2 does
(``RMSNorm`` with offset 0). Parameter names are Hugging Face's.
"""

from __future__ import annotations

import torch
from torch import nn

from ppctl.model.kv_cache import LayerCache
from ppctl.model.attention_mask import DocumentMask
from ppctl.model.layers import rotate_and_attend
from ppctl.model.llama.layers import GroupedQueryAttention, RMSNorm, SwiGLUMLP, grouped_query_attention
from ppctl.parallel.context_parallel import CPGroup
from ppctl.parallel.tensor_parallel import TPGroup, copy_to_tp_region, enter_tp_region, reduce_from_tp_region


def sum_over_tp(tensor: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """``tensor`` summed over the TP ranks, differentiably: all-reduced forward, and its gradient all-reduced backward
    (each rank's slice reads the one sum, so the sum's gradient is every rank's share added). Megatron's two regions
    back to back: leaving one (all-reduce forward, identity backward), entering the next (identity forward, all-reduce
    backward). ``tensor`` itself at tp=1."""
    return copy_to_tp_region(reduce_from_tp_region(tensor, tp), tp)


class WholeWidthRMSNorm(nn.Module):
    """An RMS norm over a last dim that TP splits: this rank holds ``width / tp`` features and their scale; the mean
    square is of the whole ``width`` (the ranks' sums of squares added: ``sum_over_tp``). Computed in float32 or
    wider, scaled, then cast back (OLMo 2's order)."""

    def __init__(self, width: int, eps: float, tp: TPGroup, dtype: torch.dtype):
        super().__init__()
        self.width, self.eps, self.tp = width, eps, tp
        self.weight = nn.Parameter(torch.ones(width // tp.size, dtype=dtype))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Normalise this rank's slice ``hidden [..., width / tp]`` by the whole width's root mean square."""
        upcast = hidden.to(torch.promote_types(hidden.dtype, torch.float32))
        square_sum = sum_over_tp(upcast.pow(2).sum(dim=-1, keepdim=True), self.tp)
        unit = upcast * torch.rsqrt(square_sum / self.width + self.eps)
        return (self.weight.to(unit.dtype) * unit).to(hidden.dtype)


class Olmo2Attention(GroupedQueryAttention):
    """Llama's grouped-query attention whose projected queries and keys are each RMS-normalised over their whole
    width (``q_norm``, ``k_norm``: ``WholeWidthRMSNorm``) before the split into heads and the rotation."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, norm_epsilon: float,
                 tp: TPGroup, dtype: torch.dtype, cp: CPGroup | None = None, recompute_core: bool = False):
        super().__init__(hidden_size, num_heads, num_kv_heads, head_dim, tp, dtype, cp, recompute_core=recompute_core)
        self.q_norm = WholeWidthRMSNorm(num_heads * head_dim, norm_epsilon, tp, dtype)
        self.k_norm = WholeWidthRMSNorm(num_kv_heads * head_dim, norm_epsilon, tp, dtype)

    def _normalised_heads(self, projection, norm: WholeWidthRMSNorm, entered: torch.Tensor,
                          heads: int) -> torch.Tensor:
        """Project the entered input, normalise it over its whole width, split it into ``[batch, heads, seq, d]``."""
        normalised = norm(projection(entered, entered=True))
        return normalised.unflatten(-1, (heads, self.head_dim)).transpose(1, 2)

    def forward(self, hidden: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor] | None,
                cache: LayerCache | None = None, mask: DocumentMask | None = None) -> torch.Tensor:
        """Attend causally over ``hidden [batch, seq, hidden]`` (``GroupedQueryAttention.forward``; ``mask``: documents
        kept apart), its queries and keys normalised over their whole width first."""
        entered = enter_tp_region(hidden, self.tp)
        query = self._normalised_heads(self.q_proj, self.q_norm, entered, self.local_heads)
        key = self._normalised_heads(self.k_proj, self.k_norm, entered, self.local_kv_heads)
        value = self._heads(self.v_proj, entered, self.local_kv_heads)
        attended = rotate_and_attend(query, key, value, rotary, cache, grouped_query_attention, self.cp,
                                     self.recompute_core, mask)
        return self.o_proj(attended.transpose(1, 2).flatten(2))


class Olmo2Layer(nn.Module):
    """OLMo 2's decoder layer: ``x + post_attention_layernorm(self_attn(x))``, then ``x +
    post_feedforward_layernorm(mlp(x))``."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, ffn_hidden_size: int,
                 norm_epsilon: float, tp: TPGroup, dtype: torch.dtype, cp: CPGroup | None = None,
                 recompute_attention_core: bool = False):
        super().__init__()
        self.self_attn = Olmo2Attention(hidden_size, num_heads, num_kv_heads, head_dim, norm_epsilon, tp, dtype, cp,
                                        recompute_attention_core)
        self.post_attention_layernorm = RMSNorm(hidden_size, eps=norm_epsilon, dtype=dtype, offset=0.0)
        self.mlp = SwiGLUMLP(hidden_size, ffn_hidden_size, tp, dtype)
        self.post_feedforward_layernorm = RMSNorm(hidden_size, eps=norm_epsilon, dtype=dtype, offset=0.0)

    def forward(self, hidden: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
                cache: LayerCache | None = None, mask: DocumentMask | None = None) -> torch.Tensor:
        """Return the layer output ``[batch, seq, hidden]``; ``cache``: its attention's, when decoding; ``mask``:
        its attention's documents kept apart."""
        hidden = hidden + self.post_attention_layernorm(self.self_attn(hidden, rotary, cache, mask))
        return hidden + self.post_feedforward_layernorm(self.mlp(hidden))
