"""The OLMo 2 family: Llama's attention and SwiGLU with OLMo 2's norms, read and written as ``Olmo2ForCausalLM``.

An OLMo 2 layer normalises after attention and after the MLP, not before (``x + norm(attn(x))``, ``x +
norm(mlp(x))``), and RMS-normalises its projected queries and keys each over their whole width (every head together)
before the split into heads; under TP the ranks add their sums of squares (``layers.py``), so any ``parallel.tp``
that Llama's rules allow computes it. Its keys are Llama's, its chunk Llama's with OLMo 2's layer (``model.py``), its
parameters Llama's but the norms (``rules.py``). Not an OLMo 2: q/k/v biases and experts (refused). Pure: no torch.
"""

from __future__ import annotations

import dataclasses

from ppctl.config.schema import ConfigError
from ppctl.model.llama import FAMILY as LLAMA


def _chunk_class():
    from ppctl.model.olmo2.model import Olmo2Chunk

    return Olmo2Chunk


def _rule_of_name(shape):
    from ppctl.model.olmo2.rules import olmo2_rule

    return lambda name: olmo2_rule(name, shape.tie_embeddings)


def _check(model, config) -> None:
    """Llama's rules, and none of what an OLMo 2 has not: q/k/v biases, experts."""
    LLAMA.check(model, config)
    if model.qkv_bias:
        raise ConfigError("model.qkv_bias=true: an OLMo 2 has no q/k/v biases alone (its attention_bias is on every "
                          "projection, which ppctl does not compute)")
    if model.moe.num_experts:
        raise ConfigError(f"model.moe.num_experts={model.moe.num_experts}: an OLMo 2 has no experts (OLMoE is "
                          f"another architecture)")


def _hf():
    from ppctl.model.olmo2.hf import FORMAT

    return FORMAT


FAMILY = dataclasses.replace(LLAMA, name="olmo2", chunk_class=_chunk_class, rule_of_name=_rule_of_name, check=_check,
                             hf=_hf)
