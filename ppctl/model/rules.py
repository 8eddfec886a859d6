"""How each parameter is split across TP ranks and initialised: a rule that travels with the parameter.

A family names its parameters by global, layout-independent names (``embedding.word.weight``,
``layers.<global id>.attention.qkv.weight``, ...) and gives each role a ``ParameterRule``; a chunk
attaches the rule to each of its parameters when it is built (``attach_rules``), and everything that
splits, gathers, counts or initialises a parameter reads the rule from the parameter (``rule_of``) or,
where it holds a name only (a checkpoint's), from the family. The dense (tp=1) value of a parameter
is generated from a generator seeded by ``(seed, name)``, and each TP rank keeps its slice, so every
layout starts from exactly the model one process builds. Vocabulary rows beyond the vocabulary (TP
padding) start at zero and never enter the math.
"""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass, replace

import torch

from ppctl.parallel.expert_parallel import EPGroup
from ppctl.parallel.tensor_parallel import TPGroup

REPLICATED = "replicated"   # every TP rank holds the whole tensor (and the same gradient)
ROWS = "rows"               # split along dim 0 in contiguous ranges (column-parallel, vocabulary)
COLUMNS = "columns"         # split along dim 1 in contiguous ranges (row-parallel weights)
QKV_ROWS = "qkv_rows"       # dim 0 is [q; k; v] of equal sizes: each rank keeps its heads' rows of each part
RULE_ATTRIBUTE = "ppctl_rule"


@dataclass(frozen=True)
class ParameterRule:
    """How one kind of parameter is split across TP ranks and initialised.

    ``init`` is one of ``normal`` (N(0, init_std)), ``scaled_normal`` (N(0, init_std / sqrt(2 *
    num_layers)), for projections into the residual stream), ``qkv_normal`` (q, k, v generated
    separately), ``ones`` or ``zeros``. ``tied_to``: the parameter it is a copy of (a tied output layer
    is the word embedding): it starts equal to it and is saved under its name. ``embedding``: a lookup or
    output table (no weight decay unless ``optimizer.decay_embeddings``). ``experts``: dim 0 is a mixture's
    expert dimension (``ppctl.model.moe``): expert parallelism splits it over the EP ranks and reduces its
    gradient over the expert-data-parallel group (``expert_replica``); at ep=1 every rank holds every expert and
    the gradient reduces over data parallelism like a dense weight's. ``tp_partial``: a TP-replicated scale every
    attention head applies (a per-head q/k norm's): each TP rank's gradient is its own heads' share, so it is summed
    over TP at every layout, not only under sequence parallelism.
    """

    split: str
    init: str
    vocab_rows: bool = False  # dim 0 is the (padded) vocabulary
    tied_to: str | None = None
    embedding: bool = False
    experts: bool = False
    tp_partial: bool = False

    @property
    def tp_replicated(self) -> bool:
        """Every TP rank holds the whole parameter: count it once in a global norm, reduce it over TP under SP."""
        return self.split == REPLICATED

    def summed_over_tp(self, sequence_parallel: bool) -> bool:
        """Whether each TP rank's gradient is a share to sum over TP: a replicated parameter's under SP (its rank's
        tokens), a ``tp_partial`` one's always (its rank's heads)."""
        return self.tp_replicated and (sequence_parallel or self.tp_partial)


_LAYER_PREFIX = re.compile(r"^layers\.\d+\.")
TIED_OUTPUT, WORD_EMBEDDING = "output_layer.weight", "embedding.word.weight"


def rule_by_role(rules, family: str, name: str, tie_embeddings: bool) -> ParameterRule:
    """The rule ``rules`` (role -> rule) gives a global parameter ``name`` of ``family`` (its ``layers.<id>.``
    prefix ignored); a tied output layer is a copy of the word embedding. ``KeyError`` for an unknown role."""
    role = _LAYER_PREFIX.sub("", name)
    if role not in rules:
        raise KeyError(f"unknown {family} parameter name {name!r}; known roles: {sorted(rules)}")
    rule = rules[role]
    return replace(rule, tied_to=WORD_EMBEDDING) if role == TIED_OUTPUT and tie_embeddings else rule


def attach_rules(module: torch.nn.Module, rule_for) -> None:
    """Attach ``rule_for(global name)`` to each parameter of ``module`` (its names are the global ones)."""
    for name, param in module.named_parameters():
        setattr(param, RULE_ATTRIBUTE, rule_for(name))


def rule_of(param: torch.Tensor) -> ParameterRule:
    """The rule a chunk attached to ``param``."""
    rule = getattr(param, RULE_ATTRIBUTE, None)
    if rule is None:
        raise KeyError("a parameter without a sharding rule: its chunk did not attach_rules")
    return rule


def stable_seed(seed: int, name: str) -> int:
    """A 63-bit generator seed from ``(seed, name)`` that is the same in every process and run."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def normal_tensor(shape: tuple[int, ...], std: float, seed: int, name: str) -> torch.Tensor:
    """A float32 CPU tensor drawn from N(0, std) by the generator of ``(seed, name)``."""
    generator = torch.Generator().manual_seed(stable_seed(seed, name))
    return torch.randn(shape, generator=generator, dtype=torch.float32) * std


def dense_shape(rule: ParameterRule, local_shape: torch.Size, tp: TPGroup,
                ep: EPGroup = EPGroup.single()) -> tuple[int, ...]:
    """The tp=1 (and ep=1) shape of a parameter whose local shard on a TP (and EP) rank has ``local_shape``."""
    shape = list(local_shape)
    if rule.experts:
        shape[0] *= ep.size
    if rule.split in (ROWS, QKV_ROWS):
        shape[0] *= tp.size
    elif rule.split == COLUMNS:
        shape[1] *= tp.size
    return tuple(shape)


def dense_to_tp_shard(rule: ParameterRule, dense: torch.Tensor, tp: TPGroup,
                      ep: EPGroup = EPGroup.single()) -> torch.Tensor:
    """This TP rank's slice of the dense (tp=1) tensor of a parameter (or of its gradient); of an expert
    parameter, the experts EP rank ``ep.rank`` holds (experts are not split by TP)."""
    if rule.experts and ep.size > 1:
        experts = ep.local_experts(dense.shape[0])
        return dense[experts.start:experts.stop]
    if rule.split == ROWS:
        return tp.shard(dense, dim=0)
    if rule.split == COLUMNS:
        return tp.shard(dense, dim=1)
    if rule.split == QKV_ROWS:
        # [3 * rows, ...] -> [3, tp, rows / tp, ...]: keep this rank's heads of q, k and v.
        return dense.unflatten(0, (3, tp.size, -1))[:, tp.rank].flatten(0, 1)
    return dense


def dense_parameter(name: str, rule: ParameterRule, shape: tuple[int, ...], seed: int, model) -> torch.Tensor:
    """Generate the dense float32 value of parameter ``name`` (the same in every layout).

    ``model`` is the family's shape (``init_std``, ``num_layers``, ``vocab_size``). Vocabulary rows
    beyond ``model.vocab_size`` are zero, and the real rows do not depend on how many padded rows follow.
    """
    if rule.vocab_rows and shape[0] > model.vocab_size:
        real = dense_parameter(name, rule, (model.vocab_size, *shape[1:]), seed, model)
        return torch.cat([real, real.new_zeros((shape[0] - model.vocab_size, *shape[1:]))])
    if rule.init == "ones":
        return torch.ones(shape)
    if rule.init == "zeros":
        return torch.zeros(shape)
    if rule.init == "scaled_normal":
        return normal_tensor(shape, model.init_std / math.sqrt(2 * model.num_layers), seed, name)
    if rule.init == "qkv_normal":
        part_shape = (shape[0] // 3, *shape[1:])
        parts = [normal_tensor(part_shape, model.init_std, seed, name.replace(".qkv.", f".{part}."))
                 for part in ("query", "key", "value")]
        return torch.cat(parts, dim=0)
    return normal_tensor(shape, model.init_std, seed, rule.tied_to or name)


@torch.no_grad()
def initialise(module: torch.nn.Module, seed: int, model, tp: TPGroup, ep: EPGroup = EPGroup.single()) -> None:
    """Fill every parameter of ``module`` with this rank's slice (TP; EP's experts) of its layout-independent
    dense value."""
    for name, param in module.named_parameters():
        rule = rule_of(param)
        dense = dense_parameter(name, rule, dense_shape(rule, param.shape, tp, ep), seed, model)
        param.copy_(dense_to_tp_shard(rule, dense, tp, ep))
