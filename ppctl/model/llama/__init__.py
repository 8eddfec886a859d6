"""The Llama family: RMSNorm, SwiGLU, grouped-query attention, rotary positions (Llama 2 and 3, Qwen2's q/k/v bias).

``FAMILY`` is what the rest of ppctl reads (``ppctl.model.family``); its keys are ``settings.LlamaSettings``; the chunk (``model.py``), its
layers (``layers.py``) and the parameter rules (``rules.py``) are imported when a model is built, so
that this module needs no torch. Each TP rank owns whole key/value heads: ``model.num_kv_heads``
must be a multiple of ``parallel.tp`` (refused otherwise; Megatron would replicate them instead).
"""

from __future__ import annotations

import dataclasses

from ppctl.config.schema import ConfigError, default_of
from ppctl.model.family import Architecture, ModelFamily
from ppctl.model.llama.heads import head_dim_of, kv_heads_of
from ppctl.model.llama.settings import LlamaSettings
from ppctl.model.memory_shape import ModelShape, memory_shape_of


def _shape_of(resolved):
    """The ``LlamaConfig`` of a ``ResolvedModel``: its settings, padded vocabulary and mixture."""
    from ppctl.model.llama.layers import RopeScaling
    from ppctl.model.llama.model import LlamaConfig

    model = resolved.settings
    scaling = None
    if model.rope_scaling_factor is not None:
        scaling = RopeScaling(model.rope_scaling_factor, model.rope_low_freq_factor, model.rope_high_freq_factor,
                              model.rope_original_max_position, kind=model.rope_scaling_type,
                              beta_fast=model.rope_yarn_beta_fast, beta_slow=model.rope_yarn_beta_slow,
                              truncate=model.rope_yarn_truncate, attention_factor=model.rope_attention_factor)
    return LlamaConfig(
        num_layers=model.num_layers, hidden_size=model.hidden_size, num_heads=model.num_heads,
        num_kv_heads=kv_heads_of(model), head_dim=head_dim_of(model),
        ffn_hidden_size=model.ffn_hidden_size, vocab_size=model.vocab_size, max_seq_length=model.max_seq_length,
        padded_vocab_size=resolved.padded_vocab_size,
        tie_embeddings=model.tie_embeddings, norm_epsilon=model.norm_epsilon, init_std=model.init_std,
        rope_theta=model.rope_theta, rope_scaling=scaling, qkv_bias=model.qkv_bias,
        attention_output_bias=model.attention_output_bias, moe=resolved.moe,
    )


# The keys each rotary scaling (``model.rope_scaling_type``) reads besides its factor; every other one, and all of
# them without ``model.rope_scaling_factor``, keep their default.
ROPE_SCALING_READS = {"llama3": ("rope_low_freq_factor", "rope_high_freq_factor", "rope_original_max_position"),
                      "linear": (),
                      "yarn": ("rope_original_max_position", "rope_yarn_beta_fast", "rope_yarn_beta_slow",
                               "rope_yarn_truncate", "rope_attention_factor")}
ROPE_SCALING_KEYS = ("rope_scaling_type", *dict.fromkeys(key for keys in ROPE_SCALING_READS.values() for key in keys))


def _chunk_class():
    from ppctl.model.llama.model import LlamaChunk

    return LlamaChunk


def _rule_of_name(shape):
    from ppctl.model.llama.rules import llama_rule

    return lambda name: llama_rule(name, shape.tie_embeddings)


def _check(model: LlamaSettings, config) -> None:
    """Llama's own rules (``model``: the run's ``LlamaSettings``): rotary positions, whole KV groups per TP rank, an
    even head width, sane scaling."""
    tp = config.parallel.tp
    for key in ("num_kv_heads", "head_dim"):  # unset is null: 0 is refused, not read as unset
        value = getattr(model, key)
        _require(value is None or value >= 1, f"model.{key}={value} must be a positive integer, or unset (null)")
    kv_heads = kv_heads_of(model)
    _require(model.position_embedding == "rope", f"model.family={model.family} has rotary positions: set "
                                                 f"model.position_embedding=rope (got {model.position_embedding})")
    _require(kv_heads >= 1 and model.num_heads % kv_heads == 0,
             f"model.num_heads={model.num_heads} must be a multiple of model.num_kv_heads={kv_heads}")
    _require(kv_heads % tp == 0, f"model.num_kv_heads={kv_heads} must be divisible by parallel.tp={tp} (each TP rank "
                                 f"owns whole key/value heads)")
    _require(model.head_dim is not None or model.hidden_size % model.num_heads == 0,
             f"model.hidden_size={model.hidden_size} must be divisible by model.num_heads={model.num_heads}, or set "
             f"model.head_dim")
    _require(head_dim_of(model) % 2 == 0, f"model.head_dim={head_dim_of(model)} must be even (rotary pairs)")
    _check_rope_scaling(model)


def _check_rope_scaling(model) -> None:
    """The rotary scaling: a known kind, sane values, and no key its kind does not read (none without
    ``model.rope_scaling_factor``)."""
    factor, kind = model.rope_scaling_factor, model.rope_scaling_type
    if factor is not None:
        _require(kind in ROPE_SCALING_READS, f"model.rope_scaling_type={kind!r} must be one of "
                                             f"{', '.join(ROPE_SCALING_READS)}")
    reads = ("rope_scaling_type", *ROPE_SCALING_READS[kind]) if factor is not None else ()
    for key in ROPE_SCALING_KEYS:
        value = getattr(model, key)
        if key in reads or value == default_of(LlamaSettings, key):
            continue
        _require(factor is not None, f"model.{key}={value} is read only with model.rope_scaling_factor, which is "
                                     f"unset: set it too, or drop the key")
        readers = " or ".join(f"model.rope_scaling_type={name}" for name, keys in ROPE_SCALING_READS.items()
                              if key in keys)
        raise ConfigError(f"model.{key}={value} is read only with {readers}; this model has "
                          f"model.rope_scaling_type={kind} (drop the key)")
    if factor is None:
        return
    _require(factor > 0, f"model.rope_scaling_factor={factor} must be > 0")
    _require(kind != "llama3" or 0 < model.rope_low_freq_factor < model.rope_high_freq_factor,
             f"model.rope_low_freq_factor={model.rope_low_freq_factor} and model.rope_high_freq_factor="
             f"{model.rope_high_freq_factor}: Llama 3's scaling needs 0 < low < high")
    _require(model.rope_original_max_position >= 1,
             f"model.rope_original_max_position={model.rope_original_max_position} must be a positive integer")
    _require(model.rope_yarn_beta_fast > 0 and model.rope_yarn_beta_slow > 0,
             f"model.rope_yarn_beta_fast={model.rope_yarn_beta_fast} and model.rope_yarn_beta_slow="
             f"{model.rope_yarn_beta_slow} must be > 0")
    attention = model.rope_attention_factor
    _require(attention is None or attention > 0, f"model.rope_attention_factor={attention} must be > 0, or unset")


def _memory_shape(model: LlamaSettings, padded_vocab: int, architecture: Architecture) -> ModelShape:
    """The memory shape of the shared keys with grouped-query attention's widths."""
    shape = memory_shape_of(model, padded_vocab, architecture)
    return dataclasses.replace(shape, kv_heads=model.num_kv_heads, head_dim=model.head_dim)


def _hf():
    from ppctl.model.llama.hf import FORMAT

    return FORMAT


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


FAMILY = ModelFamily(name="llama", shape_of=_shape_of, chunk_class=_chunk_class, rule_of_name=_rule_of_name,
                     check=_check, hf=_hf, settings=LlamaSettings, memory_shape=_memory_shape,
                     architecture=Architecture(norm_has_bias=False, gated_mlp=True, linear_biases=False,
                                               fused_qkv=False))
