"""The router: each token's scores over the experts, its top-k experts and the weights of their outputs.

The logits are a linear map of the token (no bias) in the model's dtype; scores, weights and losses are computed
in float32 or wider (float64 for a float64 model):

- ``softmax`` scores: a distribution over the experts (Mixtral, Switch); ``sigmoid``: each expert's own score in
  (0, 1) (DeepSeek-V3).
- The top-k experts are those of the highest ``score + expert_bias``: the bias (aux-loss-free balancing) moves
  the choice only; the weights are the chosen experts' unbiased scores, divided by their sum with
  ``router_topk_norm``.
- The load-balancing loss of one microbatch of T tokens (Switch/GShard, with Megatron-Core's top-k count):
  ``num_experts * sum_i f_i * P_i``, ``f_i`` the fraction of the T * topk choices that picked expert i (counted
  before any capacity drop; no gradient), ``P_i`` the mean over the tokens of expert i's probability (the softmax
  score, or the sigmoid scores divided by their sum over the experts, as DeepSeek-V3's sequence-wise loss). It is 1
  for a perfectly even router.
- The z-loss (ST-MoE): the mean over the tokens of ``logsumexp(logits)^2``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ppctl.autograd.weight_grad import DefersWeightGrads, linear
from ppctl.model.moe.shape import MoEShape


@dataclass
class Routing:
    """One microbatch's routing of T tokens: ``experts [T, topk]`` (int64), ``weights [T, topk]`` (wide float),
    ``probs [T, E]`` (each token's distribution over the experts, for the balancing loss) and ``logits [T, E]``
    (wide float)."""

    experts: torch.Tensor
    weights: torch.Tensor
    probs: torch.Tensor
    logits: torch.Tensor

    def load(self, num_experts: int) -> torch.Tensor:
        """How many of the tokens chose each expert, ``[E]`` int64 (before any capacity drop)."""
        return torch.bincount(self.experts.flatten(), minlength=num_experts)


def wide_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the router computes in: float32, or float64 for a float64 model."""
    return torch.promote_types(dtype, torch.float32)


def route(logits: torch.Tensor, shape: MoEShape, expert_bias: torch.Tensor | None = None) -> Routing:
    """Score ``logits [T, E]`` (wide float) and pick each token's top-k experts (module docstring)."""
    if shape.router_score == "softmax":
        scores = torch.softmax(logits, dim=-1)
        probs = scores
    else:
        scores = torch.sigmoid(logits)
        probs = scores / scores.sum(dim=-1, keepdim=True)
    choice = scores.detach() if expert_bias is None else scores.detach() + expert_bias
    experts = torch.topk(choice, shape.topk, dim=-1).indices
    weights = scores.gather(-1, experts)
    if shape.router_topk_norm:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return Routing(experts=experts, weights=weights, probs=probs, logits=logits)


def balancing_loss(routing: Routing, load: torch.Tensor, tokens: int | None = None) -> torch.Tensor:
    """``num_experts * sum_i f_i * P_i`` of one microbatch (module docstring), a scalar differentiable in ``P``.

    ``load``: the microbatch's ``Routing.load``, ``tokens``: its token count (default: ``routing``'s own). When
    ``routing`` holds only this rank's share of a microbatch split over ranks (``load`` and ``tokens`` then the
    whole microbatch's), the result is this share's part of the loss: the parts sum to the whole microbatch's loss,
    and each part's gradient is the loss's gradient with respect to this rank's tokens."""
    tokens = routing.experts.shape[0] if tokens is None else tokens
    fractions = load.to(routing.probs.dtype) / (tokens * routing.experts.shape[1])
    return load.numel() * (fractions * routing.probs.sum(dim=0)).sum() / tokens


def z_loss(routing: Routing, tokens: int | None = None) -> torch.Tensor:
    """The mean over the tokens of ``logsumexp(logits)^2``; with ``tokens``, the microbatch's count when ``routing``
    holds one share of it, this share's part of that mean (``balancing_loss``)."""
    tokens = routing.logits.shape[0] if tokens is None else tokens
    return torch.logsumexp(routing.logits, dim=-1).square().sum() / tokens


class Router(DefersWeightGrads, nn.Module):
    """The router's linear map to the experts' logits (``weight [E, hidden]``, deferred to a pipeline W like any
    linear's), and with ``expert_bias`` the per-expert bias buffer (wide float, saved in checkpoints, changed only
    by ``update_expert_bias``)."""

    def __init__(self, hidden_size: int, shape: MoEShape, dtype: torch.dtype):
        super().__init__()
        self.shape = shape
        self.weight = nn.Parameter(torch.empty(shape.num_experts, hidden_size, dtype=dtype))
        if shape.expert_bias:
            self.register_buffer("expert_bias", torch.zeros(shape.num_experts, dtype=wide_dtype(dtype)))
        else:
            self.expert_bias = None

    def forward(self, tokens: torch.Tensor) -> Routing:
        """Route ``tokens [T, hidden]``."""
        logits = linear(tokens, self.weight, None, self.weight_grad_store).to(wide_dtype(tokens.dtype))
        return route(logits, self.shape, self.expert_bias)

    @torch.no_grad()
    def update_expert_bias(self, load: torch.Tensor) -> None:
        """Move the bias by ``expert_bias_update_rate * sign(mean load - load)`` (``load [E]``: a step's tokens per
        expert, the same on every rank that holds the layer)."""
        load = load.to(self.expert_bias.dtype)
        self.expert_bias += self.shape.expert_bias_update_rate * torch.sign(load.mean() - load)
