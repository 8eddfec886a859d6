"""The Phi-3 family: Llama's layers, chunk, settings and parameter rules, written and read as ``Phi3ForCausalLM``.

A Phi-3 with the plain rotary embedding computes what a Llama computes; its Hugging Face format fuses q/k/v and
gate/up (``hf.py`` splits them on reading and joins them on export), so the family is Llama's with another name and
format, and without what Phi-3 has not: q/k/v biases, experts and a rotary scaling other than ``longrope`` (which
ppctl does not compute). Pure: no torch.
"""

from __future__ import annotations

import dataclasses

from ppctl.config.schema import ConfigError
from ppctl.model.llama import FAMILY as LLAMA


def _check(model, config) -> None:
    """Llama's rules, and none of what ``Phi3ForCausalLM`` cannot hold."""
    LLAMA.check(model, config)
    if model.qkv_bias:
        raise ConfigError("model.qkv_bias=true: a Phi-3 has no q/k/v biases")
    if model.attention_output_bias:
        raise ConfigError("model.attention_output_bias=true: a Phi-3 has no output bias")
    if model.moe.num_experts:
        raise ConfigError(f"model.moe.num_experts={model.moe.num_experts}: a Phi-3 has no experts")
    if model.rope_scaling_factor is not None:
        raise ConfigError(f"model.rope_scaling_factor={model.rope_scaling_factor}: a Phi-3 computes the plain rotary "
                          f"embedding or longrope, not Llama 3's scaling (drop the key)")


def _hf():
    from ppctl.model.phi3.hf import FORMAT

    return FORMAT


FAMILY = dataclasses.replace(LLAMA, name="phi3", check=_check, hf=_hf)
