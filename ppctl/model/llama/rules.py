"""The Llama family's parameters: each role's TP split and initialisation.

q/k/v and gate/up are separate column-parallel weights (split by rows: whole heads, whole KV
groups, whole features), o_proj and down_proj row-parallel (split by columns), the norms
replicated (Qwen3's per-head q/k norms too, each TP rank's gradient its own heads' share:
``tp_partial``). The embedding and the output layer split the padded vocabulary. As in the GPT
family, projections into the residual stream start with the scaled normal.
"""

from __future__ import annotations

from types import MappingProxyType

from ppctl.model.moe.rules import moe_rules
from ppctl.model.rules import COLUMNS, REPLICATED, ROWS, ParameterRule, rule_by_role

_DENSE_RULES = {
    "embedding.word.weight": ParameterRule(ROWS, "normal", vocab_rows=True, embedding=True),
    "input_layernorm.weight": ParameterRule(REPLICATED, "ones"),
    "self_attn.q_proj.weight": ParameterRule(ROWS, "normal"),
    "self_attn.k_proj.weight": ParameterRule(ROWS, "normal"),
    "self_attn.v_proj.weight": ParameterRule(ROWS, "normal"),
    "self_attn.q_proj.bias": ParameterRule(ROWS, "zeros"),
    "self_attn.k_proj.bias": ParameterRule(ROWS, "zeros"),
    "self_attn.v_proj.bias": ParameterRule(ROWS, "zeros"),
    "self_attn.o_proj.weight": ParameterRule(COLUMNS, "scaled_normal"),
    "self_attn.q_norm.weight": ParameterRule(REPLICATED, "ones", tp_partial=True),
    "self_attn.k_norm.weight": ParameterRule(REPLICATED, "ones", tp_partial=True),
    "self_attn.o_proj.bias": ParameterRule(REPLICATED, "zeros"),  # Llama's attention_bias: added once, after the sum
    "self_attn.q_norm.weight": ParameterRule(REPLICATED, "ones", tp_partial=True),
    "self_attn.k_norm.weight": ParameterRule(REPLICATED, "ones", tp_partial=True),
    "post_attention_layernorm.weight": ParameterRule(REPLICATED, "ones"),
    "mlp.gate_proj.weight": ParameterRule(ROWS, "normal"),
    "mlp.up_proj.weight": ParameterRule(ROWS, "normal"),
    "mlp.down_proj.weight": ParameterRule(COLUMNS, "scaled_normal"),
    "final_norm.weight": ParameterRule(REPLICATED, "ones"),
    "output_layer.weight": ParameterRule(ROWS, "normal", vocab_rows=True, embedding=True),
}
# An MoE layer's MLP: the router, the stacked experts and the shared experts (ppctl.model.moe.rules).
PARAMETER_RULES = MappingProxyType({**_DENSE_RULES, **moe_rules(_DENSE_RULES)})


def llama_rule(name: str, tie_embeddings: bool = False) -> ParameterRule:
    """The rule of a global Llama parameter name (``layers.<id>.`` prefixes are ignored)."""
    return rule_by_role(PARAMETER_RULES, "Llama", name, tie_embeddings)
