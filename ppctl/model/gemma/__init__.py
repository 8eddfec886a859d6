"""The Gemma family: Llama's layers with Gemma's three differences, read and written as ``GemmaForCausalLM``.

A Gemma is a Llama (RMSNorm, a gated MLP, grouped- or multi-query attention, rotary positions, an explicit
``head_dim``) whose word embeddings are multiplied by ``sqrt(hidden_size)`` (rounded to the parameters' dtype, as
transformers rounds it), whose RMSNorms scale by ``1 + weight`` (the weights stored around 0, so they start at 0),
and whose MLP gates with the tanh GELU (GeGLU) instead of SiLU. Its chunk is Llama's with those three hooks on
(``LlamaConfig.scale_embeddings``, ``norm_offset``, ``mlp_activation``), its keys Llama's, its parameter rules
Llama's with the norms starting at 0 (``rules.py``). Not a Gemma: q/k/v biases and experts (refused). Multi-query
attention (one key/value head) runs at tp=1 only: each TP rank owns whole key/value heads. Pure: no torch.
"""

from __future__ import annotations

import dataclasses
from types import MappingProxyType

from ppctl.config.schema import ConfigError
from ppctl.model.llama import FAMILY as LLAMA

# Gemma's hooks on Llama's shape: scaled embeddings, RMSNorm's 1 + w, GeGLU.
GEMMA_HOOKS = MappingProxyType({"scale_embeddings": True, "norm_offset": 1.0, "mlp_activation": "gelu_tanh"})


def _shape_of(resolved):
    """Llama's ``LlamaConfig`` of a ``ResolvedModel`` with Gemma's hooks on."""
    return dataclasses.replace(LLAMA.shape_of(resolved), **GEMMA_HOOKS)


def _chunk_class():
    from ppctl.model.gemma.model import GemmaChunk

    return GemmaChunk


def _rule_of_name(shape):
    from ppctl.model.gemma.rules import gemma_rule

    return lambda name: gemma_rule(name, shape.tie_embeddings)


def _check(model, config) -> None:
    """Llama's rules, and none of what a Gemma has not: q/k/v biases, experts."""
    LLAMA.check(model, config)
    if model.qkv_bias:
        raise ConfigError("model.qkv_bias=true: a Gemma has no q/k/v biases alone (its attention_bias is on every "
                          "projection, which ppctl does not compute)")
    if model.moe.num_experts:
        raise ConfigError(f"model.moe.num_experts={model.moe.num_experts}: a Gemma has no experts")


def _hf():
    from ppctl.model.gemma.hf import FORMAT

    return FORMAT


FAMILY = dataclasses.replace(LLAMA, name="gemma", shape_of=_shape_of, chunk_class=_chunk_class,
                             rule_of_name=_rule_of_name, check=_check, hf=_hf)
