"""Tokens sorted by expert and put back: the permutation around the experts, and the capacity drop.

A microbatch of T tokens routed to ``topk`` experts each makes T * topk assignments, numbered token-major
(``token * topk + slot``). The dispatch keeps the assignments the capacity allows and lists them sorted by expert
(a stable sort: within an expert, in assignment order), so that each expert's tokens are one contiguous block of
the routed rows. The combine reads each assignment's expert output back (a gather: a dropped assignment reads a row
of zeros) and sums each token's outputs weighted by its routing weights. Both are gathers, whose backward keeps
only their indices and adds each row's gradient where it came from, deterministic on every device.

Capacity (``model.moe.capacity_factor``): an expert takes at most ``capacity`` of the microbatch's assignments;
``drop_policy=probs`` keeps those of the highest routing weight (ties: the earlier assignment), ``position`` the
earliest. A dropped assignment contributes nothing to its token's output (the other experts' weights are not
renormalised), as in Megatron-Core's token dropping.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Dispatch:
    """Which assignments reach the experts: ``order [N]`` (int64, assignment ids sorted by expert), ``counts`` (the
    rows of each expert, in expert order), ``kept [T * topk]`` (bool) and ``source [T * topk]`` (int64: each
    assignment's routed row, ``N`` for a dropped one)."""

    order: torch.Tensor
    counts: tuple[int, ...]
    kept: torch.Tensor
    source: torch.Tensor


def plan_dispatch(experts: torch.Tensor, weights: torch.Tensor, num_experts: int, capacity: int | None,
                  drop_policy: str = "probs") -> Dispatch:
    """The ``Dispatch`` of one microbatch's routing (``experts`` and ``weights``, ``[T, topk]``); ``capacity``: the
    most assignments one expert takes (None: dropless)."""
    chosen = experts.flatten()
    kept = torch.ones_like(chosen, dtype=torch.bool)
    if capacity is not None:
        kept = ranks_within_experts(chosen, _priority(weights.flatten(), drop_policy), num_experts) < capacity
    assignments = torch.nonzero(kept).flatten()
    order = assignments[torch.argsort(chosen[assignments], stable=True)]
    counts = torch.bincount(chosen[assignments], minlength=num_experts)
    source = torch.full_like(chosen, order.numel())
    source[order] = torch.arange(order.numel(), device=chosen.device)
    return Dispatch(order=order, counts=tuple(counts.tolist()), kept=kept, source=source)


def _priority(weights: torch.Tensor, drop_policy: str) -> torch.Tensor:
    """The assignments from the first an expert keeps to the last: by routing weight, or in microbatch order."""
    if drop_policy == "position":
        return torch.arange(weights.numel(), device=weights.device)
    return torch.argsort(weights.detach(), descending=True, stable=True)


def ranks_within_experts(chosen: torch.Tensor, priority: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Each assignment's place among its expert's assignments (0 first), ``priority`` listing them first to last."""
    by_expert = priority[torch.argsort(chosen[priority], stable=True)]
    counts = torch.bincount(chosen, minlength=num_experts)
    starts = torch.cumsum(counts, dim=0) - counts
    ranks = torch.empty_like(chosen)
    ranks[by_expert] = torch.arange(chosen.numel(), device=chosen.device) - starts[chosen[by_expert]]
    return ranks


def permute(tokens: torch.Tensor, dispatch: Dispatch, topk: int) -> torch.Tensor:
    """The routed rows ``[N, hidden]``: each kept assignment's token, sorted by expert."""
    assignments = tokens.unsqueeze(1).expand(-1, topk, -1).reshape(-1, tokens.shape[-1])
    return assignments[dispatch.order]


def unpermute_and_combine(expert_rows: torch.Tensor, dispatch: Dispatch, weights: torch.Tensor) -> torch.Tensor:
    """Each token's experts' outputs weighted by ``weights [T, topk]`` and summed, ``[T, hidden]`` (dropped
    assignments add nothing)."""
    tokens, topk = weights.shape
    padded = torch.cat([expert_rows, expert_rows.new_zeros(1, expert_rows.shape[-1])])
    placed = padded[dispatch.source]
    weighted = placed.view(tokens, topk, -1) * weights.to(expert_rows.dtype).unsqueeze(-1)
    return weighted.sum(dim=1)
