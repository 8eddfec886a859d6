"""What autograd keeps of one chunk forward: the bytes the memory model's activations are checked against.

``chunk_forward_saved_bytes`` runs a ``DecoderChunk`` once on a random microbatch under a
saved-tensor hook and counts each saved storage once, so views of one buffer (a fused
QKV's query, key and value, a layer's input saved by several ops) count as the buffer.
"""

from __future__ import annotations

import torch
from torch.autograd.graph import saved_tensors_hooks


def chunk_forward_saved_bytes(chunk, batch: int, seq: int, vocab_size: int, received_seq: int | None = None) -> int:
    """Bytes of the distinct storages autograd saves in one forward of ``chunk`` on ``batch`` sequences of ``seq``
    tokens (parameters excluded; the chunk's input, token ids or received hidden states, included).
    ``received_seq``: the tokens of a received hidden state (``seq / tp`` with sequence parallelism; ``seq``)."""
    tokens = torch.randint(0, vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    dtype = next(chunk.parameters()).dtype
    inputs = tokens if chunk.pre_process else torch.randn(batch, received_seq or seq, chunk.config.hidden_size,
                                                          dtype=dtype, requires_grad=True)
    skipped = {param.untyped_storage().data_ptr() for param in chunk.parameters()}
    storages = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in skipped:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with saved_tensors_hooks(pack, lambda tensor: tensor):
        chunk(inputs, position_ids=torch.arange(seq).expand(batch, seq).contiguous(),
              labels=tokens if chunk.post_process else None)
    return sum(storages.values())
