"""The GPT family's parameters: each role's TP split and initialisation.

A role is a parameter's global name without its ``layers.<id>.`` prefix. The fused QKV weight
is generated as three separately named tensors (``query``, ``key``, ``value``) and split by heads,
so TP ranks own whole heads of each (its bias, with ``model.qkv_bias``, the same rows); a tied
output layer starts equal to the word embedding. Under grouped-query attention q, k and v are
weights apart, each split by rows (whole key/value heads per rank, as Llama's). A QKV fused per
head (GPT-NeoX's) is split by plain rows: a contiguous range holds whole heads' q, k and v.
"""

from __future__ import annotations

from types import MappingProxyType

from ppctl.model.moe.rules import moe_rules
from ppctl.model.rules import COLUMNS, QKV_ROWS, REPLICATED, ROWS, ParameterRule, rule_by_role

_DENSE_RULES = {
    "embedding.word.weight": ParameterRule(ROWS, "normal", vocab_rows=True, embedding=True),
    "embedding.position.weight": ParameterRule(REPLICATED, "normal", embedding=True),
    "attn_norm.weight": ParameterRule(REPLICATED, "ones"),
    "attn_norm.bias": ParameterRule(REPLICATED, "zeros"),
    "attention.qkv.weight": ParameterRule(QKV_ROWS, "qkv_normal"),
    "attention.qkv.bias": ParameterRule(QKV_ROWS, "zeros"),
    "attention.query.weight": ParameterRule(ROWS, "normal"),
    "attention.key.weight": ParameterRule(ROWS, "normal"),
    "attention.value.weight": ParameterRule(ROWS, "normal"),
    "attention.query.bias": ParameterRule(ROWS, "zeros"),
    "attention.key.bias": ParameterRule(ROWS, "zeros"),
    "attention.value.bias": ParameterRule(ROWS, "zeros"),
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
    "output_layer.weight": ParameterRule(ROWS, "normal", vocab_rows=True, embedding=True),
}
# An MoE layer's MLP: the router, the stacked experts and the shared experts (ppctl.model.moe.rules).
PARAMETER_RULES = MappingProxyType({**_DENSE_RULES, **moe_rules(_DENSE_RULES)})
# A QKV fused per head: whole heads are contiguous rows.
PER_HEAD_QKV_RULES = MappingProxyType({"attention.qkv.weight": ParameterRule(ROWS, "normal"),
                                       "attention.qkv.bias": ParameterRule(ROWS, "zeros")})


def gpt_rule(name: str, tie_embeddings: bool = False, qkv_per_head: bool = False) -> ParameterRule:
    """The rule of a global GPT parameter name (``layers.<id>.`` prefixes are ignored); ``qkv_per_head``: the fused
    QKV's rows are head by head (``GPTConfig.qkv_per_head``)."""
    rules = {**PARAMETER_RULES, **PER_HEAD_QKV_RULES} if qkv_per_head else PARAMETER_RULES
    return rule_by_role(rules, "GPT", name, tie_embeddings)
