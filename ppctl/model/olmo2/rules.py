"""The OLMo 2 family's parameters: Llama's projections and MLP, its norms after attention and MLP, and its whole-width
q/k norms, whose weights TP splits as it splits the q and k projections' rows (each rank its heads' features)."""

from __future__ import annotations

from types import MappingProxyType

from ppctl.model.llama.rules import PARAMETER_RULES as LLAMA_RULES
from ppctl.model.rules import REPLICATED, ROWS, ParameterRule, rule_by_role

_SHARED = ("embedding.word.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
           "self_attn.o_proj.weight", "post_attention_layernorm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
           "mlp.down_proj.weight", "final_norm.weight", "output_layer.weight")
PARAMETER_RULES = MappingProxyType({
    **{role: LLAMA_RULES[role] for role in _SHARED},
    "post_feedforward_layernorm.weight": ParameterRule(REPLICATED, "ones"),
    "self_attn.q_norm.weight": ParameterRule(ROWS, "ones"),
    "self_attn.k_norm.weight": ParameterRule(ROWS, "ones"),
})


def olmo2_rule(name: str, tie_embeddings: bool = False) -> ParameterRule:
    """The rule of a global OLMo 2 parameter name (``layers.<id>.`` prefixes are ignored)."""
    return rule_by_role(PARAMETER_RULES, "OLMo 2", name, tie_embeddings)
