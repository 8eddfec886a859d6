"""The GPT family: a GPT-2-shaped transformer (LayerNorm, GELU MLP, fused QKV, learned or rotary positions).

``model.activation`` picks the MLP's GELU: exact (``gelu``) or its tanh approximation (``gelu_tanh``, GPT-2's own);
``model.qkv_bias`` gives the fused QKV projection a bias (GPT-2's ``c_attn.bias``, off by default);
``model.num_kv_heads`` below ``model.num_heads`` makes the attention grouped-query (StarCoder2's), q, k and v
projected apart, each TP rank owning whole key/value heads.

``FAMILY`` is what the rest of ppctl reads (``ppctl.model.family``); its keys are ``settings.GPTSettings``; the
chunk (``model.py``) and the parameter rules (``rules.py``) are imported when a model is built, so that this module
needs no torch. ``shape_of``, ``check`` and ``memory_shape`` serve a family built on GPT's blocks too
(``ppctl.model.gpt_neox``).
"""

from __future__ import annotations

import dataclasses

from ppctl.config.schema import ConfigError, ModelConfig, default_of
from ppctl.model.family import Architecture, ModelFamily
from ppctl.model.gpt.settings import ACTIVATIONS, GPTSettings
from ppctl.model.memory_shape import ModelShape, memory_shape_of


def shape_of(resolved, **hooks):
    """The ``GPTConfig`` of a ``ResolvedModel``: its settings, padded vocabulary and mixture; ``hooks``: the
    ``GPTConfig`` fields a family built on GPT's blocks sets (GPT-NeoX's parallel residual, partial rotary)."""
    from ppctl.model.gpt.model import GPTConfig

    model = resolved.settings
    return GPTConfig(**hooks, num_kv_heads=model.num_kv_heads,
        num_layers=model.num_layers, hidden_size=model.hidden_size, num_heads=model.num_heads,
        ffn_hidden_size=model.ffn_hidden_size, activation=model.activation, vocab_size=model.vocab_size,
        padded_vocab_size=resolved.padded_vocab_size,
        max_seq_length=model.max_seq_length, position_embedding=model.position_embedding,
        tie_embeddings=model.tie_embeddings, norm_epsilon=model.norm_epsilon, init_std=model.init_std,
        rope_base=model.rope_theta, qkv_bias=model.qkv_bias, moe=resolved.moe)


def _chunk_class():
    from ppctl.model.gpt.model import GPTChunk

    return GPTChunk


def _rule_of_name(shape):
    from ppctl.model.gpt.rules import gpt_rule

    return lambda name: gpt_rule(name, shape.tie_embeddings, shape.qkv_per_head)


def check(model: GPTSettings, config) -> None:
    """GPT's own rules (``model``: the run's ``GPTSettings``): a known GELU, whole heads of ``hidden_size``, an even
    head width for rotary, no rotary base without rotary positions, whole key/value heads per TP rank."""
    if model.activation not in ACTIVATIONS:
        raise ConfigError(f"model.activation={model.activation!r} must be one of {', '.join(ACTIVATIONS)}")
    if model.hidden_size % model.num_heads:
        raise ConfigError(f"model.hidden_size={model.hidden_size} must be divisible by model.num_heads="
                          f"{model.num_heads}")
    if model.position_embedding == "rope" and (model.hidden_size // model.num_heads) % 2:
        raise ConfigError("model.position_embedding=rope needs an even head dim")
    if model.position_embedding == "learned" and model.rope_theta != default_of(ModelConfig, "rope_theta"):
        raise ConfigError(f"model.rope_theta={model.rope_theta} is read only with model.position_embedding=rope; this "
                          f"model has learned positions (drop the key, or set model.position_embedding=rope)")
    _check_kv_heads(model, config.parallel.tp)


def _check_kv_heads(model: GPTSettings, tp: int) -> None:
    """Key/value heads that serve whole groups of query heads, whole on each TP rank."""
    if model.num_kv_heads is None:
        return
    if model.num_heads % model.num_kv_heads:
        raise ConfigError(f"model.num_heads={model.num_heads} must be a multiple of model.num_kv_heads="
                          f"{model.num_kv_heads}")
    if model.num_kv_heads % tp:
        raise ConfigError(f"model.num_kv_heads={model.num_kv_heads} must be divisible by parallel.tp={tp} (each TP "
                          f"rank owns whole key/value heads)")


def memory_shape(model: GPTSettings, padded_vocab: int, architecture: Architecture) -> ModelShape:
    """The memory shape of the shared keys; under grouped-query attention its key/value heads, q, k and v apart
    (the keys and values repeated to the query heads, as Llama's)."""
    shape = memory_shape_of(model, padded_vocab, architecture)
    if model.num_kv_heads is None or model.num_kv_heads == model.num_heads:
        return shape
    return dataclasses.replace(shape, kv_heads=model.num_kv_heads, fused_qkv=False)


def _hf():
    from ppctl.model.gpt.hf import FORMAT

    return FORMAT


FAMILY = ModelFamily(name="gpt", shape_of=shape_of, chunk_class=_chunk_class, rule_of_name=_rule_of_name,
                     check=check, hf=_hf, settings=GPTSettings, memory_shape=memory_shape)
