"""The Llama family's attention widths with their unset settings read: one place for the family and its HF format.

``model`` is anything holding the ``model.*`` settings by name (a ``ModelConfig``, or a shape read from a
``config.json``). Unset is None; validation refuses 0. Pure.
"""

from __future__ import annotations


def head_dim_of(model) -> int:
    """``model.head_dim``, or ``hidden_size / num_heads`` when unset (None; validation refuses 0)."""
    return model.head_dim if model.head_dim is not None else model.hidden_size // model.num_heads


def kv_heads_of(model) -> int:
    """``model.num_kv_heads``, or ``num_heads`` when unset (None; validation refuses 0)."""
    return model.num_kv_heads if model.num_kv_heads is not None else model.num_heads
