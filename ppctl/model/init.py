"""Layout-independent initialisation and the TP sharding rule of every GPT parameter.

Each parameter has a global name that does not depend on the layout
(``embedding.word.weight``, ``layers.<global id>.attention.qkv.weight``,
``final_norm.weight``, ``output_layer.weight``, ...). Its dense (tp=1) value is
generated from a generator seeded by a stable hash of ``(seed, name)``; each TP rank
then keeps its slice. So every (tp, pp, vpp, dp, cp) layout starts from exactly the
model a single process would build.

The fused QKV weight is generated as three separately named tensors (``query``,
``key``, ``value``) and sliced by heads, so TP ranks own whole heads of each.
"""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass
from types import MappingProxyType

import torch

from ppctl.parallel.tensor_parallel import TPGroup

REPLICATED = "replicated"   # every TP rank holds the whole tensor (and the same gradient)
ROWS = "rows"               # split along dim 0 in contiguous ranges (column-parallel, vocabulary)
COLUMNS = "columns"         # split along dim 1 in contiguous ranges (row-parallel weights)
QKV_ROWS = "qkv_rows"       # dim 0 is [q; k; v]: each rank keeps its heads' rows of each part


@dataclass(frozen=True)
class ParameterRule:
    """How one kind of parameter is split across TP ranks and initialised.

    ``init`` is one of ``normal`` (N(0, init_std)), ``scaled_normal`` (N(0,
    init_std / sqrt(2 * num_layers)), for projections into the residual stream),
    ``qkv_normal`` (q, k, v generated separately), ``ones`` or ``zeros``.
    """

    split: str
    init: str
    vocab_rows: bool = False  # dim 0 is the (padded) vocabulary


_LAYER_PREFIX = re.compile(r"^layers\.\d+\.")

PARAMETER_RULES = MappingProxyType({
    "embedding.word.weight": ParameterRule(ROWS, "normal", vocab_rows=True),
    "embedding.position.weight": ParameterRule(REPLICATED, "normal"),
    "attn_norm.weight": ParameterRule(REPLICATED, "ones"),
    "attn_norm.bias": ParameterRule(REPLICATED, "zeros"),
    "attention.qkv.weight": ParameterRule(QKV_ROWS, "qkv_normal"),
    "attention.proj.weight": ParameterRule(COLUMNS, "scaled_normal"),
    "attention.proj.bias": ParameterRule(REPLICATED, "zeros"),
    "mlp_norm.weight": ParameterRule(REPLICATED, "ones"),
    "mlp_norm.bias": ParameterRule(REPLICATED, "zeros"),
    "mlp.fc_in.weight": ParameterRule(ROWS, "normal"),
    "mlp.fc_in.bias": ParameterRule(ROWS, "zeros"),
    "mlp.fc_out.weight": ParameterRule(COLUMNS, "scaled_normal"),
    "mlp.fc_out.bias": ParameterRule(REPLICATED, "zeros"),
    "final_norm.weight": ParameterRule(REPLICATED, "ones"),
    "final_norm.bias": ParameterRule(REPLICATED, "zeros"),
    "output_layer.weight": ParameterRule(ROWS, "normal", vocab_rows=True),
})


def parameter_rule(name: str) -> ParameterRule:
    """Return the rule of a global parameter name (``layers.<id>.`` prefixes are ignored)."""
    role = _LAYER_PREFIX.sub("", name)
    if role not in PARAMETER_RULES:
        raise KeyError(f"unknown GPT parameter name {name!r}; known roles: {sorted(PARAMETER_RULES)}")
    return PARAMETER_RULES[role]


def is_tp_replicated(name: str) -> bool:
    """True when every TP rank holds the whole parameter (count it once in a global grad norm)."""
    return parameter_rule(name).split == REPLICATED


def stable_seed(seed: int, name: str) -> int:
    """A 63-bit generator seed from ``(seed, name)`` that is the same in every process and run."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def normal_tensor(shape: tuple[int, ...], std: float, seed: int, name: str) -> torch.Tensor:
    """A float32 CPU tensor drawn from N(0, std) by the generator of ``(seed, name)``."""
    generator = torch.Generator().manual_seed(stable_seed(seed, name))
    return torch.randn(shape, generator=generator, dtype=torch.float32) * std


def dense_shape(name: str, local_shape: torch.Size, tp: TPGroup) -> tuple[int, ...]:
    """The tp=1 shape of a parameter whose local shard on a TP rank has ``local_shape``."""
    shape = list(local_shape)
    split = parameter_rule(name).split
    if split in (ROWS, QKV_ROWS):
        shape[0] *= tp.size
    elif split == COLUMNS:
        shape[1] *= tp.size
    return tuple(shape)


def dense_to_tp_shard(name: str, dense: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """This TP rank's slice of the dense (tp=1) tensor of parameter ``name`` (or of its gradient)."""
    split = parameter_rule(name).split
    if split == ROWS:
        return tp.shard(dense, dim=0)
    if split == COLUMNS:
        return tp.shard(dense, dim=1)
    if split == QKV_ROWS:
        # [3 * hidden, ...] -> [3, tp, hidden / tp, ...]: keep this rank's heads of q, k and v.
        return dense.unflatten(0, (3, tp.size, -1))[:, tp.rank].flatten(0, 1)
    return dense


def dense_parameter(name: str, shape: tuple[int, ...], seed: int, model) -> torch.Tensor:
    """Generate the dense float32 value of parameter ``name`` (same in every layout).

    ``model`` is the ``GPTConfig``. Vocabulary rows beyond ``model.vocab_size`` (TP
    padding) are zero, and the real rows do not depend on how many padded rows follow.
    """
    rule = parameter_rule(name)
    if rule.vocab_rows and shape[0] > model.vocab_size:
        real = dense_parameter(name, (model.vocab_size, *shape[1:]), seed, model)
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
    if name == "output_layer.weight" and model.tie_embeddings:
        name = "embedding.word.weight"  # a tied output layer starts equal to the word embedding
    return normal_tensor(shape, model.init_std, seed, name)
