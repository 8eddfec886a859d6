"""Incremental decoding: each attention layer's keys and values kept from one step to the next.

One process only (no TP, no CP): ``ppctl generate`` runs the whole model as one chunk
(``DecoderChunk.generate_step``). The first step runs the prompt as one block under a causal
mask; each later step runs the new token alone, attending to every cached position and itself.
Keys are kept after rotary, as attention reads them, and before grouped-query repetition (each
key/value head once). A layer's buffer holds ``capacity`` positions, allocated at its first step,
so a step writes its new positions in place instead of copying the past.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

SEQUENCE_DIM = 2  # of [batch, heads, seq, head_dim]


class LayerCache:
    """One attention layer's keys and values so far, ``[batch, kv_heads, length, head_dim]`` each."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.length = 0
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def append(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add the new positions' ``key`` and ``value``; return every cached position's keys and values."""
        new_length = self.length + key.shape[SEQUENCE_DIM]
        if new_length > self.capacity:
            raise ValueError(f"the KV cache holds {self.capacity} positions; {new_length} asked")
        if self.keys is None:
            batch, heads, _, head_dim = key.shape
            self.keys = key.new_empty(batch, heads, self.capacity, head_dim)
            self.values = value.new_empty(batch, heads, self.capacity, head_dim)
        self.keys[:, :, self.length:new_length] = key
        self.values[:, :, self.length:new_length] = value
        self.length = new_length
        return self.keys[:, :, :new_length], self.values[:, :, :new_length]


class KVCache:
    """The ``LayerCache`` of every attention layer of one generation, by layer id, each of ``capacity`` positions,
    and the output layer's weight laid out for decoding."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.layers: dict[str, LayerCache] = {}
        self._output_weight: torch.Tensor | None = None

    def output_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """The output weight ``[vocab, hidden]`` as ``[hidden, vocab]``, copied once per generation: one position's
        logits are a vector-matrix product, which the CPU's BLAS (MKL) runs up to 3x faster on that layout than on
        ``nn.Linear``'s (``benchmarks/generate.py``)."""
        if self._output_weight is None:
            self._output_weight = weight.t().contiguous()
        return self._output_weight

    def layer(self, layer_id) -> LayerCache:
        """Layer ``layer_id``'s cache (empty at first)."""
        return self.layers.setdefault(str(layer_id), LayerCache(self.capacity))

    @property
    def length(self) -> int:
        """Positions cached so far (0 before the first step)."""
        return next(iter(self.layers.values())).length if self.layers else 0


def cached_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cache: LayerCache) -> torch.Tensor:
    """Causal attention of the new positions' ``query [batch, heads, new, d]`` over the cached keys and values plus
    the new ``key``/``value [batch, kv_heads, new, d]``, which join the cache; returns ``[batch, heads, new, d]``.

    Query ``i`` (position ``past + i``) sees keys ``0 .. past + i``: the prompt as one causal block, then one token
    seeing everything. Each key/value head serves ``heads / kv_heads`` consecutive query heads.
    """
    past, new = cache.length, query.shape[SEQUENCE_DIM]
    keys, values = cache.append(key, value)
    grouped = query.shape[1] != keys.shape[1]
    if past == 0:
        return F.scaled_dot_product_attention(query, keys, values, is_causal=True, enable_gqa=grouped)
    from torch.nn.attention.bias import causal_lower_right  # imports torch._dynamo: only when decoding needs it

    mask = None if new == 1 else causal_lower_right(new, past + new)
    return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, enable_gqa=grouped)
