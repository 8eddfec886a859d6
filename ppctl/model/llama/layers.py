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

import functools
import math
from dataclasses import dataclass
from types import MappingProxyType

import torch
import torch.nn.functional as F
from torch import nn

from ppctl.autograd.weight_grad import DefersWeightGrads, RMSNormOp, rms_norm, split_op
from ppctl.model.attention_mask import DocumentMask, attend
from ppctl.model.kv_cache import LayerCache
from ppctl.model.layers import rotate_and_attend
from ppctl.parallel.context_parallel import CPGroup
from ppctl.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear, TPGroup, enter_tp_region


class RMSNorm(DefersWeightGrads, nn.Module):
    """Llama's RMS norm over the last dim (float32 or wider inside); a pipeline B can defer its scale gradient to W.

    ``offset``: None is Llama's norm (the scale applied after the cast back); a number scales by ``offset + weight``
    before the cast back (``OffsetRMSNormOp``), as Gemma (1: its weights stored around 0) and OLMo 2 (0) do."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype = torch.float32,
                 offset: float | None = None):
        super().__init__()
        self.eps, self.offset = eps, offset
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Normalise ``hidden`` by its root mean square and scale it."""
        if self.offset is not None:
            return offset_rms_norm(hidden, self.weight, self.offset, self.eps, self.weight_grad_store)
        return rms_norm(hidden, self.weight, self.eps, self.weight_grad_store)


@dataclass(frozen=True)
class OffsetRMSNormOp(RMSNormOp):
    """RMS norm scaled by ``offset + weight`` in float32 or wider, then cast to the input dtype (Gemma's and OLMo 2's
    order: their scale multiplies before the cast, Llama's after). dW is dY times the unit-RMS input."""

    offset: float = 0.0

    def forward(self, inputs, weights):
        """Return the normalised, scaled inputs; keeps the inputs and 1/rms (in the compute dtype)."""
        unit, rstd = _unit_rms(inputs, self.eps)
        return (unit * (self.offset + weights[0].to(rstd.dtype))).to(inputs.dtype), (inputs, rstd)

    def input_grad(self, grad_output, saved, weights):
        """dX = rstd * (dU - U * mean(dU * U)), dU = dY * (offset + w) (compute dtype)."""
        inputs, rstd = saved
        unit = inputs.to(rstd.dtype) * rstd
        grad_unit = grad_output.to(rstd.dtype) * (self.offset + weights[0].to(rstd.dtype))
        grad_input = rstd * (grad_unit - unit * (grad_unit * unit).mean(dim=-1, keepdim=True))
        return grad_input.to(inputs.dtype)

    def weight_grads(self, grad_output, saved, weights, wanted):
        """dW = dY * U summed over tokens, in the compute dtype (d(offset + w)/dw = 1)."""
        if not wanted[0]:
            return (None,)
        inputs, rstd = saved
        grad = grad_output.to(rstd.dtype) * (inputs.to(rstd.dtype) * rstd)
        return (grad.reshape(-1, grad.shape[-1]).sum(dim=0).to(weights[0].dtype),)


def _unit_rms(inputs: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``inputs / rms(inputs)`` and ``1 / rms`` in float32 or wider."""
    upcast = inputs.to(torch.promote_types(inputs.dtype, torch.float32))
    rstd = torch.rsqrt(upcast.pow(2).mean(dim=-1, keepdim=True) + eps)
    return upcast * rstd, rstd


def offset_rms_norm(inputs: torch.Tensor, weight: torch.Tensor, offset: float, eps: float, store) -> torch.Tensor:
    """The RMS norm scaled by ``offset + weight`` (``OffsetRMSNormOp``); with a store, run as a split op (its B
    computes the scale gradient), without one as PyTorch's own ops."""
    if store is None:
        unit, rstd = _unit_rms(inputs, eps)
        return (unit * (offset + weight.to(rstd.dtype))).to(inputs.dtype)
    return split_op(OffsetRMSNormOp(eps, offset), inputs, (weight,), store)


# ---------------------------------------------------------------------------
# Rotary position tables
# ---------------------------------------------------------------------------

@dataclass(frozen=True)
class RopeScaling:
    """A rotary frequency scaling by ``factor`` (Hugging Face's ``rope_type``, ``kind`` here), as transformers'
    ``modeling_rope_utils`` computes it.

    ``llama3``: wavelengths longer than ``original_max_position_embeddings / low_freq_factor`` are stretched by
    ``factor``, those shorter than ``original_max_position_embeddings / high_freq_factor`` kept, those between
    blended. ``linear``: every frequency divided by ``factor`` (positions interpolated). ``yarn``: YaRN's blend of the
    two by dimension (the dimensions that turn fewer than ``beta_slow`` times over ``original_max_position_embeddings``
    interpolated, more than ``beta_fast`` times kept, a linear ramp between, its ends rounded out when ``truncate``),
    and ``cos``/``sin`` scaled by ``attention_factor`` (None: YaRN's ``0.1 ln(factor) + 1``).
    """

    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    kind: str = "llama3"
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float | None = None

    def __post_init__(self):
        if self.kind not in ROPE_SCALINGS:
            raise ValueError(f"RopeScaling: kind {self.kind!r} must be one of {', '.join(ROPE_SCALINGS)}")
        if self.factor <= 0 or self.original_max_position_embeddings <= 0:
            raise ValueError(f"RopeScaling: factor ({self.factor}) and original_max_position_embeddings "
                             f"({self.original_max_position_embeddings}) must be positive")
        if self.kind == "llama3" and not 0 < self.low_freq_factor < self.high_freq_factor:
            raise ValueError(f"RopeScaling: need 0 < low_freq_factor < high_freq_factor, got "
                             f"{self.low_freq_factor} and {self.high_freq_factor}")

    @property
    def cos_sin_factor(self) -> float:
        """What ``cos`` and ``sin`` are multiplied by: YaRN's attention factor, else 1."""
        if self.kind != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return self.attention_factor
        return yarn_attention_factor(self.factor)


ROPE_SCALINGS = ("llama3", "linear", "yarn")


def yarn_attention_factor(factor: float, mscale: float = 1.0) -> float:
    """YaRN's default scale of ``cos`` and ``sin`` (its paper's Eq. 21): ``0.1 * mscale * ln(factor) + 1``, 1 for a
    factor of at most 1."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def llama_inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """The ``head_dim / 2`` rotary inverse frequencies ``theta ** (-2i / head_dim)`` in float64, scaled as
    ``scaling`` says."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim
    inverse_frequencies = theta ** -exponents
    if scaling is None:
        return inverse_frequencies
    if scaling.kind == "linear":
        return inverse_frequencies / scaling.factor
    if scaling.kind == "yarn":
        return _yarn_scaled(inverse_frequencies, head_dim, theta, scaling)
    return _llama3_scaled(inverse_frequencies, scaling)


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


def _yarn_scaled(inverse_frequencies: torch.Tensor, head_dim: int, theta: float,
                 scaling: RopeScaling) -> torch.Tensor:
    """YaRN: each frequency pair ``i`` kept (extrapolated) below the ramp, divided by ``factor`` (interpolated)
    above it, blended linearly in ``i`` on it; the ramp runs between the pairs that turn ``beta_fast`` and
    ``beta_slow`` times over the original context."""
    def pair_turning(turns: float) -> float:
        """The (fractional) pair index whose wavelength fits ``turns`` times in the original context."""
        return (head_dim * math.log(scaling.original_max_position_embeddings / (turns * 2 * math.pi))
                / (2 * math.log(theta)))

    low, high = pair_turning(scaling.beta_fast), pair_turning(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    kept = 1 - ramp
    return inverse_frequencies / scaling.factor * (1 - kept) + inverse_frequencies * kept


def llama_rotary_cos_sin(position_ids: torch.Tensor, head_dim: int, theta: float, scaling: RopeScaling | None,
                         dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Return rotary ``(cos, sin)`` of shape ``[batch, 1, seq, head_dim]`` for int64 ``position_ids [batch, seq]``.

    Rotate-half convention (``apply_rotary``); angles in float64, cast to ``dtype``, so
    every layout that sees the same position ids gets bit-identical tables.
    """
    inverse_frequencies = llama_inverse_frequencies(head_dim, theta, scaling).to(position_ids.device)
    angles = position_ids.to(torch.float64).unsqueeze(-1) * inverse_frequencies  # [batch, seq, head_dim/2]
    angles = torch.cat([angles, angles], dim=-1).unsqueeze(1)                     # [batch, 1, seq, head_dim]
    cos, sin = angles.cos(), angles.sin()
    if scaling is not None and scaling.cos_sin_factor != 1.0:  # YaRN's attention factor, in float64 as the angles
        cos, sin = cos * scaling.cos_sin_factor, sin * scaling.cos_sin_factor
    return cos.to(dtype), sin.to(dtype)


# ---------------------------------------------------------------------------
# Attention, MLP, layer
# ---------------------------------------------------------------------------

def grouped_query_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            cp: CPGroup, mask: DocumentMask | None = None) -> torch.Tensor:
    """Causal attention of ``query [batch, heads, seq, d]`` over ``key``/``value [batch, kv_heads, seq, d]``.

    Each key/value head serves ``heads / kv_heads`` consecutive query heads; it is
    repeated to them and attention goes through the CP group like any other (block-causal
    under ``mask``: documents kept apart).
    """
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    return attend(query, key, value, cp, mask)


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
    ``o_proj`` is row-parallel, with a bias when ``output_bias`` (Llama's ``attention_bias``).
    ``recompute_core``: the core keeps only the queries and the unrepeated keys and values and runs
    again in the backward.
    ``qk_norm_epsilon``: each query and key head RMS-normalised over its ``head_dim`` by one
    scale per side (``q_norm``, ``k_norm``) before the rotation (Qwen3); None: no such norm.
    """

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, tp: TPGroup,
                 dtype: torch.dtype, cp: CPGroup | None = None, qkv_bias: bool = False,
                 recompute_core: bool = False, qk_norm_epsilon: float | None = None, output_bias: bool = False):
        super().__init__()
        check_grouped_heads(num_heads, num_kv_heads, tp.size)
        self.tp, self.cp = tp, cp or CPGroup.single()
        self.recompute_core = recompute_core
        self.head_dim = head_dim
        self.local_heads, self.local_kv_heads = num_heads // tp.size, num_kv_heads // tp.size
        self.q_proj = ColumnParallelLinear(hidden_size, num_heads * head_dim, tp, bias=qkv_bias, dtype=dtype)
        self.k_proj = ColumnParallelLinear(hidden_size, num_kv_heads * head_dim, tp, bias=qkv_bias, dtype=dtype)
        self.v_proj = ColumnParallelLinear(hidden_size, num_kv_heads * head_dim, tp, bias=qkv_bias, dtype=dtype)
        self.o_proj = RowParallelLinear(num_heads * head_dim, hidden_size, tp, bias=output_bias, dtype=dtype)
        # Registered only when used, so that a model without them keeps its parameters (and their order).
        self.q_norm = self.k_norm = None
        if qk_norm_epsilon is not None:
            self.q_norm = RMSNorm(head_dim, eps=qk_norm_epsilon, dtype=dtype)
            self.k_norm = RMSNorm(head_dim, eps=qk_norm_epsilon, dtype=dtype)

    def _heads(self, projection: ColumnParallelLinear, entered: torch.Tensor, heads: int) -> torch.Tensor:
        """Project the entered input and split it into ``[batch, heads, seq, head_dim]``."""
        projected = projection(entered, entered=True)  # as a module: its forward pre-hooks fire
        return projected.unflatten(-1, (heads, self.head_dim)).transpose(1, 2)

    def forward(self, hidden: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor] | None,
                cache: LayerCache | None = None, mask: DocumentMask | None = None) -> torch.Tensor:
        """Attend causally over ``hidden [batch, seq, hidden]``; ``rotary`` is ``(cos, sin)`` or None. ``cache``
        (one process, decoding): ``hidden`` holds the new positions, which also attend to the cached ones and
        join them (``ppctl.model.kv_cache``). ``mask``: no token attends across a document (``DocumentMask``)."""
        entered = enter_tp_region(hidden, self.tp)  # the whole (CP-local) sequence, also under SP
        query = self._heads(self.q_proj, entered, self.local_heads)
        key = self._heads(self.k_proj, entered, self.local_kv_heads)
        value = self._heads(self.v_proj, entered, self.local_kv_heads)
        if self.q_norm is not None:  # each TP rank's whole heads: the norm needs no other rank's
            query, key = self.q_norm(query), self.k_norm(key)
        attended = rotate_and_attend(query, key, value, rotary, cache, grouped_query_attention, self.cp,
                                     self.recompute_core, mask)
        return self.o_proj(attended.transpose(1, 2).flatten(2))


# The gate's activation of a gated MLP, by name: SiLU (SwiGLU, Llama's) or the tanh GELU (GeGLU, Gemma's).
GATE_ACTIVATIONS = MappingProxyType({"silu": F.silu, "gelu_tanh": functools.partial(F.gelu, approximate="tanh")})


class SwiGLUMLP(nn.Module):
    """SwiGLU feed-forward ``down_proj(silu(gate_proj(x)) * up_proj(x))``; gate and up column-, down row-parallel.
    ``activation``: the gate's (``GATE_ACTIVATIONS``; ``gelu_tanh`` makes it Gemma's GeGLU)."""

    def __init__(self, hidden_size: int, ffn_hidden_size: int, tp: TPGroup, dtype: torch.dtype,
                 activation: str = "silu"):
        super().__init__()
        self.tp = tp
        self.activation = GATE_ACTIVATIONS[activation]
        self.gate_proj = ColumnParallelLinear(hidden_size, ffn_hidden_size, tp, bias=False, dtype=dtype)
        self.up_proj = ColumnParallelLinear(hidden_size, ffn_hidden_size, tp, bias=False, dtype=dtype)
        self.down_proj = RowParallelLinear(ffn_hidden_size, hidden_size, tp, bias=False, dtype=dtype)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Apply the MLP to ``hidden [batch, seq, hidden]``."""
        entered = enter_tp_region(hidden, self.tp)
        gate, up = self.gate_proj(entered, entered=True), self.up_proj(entered, entered=True)
        return self.down_proj(self.activation(gate) * up)


class LlamaLayer(nn.Module):
    """Pre-norm Llama decoder layer: ``x + self_attn(norm(x))``, then ``x + mlp(norm(x))``; ``mlp``: another MLP than
    the dense SwiGLU (an MoE layer's); ``qk_norm``: Qwen3's per-head q/k norms, of the layer's epsilon;
    ``norm_offset``: its norms' ``RMSNorm.offset`` (Gemma's 1); ``activation``: the dense MLP's gate's;
    ``attention_output_bias``: a bias on ``o_proj`` (Llama's ``attention_bias``, with ``qkv_bias``)."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, ffn_hidden_size: int,
                 norm_epsilon: float, tp: TPGroup, dtype: torch.dtype, cp: CPGroup | None = None,
                 qkv_bias: bool = False, recompute_attention_core: bool = False, mlp: nn.Module | None = None,
                 qk_norm: bool = False, norm_offset: float | None = None, activation: str = "silu",
                 attention_output_bias: bool = False):
        super().__init__()
        self.input_layernorm = RMSNorm(hidden_size, eps=norm_epsilon, dtype=dtype, offset=norm_offset)
        self.self_attn = GroupedQueryAttention(hidden_size, num_heads, num_kv_heads, head_dim, tp, dtype, cp,
                                               qkv_bias, recompute_attention_core,
                                               norm_epsilon if qk_norm else None, attention_output_bias)
        self.post_attention_layernorm = RMSNorm(hidden_size, eps=norm_epsilon, dtype=dtype, offset=norm_offset)
        self.mlp = mlp if mlp is not None else SwiGLUMLP(hidden_size, ffn_hidden_size, tp, dtype, activation)

    def forward(self, hidden: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
                cache: LayerCache | None = None, mask: DocumentMask | None = None) -> torch.Tensor:
        """Return the layer output ``[batch, seq, hidden]``; ``cache``: its attention's, when decoding; ``mask``:
        its attention's documents kept apart."""
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), rotary, cache, mask)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))
