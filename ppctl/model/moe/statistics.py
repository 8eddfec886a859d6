"""A step's routing statistics of every MoE layer, and the expert-bias update that follows them.

Each MoE layer records, in the backward of each trained microbatch, the tokens that chose each expert and its
balancing and z losses (``ppctl.model.moe.layer``). After a step a rank writes what its layers recorded into one
table with a row per MoE layer of the model (``routing_table``: the tokens per expert, the two loss sums, the
microbatches); the trainer sums the tables of every rank (one all-reduce of a few numbers per layer: the data-
parallel replicas and DualPipe's two copies each trained other microbatches, so the sum is the global batch's; the
ranks of a ``TokenSplit`` each record their tokens' share of a microbatch, and the first of them counts it), and
the single process takes its own. From the summed table every rank reads the same statistics
(``routing_statistics``) and moves the expert bias of the layers it holds by the same amount
(``update_expert_biases``), so every copy of a layer keeps one bias.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import torch
from torch import nn

from ppctl.model.moe.layer import moe_mlps

LOSS_COLUMNS = 3  # after the experts' columns: the balancing-loss sum, the z-loss sum, the microbatches


@dataclass(frozen=True)
class LayerRouting:
    """One MoE layer's step: the tokens each expert was chosen by over the global batch, and the mean balancing and
    z losses of its microbatches (unweighted by their coefficients)."""

    layer: int
    load: tuple[int, ...]
    balancing: float
    z: float

    @property
    def imbalance(self) -> float:
        """The busiest expert's tokens over the mean (1 for a perfectly even router)."""
        mean = sum(self.load) / len(self.load)
        return max(self.load) / mean if mean else 0.0


@dataclass(frozen=True)
class RoutingStatistics:
    """Every MoE layer's ``LayerRouting`` of one step, in layer order."""

    layers: tuple[LayerRouting, ...]

    @property
    def balancing(self) -> float:
        """The layers' balancing losses summed."""
        return sum(layer.balancing for layer in self.layers)

    @property
    def z(self) -> float:
        """The layers' z losses summed."""
        return sum(layer.z for layer in self.layers)

    @property
    def imbalance(self) -> float:
        """The worst layer's load imbalance."""
        return max(layer.imbalance for layer in self.layers)

    def load_of(self, layer: int) -> tuple[int, ...]:
        """Layer ``layer``'s tokens per expert."""
        return next(routing.load for routing in self.layers if routing.layer == layer)


def routing_table(chunks: Iterable[nn.Module], layer_ids: Sequence[int], num_experts: int, device) -> torch.Tensor:
    """``[len(layer_ids), num_experts + 3]`` float64: this rank's records of the step (taken: the layers start new
    ones), a row per MoE layer of the model, zero where it holds none."""
    table = torch.zeros(len(layer_ids), num_experts + LOSS_COLUMNS, dtype=torch.float64, device=device)
    rows = {layer: row for row, layer in enumerate(layer_ids)}
    for chunk in chunks:
        for layer, mlp in moe_mlps(chunk).items():
            record = mlp.take_record()
            if record.load is not None:
                row = table[rows[layer]]
                row[:num_experts] += record.load.to(device, torch.float64)
                row[num_experts:num_experts + 2] += torch.stack([record.balancing, record.z]).to(device)
                row[-1] += record.microbatches
    return table


def routing_statistics(table: torch.Tensor, layer_ids: Sequence[int]) -> RoutingStatistics:
    """The statistics of a summed ``routing_table``."""
    num_experts = table.shape[1] - LOSS_COLUMNS
    layers = []
    for layer, row in zip(layer_ids, table.cpu().tolist()):
        microbatches = max(row[num_experts + 2], 1.0)
        layers.append(LayerRouting(layer=layer, load=tuple(int(count) for count in row[:num_experts]),
                                   balancing=row[num_experts] / microbatches, z=row[num_experts + 1] / microbatches))
    return RoutingStatistics(tuple(layers))


def update_expert_biases(chunks: Iterable[nn.Module], statistics: RoutingStatistics) -> None:
    """Move the expert bias of every MoE layer of ``chunks`` that has one by its step's load."""
    for chunk in chunks:
        for layer, mlp in moe_mlps(chunk).items():
            if mlp.router.expert_bias is not None:
                load = torch.tensor(statistics.load_of(layer), device=mlp.router.expert_bias.device)
                mlp.router.update_expert_bias(load)
