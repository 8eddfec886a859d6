"""The MoE MLP: router, dispatch, experts, combine, shared experts; its router losses join the backward here.

``MoEMLP`` replaces a layer's dense MLP: each token goes to its top-k experts (``ppctl.model.moe.router``), the
tokens are sorted by expert and dropped past the capacity (``dispatch``), each expert's MLP runs on its block,
the outputs come back weighted by the routing weights, and the shared experts' MLP (a family's dense MLP) is
added for every token, scaled by its sigmoid gate where the mixture has one (``shared_expert_gate``, Qwen2-MoE).
With expert parallelism this rank holds only its EP rank's experts: the sorted rows travel to their experts' ranks
and back (``ppctl.parallel.expert_parallel``) around the experts; routing, the capacity drop and the router losses
stay with the tokens' own rank, as one process computes them.

The objective of a step with M = global_batch_size / micro_batch_size microbatches (the same M at every layout
with the same micro_batch_size) is the mean token loss plus, for each MoE layer and each microbatch m,
``(aux_loss_coeff * balancing_m + z_loss_coeff * z_m) / M``: the router losses of a microbatch are its own
(its routing statistics), and their sum over the global batch is weighted like the token loss's, whatever the
pipeline, data-parallel or virtual-stage layout. They reach the backward without travelling with the pipeline's
messages: the layer's output passes through an identity (``_RouterLossesToBackward``) whose backward also hands
the router losses the gradient ``router_loss_scale`` (the trainer sets ``loss_scale / M`` each step with
``set_router_loss_scale``, fp16's loss scale included, as the token loss is scaled), on whichever stage the layer
is. That backward also records the microbatch's routing statistics (tokens per expert, both losses) once per
trained microbatch: an evaluation runs without a graph and records nothing, and a recomputed forward's copy of the
identity never runs backward.
"""

from __future__ import annotations

import torch
from torch import nn

from ppctl.autograd.compiled import outside_graph
from ppctl.autograd.weight_grad import DefersWeightGrads, linear
from ppctl.model.moe.dispatch import Dispatch, permute, plan_dispatch, unpermute_and_combine
from ppctl.model.moe.router import Router, Routing, balancing_loss, z_loss
from ppctl.model.moe.shape import MoEShape
from ppctl.parallel.expert_parallel import EPGroup, ExpertExchange, TokenSplit


class RoutingRecord:
    """One layer's routing statistics over the microbatches trained since the last ``take``: the tokens that chose
    each expert, the sums of the balancing and z losses, and how many microbatches."""

    def __init__(self):
        self.load: torch.Tensor | None = None
        self.balancing: torch.Tensor | None = None
        self.z: torch.Tensor | None = None
        self.microbatches = 0

    def add(self, load: torch.Tensor, balancing: torch.Tensor, z: torch.Tensor, microbatches: int = 1) -> None:
        """Add one microbatch's statistics (this rank's share of them), counting ``microbatches`` (0 or 1)."""
        if self.load is None:
            self.load, self.balancing, self.z = torch.zeros_like(load), torch.zeros_like(balancing), torch.zeros_like(z)
        self.load += load
        self.balancing += balancing
        self.z += z
        self.microbatches += microbatches


class _RouterLossesToBackward(torch.autograd.Function):
    """Identity on the layer's output; its backward gives the router losses the gradient ``scale`` and records the
    microbatch's statistics in ``record``."""

    @staticmethod
    def forward(ctx, output, losses, scale, record, load, balancing, z, microbatches):
        ctx.scale, ctx.record, ctx.statistics = scale, record, (load, balancing, z, microbatches)
        ctx.loss_like = (losses.shape, losses.dtype, losses.device)
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad_output):
        ctx.record.add(*ctx.statistics)
        shape, dtype, device = ctx.loss_like
        grad_losses = torch.full(shape, ctx.scale, dtype=dtype, device=device) if ctx.needs_input_grad[1] else None
        return grad_output, grad_losses, None, None, None, None, None, None


class SharedExpertGate(DefersWeightGrads, nn.Module):
    """Each token's weight of the shared experts' output, ``sigmoid(w . x)`` in the model's dtype (``weight [1,
    hidden]``, Qwen2-MoE's ``shared_expert_gate``, deferred to a pipeline W like any linear's)."""

    def __init__(self, hidden_size: int, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(1, hidden_size, dtype=dtype))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[..., 1]`` gate values of ``hidden [..., hidden]``."""
        return torch.sigmoid(linear(hidden, self.weight, None, self.weight_grad_store))


class RoutingPlans:
    """How a microbatch's routed rows are planned from its routing: ``dispatch`` (``plan_dispatch``: the order and
    the rows per expert) and ``exchange`` (``ExpertExchange.plan``: the rows to and from each EP rank). A rank in
    fake tensors, whose routing has no values, plans balanced rows instead (``ppctl.run.fake_rank``)."""

    @staticmethod
    def dispatch(experts: torch.Tensor, weights: torch.Tensor, num_experts: int, capacity: int | None,
                 drop_policy: str) -> Dispatch:
        """``plan_dispatch``'s plan."""
        return plan_dispatch(experts, weights, num_experts, capacity, drop_policy)

    @staticmethod
    def exchange(counts: tuple[int, ...], group: EPGroup, device) -> ExpertExchange:
        """``ExpertExchange.plan``'s plan."""
        return ExpertExchange.plan(counts, group, device)


class MoEMLP(nn.Module):
    """A layer's MLP as routed experts (module docstring).

    ``experts``: the family's stacked experts (``ppctl.model.moe.experts``) of this rank's share of ``ep``'s,
    called as ``(rows, counts)``; ``shared_experts``: the family's dense MLP of ``shape.shared_ffn_hidden_size``
    features, or None, gated per token with ``shape.shared_expert_gate``; ``ep``: the expert-parallel group
    (default: one rank, every expert here); ``token_split``: the ranks that hold each microbatch's tokens between
    them (``ppctl.parallel.expert_parallel.TokenSplit``; default: this one alone).
    """

    def __init__(self, hidden_size: int, shape: MoEShape, experts: nn.Module, shared_experts: nn.Module | None,
                 dtype: torch.dtype, ep: EPGroup = EPGroup.single(), token_split: TokenSplit = TokenSplit()):
        super().__init__()
        self.shape, self.ep, self.token_split = shape, ep, token_split
        self.router = Router(hidden_size, shape, dtype)
        self.experts = experts
        self.shared_experts = shared_experts
        # Registered only when used, so that an ungated mixture keeps its parameters (and their order).
        self.shared_expert_gate = None
        if shape.shared_expert_gate and shared_experts is not None:
            self.shared_expert_gate = SharedExpertGate(hidden_size, dtype)
        self.router_loss_scale = 1.0  # a plain backward of one microbatch's mean loss: the router losses as they are
        self.record = RoutingRecord()
        self.plans = RoutingPlans()

    @outside_graph  # data-dependent counts and the expert exchange: eager between compiled graphs (trainer.compile)
    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Route and run ``hidden [batch, seq, hidden]`` (one microbatch: its tokens are the routing statistics')."""
        tokens = hidden.reshape(-1, hidden.shape[-1])
        routing = self.router(tokens)
        dispatch = self.plans.dispatch(routing.experts, routing.weights, self.shape.num_experts,
                                       self.shape.capacity(tokens.shape[0]), self.shape.drop_policy)
        rows = self._run_experts(permute(tokens, dispatch, self.shape.topk), dispatch.counts)
        output = unpermute_and_combine(rows, dispatch, routing.weights)
        if self.shared_experts is not None:
            output = output + self._shared_output(hidden).reshape(output.shape)
        output = output.view_as(hidden)
        if torch.is_grad_enabled() and output.requires_grad:
            output = self._with_router_losses(output, routing)
        return output

    def _shared_output(self, hidden: torch.Tensor) -> torch.Tensor:
        """The shared experts' output for ``hidden``, scaled by its gate when the mixture has one."""
        shared = self.shared_experts(hidden)
        return shared if self.shared_expert_gate is None else self.shared_expert_gate(hidden) * shared

    def _run_experts(self, rows: torch.Tensor, counts: tuple[int, ...]) -> torch.Tensor:
        """Rows sorted by expert (``counts[e]`` for expert e) through their experts, here or on their EP ranks."""
        if self.ep.size == 1:
            return self.experts(rows, counts)
        exchange = self.plans.exchange(counts, self.ep, rows.device)
        return exchange.combine(self.experts(exchange.dispatch(rows), exchange.local_counts))

    def _with_router_losses(self, output: torch.Tensor, routing: Routing) -> torch.Tensor:
        """``output`` through the identity that adds the router losses' gradient and records the statistics.

        With the microbatch's tokens split over ranks (``token_split``), the losses are this rank's part of the
        microbatch's (``ppctl.model.moe.router``), from the load summed over the split; the first rank of the split
        counts the microbatch."""
        shape, split = self.shape, self.token_split
        load = routing.load(shape.num_experts)
        tokens = routing.experts.shape[0] * split.size  # every rank of the split holds an equal share
        balancing, z = balancing_loss(routing, split.total(load), tokens), z_loss(routing, tokens)
        losses = shape.aux_loss_coeff * balancing + shape.z_loss_coeff * z
        if not (shape.aux_loss_coeff or shape.z_loss_coeff):
            losses = losses.detach()  # no gradient to add: the backward computes none
        statistics = (load, balancing.detach().double(), z.detach().double(), int(split.rank == 0))
        return _RouterLossesToBackward.apply(output, losses, self.router_loss_scale, self.record, *statistics)

    def take_record(self) -> RoutingRecord:
        """The statistics recorded since the last call, starting a new record."""
        record, self.record = self.record, RoutingRecord()
        return record


def moe_mlps(chunk: nn.Module) -> dict[int, MoEMLP]:
    """A chunk's MoE MLPs by global layer id (its ``layers``, keyed by id, each with an ``mlp``)."""
    layers = getattr(chunk, "layers", {})
    return {int(layer_id): layer.mlp for layer_id, layer in layers.items() if isinstance(layer.mlp, MoEMLP)}


def set_router_loss_scale(chunk: nn.Module, scale: float) -> None:
    """The gradient every MoE layer of ``chunk`` gives its router losses in the backward (the layer docstring)."""
    for mlp in moe_mlps(chunk).values():
        mlp.router_loss_scale = scale
