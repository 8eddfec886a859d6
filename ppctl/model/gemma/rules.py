"""The Gemma family's parameters: Llama's, its RMSNorm weights starting at 0 (Gemma scales by ``1 + weight``)."""

from __future__ import annotations

import dataclasses
from types import MappingProxyType

from ppctl.model.llama.rules import PARAMETER_RULES as LLAMA_RULES
from ppctl.model.rules import rule_by_role

NORMS = ("input_layernorm.weight", "post_attention_layernorm.weight", "final_norm.weight")
PARAMETER_RULES = MappingProxyType({**LLAMA_RULES, **{role: dataclasses.replace(LLAMA_RULES[role], init="zeros")
                                                      for role in NORMS}})


def gemma_rule(name: str, tie_embeddings: bool = False):
    """The rule of a global Gemma parameter name (``layers.<id>.`` prefixes are ignored)."""
    return rule_by_role(PARAMETER_RULES, "Gemma", name, tie_embeddings)
