"""The GPT family: a GPT-2-shaped transformer (LayerNorm, GELU MLP, fused QKV, learned or rotary positions).

``model.activation`` picks the MLP's GELU: exact (``gelu``) or its tanh approximation (``gelu_tanh``, GPT-2's own);
``model.qkv_bias`` gives the fused QKV projection a bias (GPT-2's ``c_attn.bias``, off by default).

``FAMILY`` is what the rest of ppctl reads (``ppctl.model.family``); its keys are ``settings.GPTSettings``; the chunk (``model.py``) and the
parameter rules (``rules.py``) are imported when a model is built, so that this module needs no torch.
"""

from __future__ import annotations

from ppctl.config.schema import ConfigError, ModelConfig, default_of
from ppctl.model.family import ModelFamily
from ppctl.model.gpt.settings import ACTIVATIONS, GPTSettings


def _shape_of(resolved):
    """The ``GPTConfig`` of a ``ResolvedModel``: its settings, padded vocabulary and mixture."""
    from ppctl.model.gpt.model import GPTConfig

    model = resolved.settings
    return GPTConfig(
        num_layers=model.num_layers, hidden_size=model.hidden_size, num_heads=model.num_heads,
        ffn_hidden_size=model.ffn_hidden_size, activation=model.activation, vocab_size=model.vocab_size,
        padded_vocab_size=resolved.padded_vocab_size,
        max_seq_length=model.max_seq_length, position_embedding=model.position_embedding,
        tie_embeddings=model.tie_embeddings, norm_epsilon=model.norm_epsilon, init_std=model.init_std,
        rope_base=model.rope_theta, qkv_bias=model.qkv_bias, moe=resolved.moe,
    )


def _chunk_class():
    from ppctl.model.gpt.model import GPTChunk

    return GPTChunk


def _rule_of_name(shape):
    from ppctl.model.gpt.rules import gpt_rule

    return lambda name: gpt_rule(name, shape.tie_embeddings)


def _check(model: GPTSettings, config) -> None:
    """GPT's own rules (``model``: the run's ``GPTSettings``): a known GELU, whole heads of ``hidden_size``, an even
    head width for rotary, no rotary base without rotary positions."""
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


def _hf():
    from ppctl.model.gpt.hf import FORMAT

    return FORMAT


FAMILY = ModelFamily(name="gpt", shape_of=_shape_of, chunk_class=_chunk_class, rule_of_name=_rule_of_name,
                     check=_check, hf=_hf, settings=GPTSettings)
