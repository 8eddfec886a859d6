"""The GPT-NeoX family (``GPTNeoXForCausalLM``, Pythia): GPT's layers with GPT-NeoX's three differences.

A GPT-NeoX layer is ppctl's GPT layer (``ppctl.model.layers``: LayerNorm with a shift, a GELU MLP with biases,
rotary positions) with the hooks ``GPTConfig`` holds off for GPT: a parallel residual
(``model.parallel_residual``: ``x + attn(norm1(x)) + mlp(norm2(x))``), rotary positions over the first
``model.partial_rotary_factor`` of each head, and its fused ``query_key_value`` laid out head by head (``[q, k, v]``
of each head in turn), kept so: a TP rank's contiguous rows are whole heads, read and written as they are. The chunk
is GPT's (``GPTChunk``); the parameters are GPT's names, the fused QKV split by plain rows. Its Hugging Face format
is ``hf.py``. It has no grouped-query attention and no learned positions (both refused by name).

``FAMILY`` is what the rest of ppctl reads (``ppctl.model.family``); its keys are ``settings.GPTNeoXSettings``.
Pure: no torch here (the chunk and the rules are GPT's, imported when a model is built).
"""

from __future__ import annotations

from ppctl.config.schema import ConfigError
from ppctl.model import gpt
from ppctl.model.family import ModelFamily
from ppctl.model.gpt_neox.settings import GPTNeoXSettings


def _shape_of(resolved):
    """GPT's ``GPTConfig`` of a ``ResolvedModel`` with GPT-NeoX's hooks set: its residual, its rotary fraction, its
    QKV fused head by head."""
    settings = resolved.settings
    return gpt.shape_of(resolved, parallel_residual=settings.parallel_residual,
                        partial_rotary_factor=settings.partial_rotary_factor, qkv_per_head=True)


def _check(model: GPTNeoXSettings, config) -> None:
    """GPT's rules, and GPT-NeoX's: rotary positions over an even number of each head's dims, as many key/value
    heads as heads."""
    gpt.check(model, config)
    _require(model.position_embedding == "rope", f"model.family=gpt_neox has rotary positions: set "
                                                 f"model.position_embedding=rope (got {model.position_embedding})")
    _require(model.num_kv_heads is None, f"model.num_kv_heads={model.num_kv_heads}: model.family=gpt_neox has as many "
                                         f"key/value heads as heads (its QKV is fused head by head); drop the key")
    factor = model.partial_rotary_factor
    _require(0 < factor <= 1, f"model.partial_rotary_factor={factor} must be in (0, 1]")
    head_dim = model.hidden_size // model.num_heads
    rotary_dim = int(head_dim * factor)
    _require(rotary_dim >= 2 and rotary_dim % 2 == 0,
             f"model.partial_rotary_factor={factor} rotates {rotary_dim} of each head's {head_dim} dims: rotary "
             f"needs an even number of them, at least 2")


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def _hf():
    from ppctl.model.gpt_neox.hf import FORMAT

    return FORMAT


FAMILY = ModelFamily(name="gpt_neox", shape_of=_shape_of, chunk_class=gpt.FAMILY.chunk_class,
                     rule_of_name=gpt.FAMILY.rule_of_name, check=_check, hf=_hf, settings=GPTNeoXSettings,
                     memory_shape=gpt.memory_shape)
