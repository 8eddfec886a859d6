"""``parallel.balance=auto``: the split of the layers into pipeline stages that evens out the ranks' work (pure).

The work of a microbatch through each part of the model, counted as ``ppctl.model.flops``
counts it (forward FLOPs per token; the backward is twice the forward everywhere, so it
changes no choice):

- a transformer layer: its projections, MLP and attention products;
- the output layer with the loss: ``2 * hidden * padded vocabulary`` plus the softmax
  cross-entropy's few operations per class;
- the embedding: a lookup, so no multiply-adds, but counted at ``hidden`` per token so
  that of two otherwise equal stages the one holding the embedding gets the fewer layers.

A pp rank's time is the sum of the costs of every global stage the schedule places on it
(looped and interleaved, the V, Hanayo's waves, DualPipe's two model copies), and the split
minimises the slowest rank's. ``balanced_counts`` assigns the layers one at a time, each to
the model stage whose ranks end up least loaded (ties: the stage with fewer layers, then
the lower index). Where the ranks that run a model stage hold the same stages (one rank per
stage with one copy; DualPipe's mirror pairs r and pp-1-r), a layer adds a fixed step to one
group of ranks, so the layers taken in that order give the smallest possible loads: the
slowest rank is the optimum (the unit tests check it against every split for small sizes).
A custom file's placement that shares stages otherwise gets a good split, not a proven best.

With ``parallel.balance_memory_gb`` the split must also fit: a rank the memory model
(``ppctl.plan.memory``) puts over the limit is capped at one layer fewer than it holds and
the layers are assigned again, until every rank fits or none can. A config's split is chosen
once, where it is resolved (``ppctl.resolve.resolved``), which asks the memory model.
"""

from __future__ import annotations

import collections
import functools
from dataclasses import dataclass, replace
from typing import Callable, Optional, Sequence

from ppctl.config.schema import ConfigError
from ppctl.model.flops import forward_flops_per_token
from ppctl.parallel.placement import Placement

SOFTMAX_FLOPS_PER_CLASS = 5  # the loss's softmax per logit: max, subtract, exp, sum, and the log-sum-exp's share
GIB = 2**30


@dataclass(frozen=True)
class PartCosts:
    """Forward FLOPs per token of each part of the model (any common scale serves: only ratios decide the split)."""

    layer: int
    embedding: int
    loss: int


def part_costs(hidden_size: int, ffn_hidden_size: int, seq_length: int, padded_vocab_size: int,
               attention_width: int | None = None, kv_width: int | None = None, gated_mlp: bool = False) -> PartCosts:
    """The costs of a transformer layer, the embedding and the output layer with the loss (module docstring)."""
    layer = forward_flops_per_token(1, hidden_size, ffn_hidden_size, seq_length, 0, attention_width, kv_width,
                                    gated_mlp)
    output = forward_flops_per_token(0, hidden_size, ffn_hidden_size, seq_length, padded_vocab_size)
    return PartCosts(layer=int(layer), embedding=hidden_size,
                     loss=int(output) + SOFTMAX_FLOPS_PER_CLASS * padded_vocab_size)


def stage_costs(costs: PartCosts, counts: Sequence[int]) -> list[int]:
    """The cost of each model stage holding ``counts[stage]`` layers (the first with the embedding, the last the
    loss)."""
    result = [count * costs.layer for count in counts]
    result[0] += costs.embedding
    result[-1] += costs.loss
    return result


def rank_loads(placement: Placement, costs: PartCosts, counts: Sequence[int]) -> list[int]:
    """Each pp rank's cost: the sum of the costs of every global stage the placement puts on it."""
    per_stage = stage_costs(costs, counts)
    loads = [0] * (max(placement.owners) + 1)
    for stage, pp_rank in enumerate(placement):
        loads[pp_rank] += per_stage[placement.model_stage(stage)]
    return loads


def layers_held(placement: Placement, counts: Sequence[int]) -> list[int]:
    """The transformer layers each pp rank holds: those of every global stage on it (DualPipe: of both copies)."""
    held = [0] * (max(placement.owners) + 1)
    for stage, pp_rank in enumerate(placement):
        held[pp_rank] += counts[placement.model_stage(stage)]
    return held


def _ranks_of_stages(placement: Placement) -> list[dict[int, int]]:
    """Model stage -> ``{pp rank: how many of its global stages run that model stage}``."""
    ranks: list[collections.Counter] = [collections.Counter() for _ in range(placement.stages_per_copy)]
    for stage, pp_rank in enumerate(placement):
        ranks[placement.model_stage(stage)][pp_rank] += 1
    return [dict(counter) for counter in ranks]


@functools.lru_cache(maxsize=256)
def balanced_counts(num_layers: int, placement: Placement, costs: PartCosts,
                    caps: Optional[tuple[Optional[int], ...]] = None) -> Optional[tuple[int, ...]]:
    """Layers per model stage minimising the slowest rank's load, each rank holding at most ``caps[pp_rank]``
    layers (None: any); None when the caps leave no room for all ``num_layers``.

    The layers go one at a time to the stage minimising (the largest resulting load among the ranks that run it,
    its layer count, its index).
    """
    ranks_of_stage = _ranks_of_stages(placement)
    loads = rank_loads(placement, costs, [0] * placement.stages_per_copy)
    held = [0] * len(loads)
    counts = [0] * placement.stages_per_copy
    for _ in range(num_layers):
        best = None
        for stage, ranks in enumerate(ranks_of_stage):
            if caps is not None and any(caps[pp_rank] is not None and held[pp_rank] + times > caps[pp_rank]
                                        for pp_rank, times in ranks.items()):
                continue
            key = (max(loads[pp_rank] + times * costs.layer for pp_rank, times in ranks.items()), counts[stage], stage)
            best = key if best is None or key < best else best
        if best is None:
            return None
        stage = best[2]
        counts[stage] += 1
        for pp_rank, times in ranks_of_stage[stage].items():
            loads[pp_rank] += times * costs.layer
            held[pp_rank] += times
    return tuple(counts)


def even_counts(num_layers: int, num_stages: int) -> tuple[int, ...]:
    """The even split's layers per stage (when ``num_stages`` does not divide them, the first stages get one more)."""
    share, extra = divmod(num_layers, num_stages)
    return tuple(share + (stage < extra) for stage in range(num_stages))


def layout_string(counts: Sequence[int]) -> str:
    """The layout string of a split (``parse_pipeline_layout``'s syntax): ``(2, 3, 3, 2)`` -> ``Ett|ttt|ttt|ttL``."""
    return "E" + "|".join("t" * count for count in counts) + "L"


def fitted_counts(num_layers: int, placement: Placement, costs: PartCosts, limit_gb: float,
                  memory_of: Callable[[tuple[int, ...]], Sequence[int]]) -> tuple[int, ...]:
    """The balanced split under which every rank's memory (``memory_of(counts)``: bytes per pp rank) is at most
    ``limit_gb`` GiB: a rank over it is capped at one layer fewer than it holds, and the layers assigned again.

    ``ConfigError`` (one line) when no split fits.
    """
    caps: list[Optional[int]] = [None] * (max(placement.owners) + 1)
    worst = (0, 0, 0)  # (pp rank, bytes, layers held) of the rank furthest over the limit in the last split tried
    while True:
        counts = balanced_counts(num_layers, placement, costs, tuple(caps))
        if counts is None:
            raise ConfigError(_unfit_message(num_layers, placement, limit_gb, memory_of, worst))
        totals, held = memory_of(counts), layers_held(placement, counts)
        over = [pp_rank for pp_rank, total in enumerate(totals) if total > limit_gb * GIB]
        if not over:
            return counts
        worst = max(((pp_rank, totals[pp_rank], held[pp_rank]) for pp_rank in over), key=lambda entry: entry[1])
        if any(held[pp_rank] == 0 for pp_rank in over):
            raise ConfigError(_unfit_message(num_layers, placement, limit_gb, memory_of, worst))
        for pp_rank in over:
            caps[pp_rank] = held[pp_rank] - 1


def _unfit_message(num_layers: int, placement: Placement, limit_gb: float,
                   memory_of: Callable[[tuple[int, ...]], Sequence[int]], worst: tuple[int, int, int]) -> str:
    """The one line refusing a memory limit no split meets: the rank over it even with no transformer layer, else
    the rank furthest over it in the last split tried."""
    floors = memory_of((0,) * placement.stages_per_copy)
    pp_rank = max(range(len(floors)), key=floors.__getitem__)
    if floors[pp_rank] > limit_gb * GIB:
        detail = f"rank {pp_rank} needs {floors[pp_rank] / GIB:.3g} GiB at best, holding no transformer layer"
    else:
        pp_rank, total, held = worst
        detail = (f"rank {pp_rank} needs {total / GIB:.3g} GiB holding {held} layer{'s' * (held != 1)}, and fewer "
                  f"leave too many for the other ranks")
    return (f"parallel.balance=auto: no split of {num_layers} layers over {placement.stages_per_copy} stages fits "
            f"parallel.balance_memory_gb={limit_gb} ({detail})")


# --- from a config ----------------------------------------------------------------------------

def model_part_costs(model, seq_length: int) -> PartCosts:
    """The ``PartCosts`` of a resolved model (``ResolvedConfig.model``) at the training sequence length
    ``seq_length``, with its padded vocabulary; with experts, a layer costs the mean of the model's layers (the
    dense ones and the MoE ones weighed alike)."""
    shape = model.memory_shape
    costs = part_costs(shape.hidden, shape.ffn, seq_length, shape.padded_vocab, shape.attention_width,
                       shape.kv_width, shape.gated_mlp)
    if shape.moe is None:
        return costs
    layers = model.settings.num_layers
    total = forward_flops_per_token(layers, shape.hidden, shape.ffn, seq_length, 0,
                                    shape.attention_width, shape.kv_width, shape.gated_mlp, shape.moe,
                                    len(shape.moe.layer_ids(layers)))
    return replace(costs, layer=int(total / layers))


@dataclass(frozen=True)
class BalanceSummary:
    """The chosen split beside the even one: their layout strings and their slowest rank's training FLOPs per
    microbatch on one device (what ``inspect-layout`` prints)."""

    layout: str
    slowest_flops: float
    even_layout: str
    even_slowest_flops: float


def balance_summary(resolved, chosen: Sequence[int]) -> BalanceSummary:
    """The ``BalanceSummary`` of a ``ResolvedConfig`` with ``parallel.balance=auto`` (its stages placed by its
    layout's placement), whose balancer chose ``chosen`` layers per model stage."""
    config, placement = resolved.config, resolved.layout.placement
    costs = model_part_costs(resolved.model, config.trainer.seq_length)
    parallel, trainer = config.parallel, config.trainer
    # training is three forwards; a device runs its TP share of its CP share of the microbatch's tokens
    scale = 3 * trainer.micro_batch_size * (trainer.seq_length // parallel.cp) / parallel.tp
    even = even_counts(config.model.num_layers, placement.stages_per_copy)
    return BalanceSummary(layout=layout_string(chosen), slowest_flops=scale * max(rank_loads(placement, costs, chosen)),
                          even_layout=layout_string(even),
                          even_slowest_flops=scale * max(rank_loads(placement, costs, even)))
