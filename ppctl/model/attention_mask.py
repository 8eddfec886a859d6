"""Documents kept apart (``data.documents=separate``): the block-causal mask of a microbatch, and attention under it.

A microbatch's ``segment_ids [batch, seq]`` give each token the index of its document within its row. Key ``j`` is
visible to query ``i`` when ``j <= i`` and both lie in the same document, so no token attends across a document
boundary. The chunk builds one ``DocumentMask`` per microbatch (``ppctl.model.chunk.DecoderChunk.forward``) and
hands the same object to every layer's attention; ``attend`` is the attention core the layers call.

On the CPU the mask is a boolean ``[batch, 1, seq, seq]`` tensor for ``F.scaled_dot_product_attention``: on a
gpt_tiny microbatch it ran faster than the same mask as an additive float one and than FlexAttention (eager, or
compiled), measured by ``benchmarks/document_mask.py`` (numbers in docs/data.md, "Documents kept apart"). The mask
is a constant of the microbatch, not a parameter, so recomputation and the B/W split (which defers only weight
gradients) run the same attention again.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ppctl.parallel.context_parallel import CPGroup, CPSegments, context_parallel_attention


@dataclass(frozen=True)
class DocumentMask:
    """What attention needs to keep documents apart, built once per microbatch.

    ``segment_ids [batch, seq]`` (int64): the document index of each of this rank's tokens (with context
    parallelism the CP rank's two chunks, in the layout's order). ``visible [batch, 1, seq, seq]`` (bool): key
    ``j`` visible to query ``i``, for a whole (cp=1) sequence; None with context parallelism, whose attention reads
    ``context_parallel`` instead: the ``ppctl.parallel.context_parallel.CPSegments`` of the microbatch (the rows'
    segment ids gathered over the CP group, and what the CP mode needs of them).
    """

    segment_ids: torch.Tensor
    visible: torch.Tensor | None
    context_parallel: CPSegments | None = None

    @classmethod
    def of(cls, segment_ids: torch.Tensor) -> "DocumentMask":
        """The block-causal mask of whole sequences: key ``j`` visible to query ``i`` iff ``j <= i`` and they share
        a document."""
        seq = segment_ids.shape[-1]
        causal = torch.ones(seq, seq, dtype=torch.bool, device=segment_ids.device).tril_()
        same_document = segment_ids.unsqueeze(-1) == segment_ids.unsqueeze(-2)  # [batch, query, key]
        return cls(segment_ids, (same_document & causal).unsqueeze(1))


def document_mask(segment_ids: torch.Tensor | None, cp: CPGroup) -> DocumentMask | None:
    """The microbatch's ``DocumentMask`` (None when documents are joined: ``segment_ids`` is None). With context
    parallelism its ``CPSegments`` costs one all-gather over the CP group, which every CP rank makes for the same
    microbatch."""
    if segment_ids is None:
        return None
    if cp.size > 1:
        return DocumentMask(segment_ids, None, CPSegments.gathered(segment_ids, cp))
    return DocumentMask.of(segment_ids)


def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cp: CPGroup,
           mask: DocumentMask | None = None) -> torch.Tensor:
    """Causal attention of ``query [batch, heads, seq, d]`` over ``key``/``value`` of the same shape; with ``mask``,
    block-causal (no token sees another document). Without a mask it is ``context_parallel_attention``, unchanged."""
    if mask is None:
        return context_parallel_attention(query, key, value, cp)
    if cp.size > 1:
        return context_parallel_attention(query, key, value, cp, mask.context_parallel)
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask.visible)
