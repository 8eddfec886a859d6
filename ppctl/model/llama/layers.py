"""Llama building blocks with Megatron tensor parallelism: RMS norm, rotary tables, GQA, SwiGLU, the layer.

Activations are ``[batch, seq, hidden]`` and replicated across TP ranks between blocks
(with sequence parallelism each TP rank holds ``seq / tp`` of them), as in
``ppctl.model.layers``. Grouped-query attention: each TP rank owns ``num_heads / tp``
query heads and the ``num_kv_heads / tp`` whole key/value heads they read (query head
``h`` reads key/value head ``h // (num_heads / num_kv_heads)``, so contiguous shards of
``q_proj`` and ``k_proj``/``v_proj`` line up). The MLP is SwiGLU, each TP rank owning
``ffn_hidden_size / tp`` features. No biases except Qwen2's on q/k/v. Submodule and
parameter names are Hugging Face's (``self_attn.q_proj.weight``, ``mlp.gate_proj.weight``,
``input_layernorm.weight``...), so a checkpoint maps onto them one to one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ppctl.autograd.weight_grad import DefersWeightGrads, rms_norm
from ppctl.model.kv_cache import LayerCache
from ppctl.model.layers import rotate_and_attend
from ppctl.parallel.context_parallel import CPGroup, context_parallel_attention
from ppctl.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear, TPGroup, enter_tp_region


class RMSNorm(DefersWeightGrads, nn.Module):
    """Llama's RMS norm over the last dim (float32 or wider inside); a pipeline B can defer its scale gradient to W."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Normalise ``hidden`` by its root mean square and scale it."""
        return rms_norm(hidden, self.weight, self.eps, self.weight_grad_store)


# ---------------------------------------------------------------------------
# Rotary position tables
# ---------------------------------------------------------------------------

@dataclass(frozen=True)
class RopeScaling:
    """Llama 3's rotary frequency scaling (Hugging Face ``rope_type="llama3"``).

    Wavelengths longer than ``original_max_position_embeddings / low_freq_factor`` are
    stretched by ``factor``, those shorter than ``original_max_position_embeddings /
    high_freq_factor`` are kept, and those between are blended smoothly from one to the other.
    """

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self):
        if self.factor <= 0 or self.original_max_position_embeddings <= 0:
            raise ValueError(f"RopeScaling: factor ({self.factor}) and original_max_position_embeddings "
                             f"({self.original_max_position_embeddings}) must be positive")
        if not 0 < self.low_freq_factor < self.high_freq_factor:
            raise ValueError(f"RopeScaling: need 0 < low_freq_factor < high_freq_factor, got "
                             f"{self.low_freq_factor} and {self.high_freq_factor}")


def llama_inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """The ``head_dim / 2`` rotary inverse frequencies ``theta ** (-2i / head_dim)`` in float64, Llama-3-scaled."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim
    inverse_frequencies = theta ** -exponents
    return inverse_frequencies if scaling is None else _llama3_scaled(inverse_frequencies, scaling)


def _llama3_scaled(inverse_frequencies: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    """Stretch the long wavelengths by ``scaling.factor``, keep the short ones, blend those between."""
    wavelengths = 2 * math.pi / inverse_frequencies
    long_wavelength = scaling.original_max_position_embeddings / scaling.low_freq_factor
    short_wavelength = scaling.original_max_position_embeddings / scaling.high_freq_factor
    stretched = inverse_frequencies / scaling.factor
    # 0 at the long end of the band, 1 at the short end: a linear blend in periods per original context.
    blend = ((scaling.original_max_position_embeddings / wavelengths - scaling.low_freq_factor)
             / (scaling.high_freq_factor - scaling.low_freq_factor))
    blended = (1 - blend) * stretched + blend * inverse_frequencies
    scaled = torch.where(wavelengths > long_wavelength, stretched, inverse_frequencies)
    between = (wavelengths >= short_wavelength) & (wavelengths <= long_wavelength)
    return torch.where(between, blended, scaled)


def llama_rotary_cos_sin(position_ids: torch.Tensor, head_dim: int, theta: float, scaling: RopeScaling | None,
                         dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Return rotary ``(cos, sin)`` of shape ``[batch, 1, seq, head_dim]`` for int64 ``position_ids [batch, seq]``.

    Rotate-half convention (``apply_rotary``); angles in float64, cast to ``dtype``, so
    every layout that sees the same position ids gets bit-identical tables.
    """
    inverse_frequencies = llama_inverse_frequencies(head_dim, theta, scaling).to(position_ids.device)
    angles = position_ids.to(torch.float64).unsqueeze(-1) * inverse_frequencies  # [batch, seq, head_dim/2]
    angles = torch.cat([angles, angles], dim=-1).unsqueeze(1)                     # [batch, 1, seq, head_dim]
    return angles.cos().to(dtype), angles.sin().to(dtype)


# ---------------------------------------------------------------------------
# Attention, MLP, layer
# ---------------------------------------------------------------------------

def grouped_query_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            cp: CPGroup) -> torch.Tensor:
    """Causal attention of ``query [batch, heads, seq, d]`` over ``key``/``value [batch, kv_heads, seq, d]``.

    Each key/value head serves ``heads / kv_heads`` consecutive query heads; it is
    repeated to them and attention goes through the CP group like any other.
    """
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    return context_parallel_attention(query, key, value, cp)


def check_grouped_heads(num_heads: int, num_kv_heads: int, tp_size: int) -> None:
    """Raise ValueError (one line) unless each TP rank can own whole key/value heads and their query heads."""
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(f"GroupedQueryAttention: num_heads={num_heads} must be a multiple of num_kv_heads="
                         f"{num_kv_heads} (each key/value head serves num_heads / num_kv_heads query heads)")
    if num_kv_heads % tp_size:
        raise ValueError(f"GroupedQueryAttention: num_kv_heads={num_kv_heads} must be divisible by tp={tp_size} "
                         f"(each TP rank owns whole key/value heads); use a tp that divides {num_kv_heads}")


class GroupedQueryAttention(nn.Module):
    """Causal grouped-query self-attention; heads split across TP ranks, the sequence across CP ranks.

    ``q_proj`` (``num_heads * head_dim`` rows), ``k_proj`` and ``v_proj`` (``num_kv_heads *
    head_dim`` rows each) are column-parallel, with biases when ``qkv_bias`` (Qwen2);
    ``o_proj`` is row-parallel without bias. ``recompute_core``: the core keeps only the
    queries and the unrepeated keys and values and runs again in the backward.
    """

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, tp: TPGroup,
                 dtype: torch.dtype, cp: CPGroup | None = None, qkv_bias: bool = False,
                 recompute_core: bool = False):
        super().__init__()
        check_grouped_heads(num_heads, num_kv_heads, tp.size)
        self.tp, self.cp = tp, cp or CPGroup.single()
        self.recompute_core = recompute_core
        self.head_dim = head_dim
        self.local_heads, self.local_kv_heads = num_heads // tp.size, num_kv_heads // tp.size
        self.q_proj = ColumnParallelLinear(hidden_size, num_heads * head_dim, tp, bias=qkv_bias, dtype=dtype)
        self.k_proj = ColumnParallelLinear(hidden_size, num_kv_heads * head_dim, tp, bias=qkv_bias, dtype=dtype)
        self.v_proj = ColumnParallelLinear(hidden_size, num_kv_heads * head_dim, tp, bias=qkv_bias, dtype=dtype)
        self.o_proj = RowParallelLinear(num_heads * head_dim, hidden_size, tp, bias=False, dtype=dtype)

    def _heads(self, projection: ColumnParallelLinear, entered: torch.Tensor, heads: int) -> torch.Tensor:
        """Project the entered input and split it into ``[batch, heads, seq, head_dim]``."""
        projected = projection(entered, entered=True)  # as a module: its forward pre-hooks fire
        return projected.unflatten(-1, (heads, self.head_dim)).transpose(1, 2)

    def forward(self, hidden: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor] | None,
                cache: LayerCache | None = None) -> torch.Tensor:
        """Attend causally over ``hidden [batch, seq, hidden]``; ``rotary`` is ``(cos, sin)`` or None. ``cache``
        (one process, decoding): ``hidden`` holds the new positions, which also attend to the cached ones and
        join them (``ppctl.model.kv_cache``)."""
        entered = enter_tp_region(hidden, self.tp)  # the whole (CP-local) sequence, also under SP
        query = self._heads(self.q_proj, entered, self.local_heads)
        key = self._heads(self.k_proj, entered, self.local_kv_heads)
        value = self._heads(self.v_proj, entered, self.local_kv_heads)
        attended = rotate_and_attend(query, key, value, rotary, cache, grouped_query_attention, self.cp,
                                     self.recompute_core)
        return self.o_proj(attended.transpose(1, 2).flatten(2))


class SwiGLUMLP(nn.Module):
    """SwiGLU feed-forward ``down_proj(silu(gate_proj(x)) * up_proj(x))``; gate and up column-, down row-parallel."""

    def __init__(self, hidden_size: int, ffn_hidden_size: int, tp: TPGroup, dtype: torch.dtype):
        super().__init__()
        self.tp = tp
        self.gate_proj = ColumnParallelLinear(hidden_size, ffn_hidden_size, tp, bias=False, dtype=dtype)
        self.up_proj = ColumnParallelLinear(hidden_size, ffn_hidden_size, tp, bias=False, dtype=dtype)
        self.down_proj = RowParallelLinear(ffn_hidden_size, hidden_size, tp, bias=False, dtype=dtype)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Apply the MLP to ``hidden [batch, seq, hidden]``."""
        entered = enter_tp_region(hidden, self.tp)
        gate, up = self.gate_proj(entered, entered=True), self.up_proj(entered, entered=True)
        return self.down_proj(F.silu(gate) * up)


class LlamaLayer(nn.Module):
    """Pre-norm Llama decoder layer: ``x + self_attn(norm(x))``, then ``x + mlp(norm(x))``; ``mlp``: another MLP than
    the dense SwiGLU (an MoE layer's)."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, ffn_hidden_size: int,
                 norm_epsilon: float, tp: TPGroup, dtype: torch.dtype, cp: CPGroup | None = None,
                 qkv_bias: bool = False, recompute_attention_core: bool = False, mlp: nn.Module | None = None):
        super().__init__()
        self.input_layernorm = RMSNorm(hidden_size, eps=norm_epsilon, dtype=dtype)
        self.self_attn = GroupedQueryAttention(hidden_size, num_heads, num_kv_heads, head_dim, tp, dtype, cp,
                                               qkv_bias, recompute_attention_core)
        self.post_attention_layernorm = RMSNorm(hidden_size, eps=norm_epsilon, dtype=dtype)
        self.mlp = mlp if mlp is not None else SwiGLUMLP(hidden_size, ffn_hidden_size, tp, dtype)

    def forward(self, hidden: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
                cache: LayerCache | None = None) -> torch.Tensor:
        """Return the layer output ``[batch, seq, hidden]``; ``cache``: its attention's, when decoding."""
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), rotary, cache)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))
