"""The ``ParameterRule`` of each parameter of an MoE MLP, from its family's dense MLP rules.

Roles (a parameter's name without ``layers.<id>.``): ``mlp.router.weight`` (normal, replicated),
``mlp.router.expert_bias`` (the aux-loss-free bias: a buffer, not trained, saved in checkpoints like a parameter,
starting at zero), ``mlp.experts.<the dense MLP's role>`` (the stacked experts: initialised as the dense MLP's
weight of that role, with the expert dimension first, ``experts=True``) and ``mlp.shared_experts.<role>`` (the
shared experts: the family's dense MLP, its rule unchanged), ``mlp.shared_expert_gate.weight`` (their sigmoid
gate's vector, normal, replicated: under SP each TP rank's gradient is its tokens' share, summed like a norm's).
Experts run whole on their rank (expert tensor parallelism is not built), so their rules do not split over TP: at
ep=1 every TP rank holds every expert, summed over TP under sequence parallelism like a norm; with ep>1 they are
split over the ep group instead (``ppctl.optim.grads.tp_replicated``).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Mapping

from ppctl.model.rules import REPLICATED, ParameterRule

MLP_PREFIX = "mlp."


def moe_rules(dense_rules: Mapping[str, ParameterRule]) -> dict[str, ParameterRule]:
    """The MoE MLP's roles and rules for a family whose dense MLP roles (``mlp.*``) are among ``dense_rules``."""
    rules = {"mlp.router.weight": ParameterRule(REPLICATED, "normal"),
             "mlp.router.expert_bias": ParameterRule(REPLICATED, "zeros"),
             "mlp.shared_expert_gate.weight": ParameterRule(REPLICATED, "normal")}
    for role, rule in dense_rules.items():
        if role.startswith(MLP_PREFIX):
            inner = role.removeprefix(MLP_PREFIX)
            rules[f"mlp.experts.{inner}"] = replace(rule, split=REPLICATED, experts=True)
            rules[f"mlp.shared_experts.{inner}"] = rule
    return rules
