"""The shape of a model's experts (``model.moe``), as frozen data: which layers route, and how (pure, no torch).

Layer ``i`` (0-based, global) is an MoE layer when ``i >= first_dense_layers`` and ``(i - first_dense_layers)`` is a
multiple of ``layer_freq``: ``layer_freq=1`` makes every layer after the dense ones an MoE layer (Mixtral,
DeepSeek-V3 after its first dense layers), ``layer_freq=2`` every other one. The shared experts run as one MLP of
``shared_experts * expert_ffn_hidden_size`` features, as DeepSeek sizes them (``n_shared_experts *
moe_intermediate_size``), added whole (DeepSeek) or, with ``shared_expert_gate``, scaled per token by a sigmoid
gate (Qwen2-MoE).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class MoEShape:
    """What the MoE layers of a model are (``model.moe``, ``expert_ffn_hidden_size`` resolved)."""

    num_experts: int
    topk: int
    expert_ffn_hidden_size: int
    layer_freq: int = 1
    first_dense_layers: int = 0
    shared_experts: int = 0
    shared_expert_gate: bool = False
    router_score: str = "softmax"
    router_topk_norm: bool = False
    aux_loss_coeff: float = 0.0
    z_loss_coeff: float = 0.0
    expert_bias: bool = False
    expert_bias_update_rate: float = 1e-3
    capacity_factor: float | None = None
    drop_policy: str = "probs"

    def is_moe_layer(self, layer_id: int) -> bool:
        """Whether global layer ``layer_id`` routes its tokens to experts (its MLP is an MoE MLP)."""
        return layer_id >= self.first_dense_layers and (layer_id - self.first_dense_layers) % self.layer_freq == 0

    def layer_ids(self, num_layers: int) -> tuple[int, ...]:
        """The global ids of the MoE layers of a model of ``num_layers`` layers, in order."""
        return tuple(layer for layer in range(num_layers) if self.is_moe_layer(layer))

    @property
    def shared_ffn_hidden_size(self) -> int:
        """Width of the shared experts' MLP (0 without shared experts)."""
        return self.shared_experts * self.expert_ffn_hidden_size

    def capacity(self, tokens: int) -> int | None:
        """How many of a microbatch's ``tokens`` one expert takes at most; None when dropless."""
        if self.capacity_factor is None:
            return None
        return math.ceil(self.capacity_factor * tokens * self.topk / self.num_experts)


def moe_shape_of(model) -> MoEShape | None:
    """The ``MoEShape`` of a ``ModelConfig`` (``model.moe``), None for a dense model (``num_experts=0``)."""
    moe = model.moe
    if moe.num_experts == 0:
        return None
    return MoEShape(num_experts=moe.num_experts, topk=moe.topk,
                    expert_ffn_hidden_size=moe.expert_ffn_hidden_size or model.ffn_hidden_size,
                    layer_freq=moe.layer_freq, first_dense_layers=moe.first_dense_layers,
                    shared_experts=moe.shared_experts, shared_expert_gate=moe.shared_expert_gate,
                    router_score=moe.router_score,
                    router_topk_norm=moe.router_topk_norm, aux_loss_coeff=moe.aux_loss_coeff,
                    z_loss_coeff=moe.z_loss_coeff, expert_bias=moe.expert_bias,
                    expert_bias_update_rate=moe.expert_bias_update_rate, capacity_factor=moe.capacity_factor,
                    drop_policy=moe.drop_policy)
