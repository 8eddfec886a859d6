"""The experts of one MoE layer: every expert's MLP as stacked weights, the expert dimension first.

A stacked linear holds ``weight [E, out, in]`` (each expert's slice laid out as ``nn.Linear``'s, so one expert's
is one Hugging Face tensor) and optionally ``bias [E, out]``. It runs the rows of each expert, one contiguous
block per expert in expert order (``ppctl.model.moe.dispatch``), through that expert's slice: a grouped linear
whose weight gradients a pipeline B can defer to W. Expert parallelism will split the first dimension over ranks.
A family picks its experts' MLP: GPT's GELU MLP with biases (``GeluExperts``), Llama's SwiGLU without
(``SwiGLUExperts``), named as the family's dense MLP is.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ppctl.autograd.weight_grad import DefersWeightGrads, grouped_linear


class StackedLinear(DefersWeightGrads, nn.Module):
    """``num_experts`` linears of ``in_features -> out_features``, one per block of rows."""

    def __init__(self, num_experts: int, in_features: int, out_features: int, bias: bool, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, out_features, in_features, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(num_experts, out_features, dtype=dtype)) if bias else None

    def forward(self, rows: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
        """``rows [N, in]``, ``counts[e]`` of them expert e's in order, through each expert's linear."""
        return grouped_linear(rows, self.weight, self.bias, counts, self.weight_grad_store)


class GeluExperts(nn.Module):
    """GPT's MLP per expert: ``fc_out(gelu(fc_in(x)))`` with biases (``approximate`` as ``F.gelu``'s)."""

    def __init__(self, num_experts: int, hidden_size: int, ffn_hidden_size: int, dtype: torch.dtype,
                 approximate: str = "none"):
        super().__init__()
        self.fc_in = StackedLinear(num_experts, hidden_size, ffn_hidden_size, True, dtype)
        self.fc_out = StackedLinear(num_experts, ffn_hidden_size, hidden_size, True, dtype)
        self.approximate = approximate

    def forward(self, rows: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
        """Each expert's MLP on its block of ``rows``."""
        return self.fc_out(F.gelu(self.fc_in(rows, counts), approximate=self.approximate), counts)


class SwiGLUExperts(nn.Module):
    """Llama's MLP per expert: ``down_proj(silu(gate_proj(x)) * up_proj(x))``, no biases (Mixtral's w1, w3, w2)."""

    def __init__(self, num_experts: int, hidden_size: int, ffn_hidden_size: int, dtype: torch.dtype):
        super().__init__()
        self.gate_proj = StackedLinear(num_experts, hidden_size, ffn_hidden_size, False, dtype)
        self.up_proj = StackedLinear(num_experts, hidden_size, ffn_hidden_size, False, dtype)
        self.down_proj = StackedLinear(num_experts, ffn_hidden_size, hidden_size, False, dtype)

    def forward(self, rows: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
        """Each expert's MLP on its block of ``rows``."""
        return self.down_proj(F.silu(self.gate_proj(rows, counts)) * self.up_proj(rows, counts), counts)
