"""The Mistral family: Llama's layers, chunk, settings and parameter rules, written and read as ``MistralForCausalLM``.

A Mistral computes what a Llama computes (RMSNorm, SwiGLU, grouped-query attention, rotary positions) when its
sliding window hides nothing (``hf.py`` refuses a window shorter than the longest sequence); what sets it apart is
its Hugging Face format, so the family is Llama's with another name and format, and without what Mistral has not:
q/k/v biases and experts (a Mistral with experts is a Mixtral, ``model.family=llama``). Pure: no torch.
"""

from __future__ import annotations

import dataclasses

from ppctl.config.schema import ConfigError
from ppctl.model.llama import FAMILY as LLAMA


def _check(model, config) -> None:
    """Llama's rules, and none of what ``MistralForCausalLM`` cannot hold."""
    LLAMA.check(model, config)
    if model.qkv_bias:
        raise ConfigError("model.qkv_bias=true: a Mistral has no q/k/v biases (Qwen2's are model.family=llama's)")
    if model.attention_output_bias:
        raise ConfigError("model.attention_output_bias=true: a Mistral has no output bias")
    if model.moe.num_experts:
        raise ConfigError(f"model.moe.num_experts={model.moe.num_experts}: a Mistral has no experts (a Mixtral is "
                          f"model.family=llama with model.moe)")


def _hf():
    from ppctl.model.mistral.hf import FORMAT

    return FORMAT


FAMILY = dataclasses.replace(LLAMA, name="mistral", check=_check, hf=_hf)
