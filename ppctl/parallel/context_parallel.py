"""Context parallelism: causal self-attention over a sequence split across the CP group.

Each CP rank holds two of the ``2 * cp`` equal chunks of every sequence (rank r: chunks
r and 2cp-1-r, see ``ppctl.parallel.layout``), so its queries are only part of the
sequence and its keys and values only part of what they must attend to. Three ways to
reach the other ranks' keys and values (``CPGroup.comm``):

* ``allgather`` (Megatron-LM's all-gather CP): every rank gathers all keys and values,
  puts them in sequence order and attends with each of its query chunks to the keys
  up to that chunk's end under a causal mask by global token index; the key/value
  gradients are reduce-scattered back to their owners.
* ``ring`` (ring attention): each rank's key/value block travels around the CP ring;
  a rank attends to one block at a time, merges the partial results by log-sum-exp and
  posts the exchange of the next block before computing the current one. The backward
  sends the blocks around again with their key/value gradient accumulators, which end
  at the block's owner. Work is decided per (query chunk, key chunk) pair: fully
  masked pairs are skipped, which is where the chunk layout balances the ranks.
* ``a2a`` (DeepSpeed-Ulysses): an all-to-all turns the sequence split into a head
  split, each rank runs ordinary causal attention over the whole sequence for
  ``heads / cp`` heads, and an all-to-all turns it back.

With one CP rank, attention is ``F.scaled_dot_product_attention(..., is_causal=True)``.

Documents kept apart (``data.documents=separate``): ``segments`` (a ``CPSegments``, built once per
microbatch from the rows' segment ids, see ``CPSegments.gathered``) makes every mode block-causal:
key j is visible to query i iff j <= i and both are tokens of the same document. ``allgather`` and
``a2a`` attend under the boolean masks the object holds; the ``ring`` masks each key block by
document tile by tile and skips every chunk pair in which no query of the microbatch sees a key (a
row that sees none of a block's keys gains nothing from it, exactly, and no NaN).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from ppctl.autograd.compiled import outside_graph
from ppctl.parallel.lanes import ONE_LANE, Lanes, OnLanes
from ppctl.parallel.layout import CP_COMM_MODES, context_parallel_chunks, context_parallel_positions
from ppctl.parallel.tensor_parallel import all_gather_single, reduce_scatter_single

__all__ = ["CP_COMM_MODES", "CPGroup", "CPSegments", "chunk_pair_mask", "context_parallel_attention",
           "document_mask", "ring_block_owner", "ring_step_pairs", "visible_chunk_pairs", "RING_QUERY_TILE_ROWS"]

SEQUENCE_DIM = 2  # attention tensors are [batch, heads, seq, head_dim]
# The ring computes a pair of chunks this many query rows at a time, so its score
# buffers stay at (rows x chunk) however long the chunk: memory O(seq / cp), not O(chunk^2).
# Per score buffer that is rows / (2 * head_dim) times the size of this rank's keys.
RING_QUERY_TILE_ROWS = 128


@dataclass(frozen=True)
class CPGroup(OnLanes):
    """The context-parallel group of one rank and how attention communicates in it.

    ``group`` is a ``torch.distributed`` ProcessGroup (None when ``size`` is 1), ``rank``
    this process's index in the group, ``ranks`` the global ranks of the group in CP-rank
    order (the ring's neighbours; empty when ``size`` is 1) and ``comm`` one of
    ``CP_COMM_MODES``; ``lanes``: the worker's (``ppctl.parallel.lanes``), which its collectives go
    through.
    """

    group: object | None
    size: int
    rank: int
    ranks: tuple[int, ...] = ()
    comm: str = "allgather"
    lanes: Lanes = field(default=ONE_LANE, compare=False, repr=False)

    def __post_init__(self):
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"CPGroup: rank must be in [0, size) and size >= 1, got rank={self.rank} size={self.size}")
        if self.comm not in CP_COMM_MODES:
            raise ValueError(f"CPGroup: comm={self.comm!r} must be one of {', '.join(CP_COMM_MODES)}")
        object.__setattr__(self, "ranks", tuple(self.ranks))
        if self.size > 1 and len(self.ranks) != self.size:
            raise ValueError(f"CPGroup: ranks={self.ranks} must list the {self.size} global ranks of the CP group")

    @staticmethod
    def single() -> "CPGroup":
        """Return the trivial group of one rank (cp=1): attention communicates nothing."""
        return CPGroup(group=None, size=1, rank=0)

    @property
    def next_rank(self) -> int:
        """Global rank of the next CP rank on the ring (where this rank sends)."""
        return self.ranks[(self.rank + 1) % self.size]

    @property
    def previous_rank(self) -> int:
        """Global rank of the previous CP rank on the ring (where this rank receives from)."""
        return self.ranks[(self.rank - 1) % self.size]


def context_parallel_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                               cp: CPGroup, segments: "CPSegments | None" = None) -> torch.Tensor:
    """Causal self-attention of this rank's tokens over the whole sequence.

    ``query``/``key``/``value`` are ``[batch, heads, local_seq, head_dim]`` for this CP
    rank's tokens in the layout's order (rotary already applied). Returns
    ``[batch, heads, local_seq, head_dim]``: exactly the rows of full causal attention
    (scale ``1/sqrt(head_dim)``) for these tokens. The mask is by global sequence index;
    with ``segments`` (documents kept apart, built for ``cp``) it is block-causal: a key of
    another document is never seen.
    """
    if segments is not None:
        segments.check_built_for(cp, query.shape[SEQUENCE_DIM])
    if cp.size == 1:
        if segments is not None:
            return F.scaled_dot_product_attention(query, key, value, attn_mask=segments.masks[0])
        return F.scaled_dot_product_attention(query, key, value, is_causal=True)
    return _attention_across_ranks(query, key, value, cp, segments)


@outside_graph  # its collectives wait on their lanes (and a pair's turn): eager, between compiled graphs
def _attention_across_ranks(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cp: "CPGroup",
                            segments: "CPSegments | None") -> torch.Tensor:
    """``context_parallel_attention`` over more than one CP rank, by ``cp.comm``, outside any compiled graph."""
    if not query.shape == key.shape == value.shape:
        raise ValueError(f"context-parallel attention needs query, key and value of one shape, got "
                         f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}")
    if cp.comm == "allgather":
        return _allgather_attention(query, key, value, cp, segments)
    if cp.comm == "ring":
        return _RingAttention.apply(query, key, value, cp, segments)
    return _all_to_all_attention(query, key, value, cp, segments)


# ---------------------------------------------------------------------------
# Documents kept apart: what each mode needs of the rows' segment ids, once per microbatch
# ---------------------------------------------------------------------------

def document_mask(query_segments: torch.Tensor, key_segments: torch.Tensor,
                  causal_offset: int | None) -> torch.Tensor:
    """Which keys each query sees: ``[batch, 1, rows, keys]`` bool (True: attended), broadcast over heads.

    ``query_segments [batch, rows]`` and ``key_segments [batch, keys]`` are the documents of the
    queries and keys; a key is seen only by queries of its own document. ``causal_offset``: query
    row i is token ``causal_offset + i`` of the keys' numbering and sees keys up to it; None: every
    key precedes every query (a ring pair of distinct chunks).
    """
    same_document = query_segments.unsqueeze(-1) == key_segments.unsqueeze(-2)
    if causal_offset is not None:
        rows, keys = query_segments.shape[-1], key_segments.shape[-1]
        key_index = torch.arange(keys, device=key_segments.device)
        query_index = torch.arange(causal_offset, causal_offset + rows, device=key_segments.device)
        same_document &= key_index <= query_index.unsqueeze(-1)
    return same_document.unsqueeze(1)


def visible_chunk_pairs(chunk_segments: torch.Tensor) -> frozenset[tuple[int, int]]:
    """The ``(query chunk, key chunk)`` pairs (global indices) in which some query sees some key, block-causally.

    ``chunk_segments [batch, chunks, chunk]``: a row's segment ids cut into its equal chunks. A
    chunk always sees itself (each token sees itself); a later chunk sees an earlier one iff, in
    some row, the two share a document (every key of the earlier chunk precedes every query). Any
    ids (not only non-decreasing ones) are judged right. Synchronises with the host (once per microbatch).
    """
    batch, chunks, _ = chunk_segments.shape
    documents, document = torch.unique(chunk_segments, return_inverse=True)  # ids 0..n-1, whatever the given ids
    present = torch.zeros(batch, chunks, len(documents), device=chunk_segments.device)
    present.scatter_(2, document, 1.0)  # present[b, c, d]: chunk c of row b holds a token of document d
    shared = torch.einsum("bqd,bkd->qk", present, present) > 0
    shared &= torch.ones(chunks, chunks, dtype=torch.bool, device=shared.device).tril()
    return frozenset((q_chunk, k_chunk) for q_chunk, k_chunk in shared.nonzero().tolist())


@dataclass(frozen=True, eq=False)
class CPSegments:
    """Documents kept apart under context parallelism: what ``cp``'s mode needs, built once per microbatch.

    ``comm``, ``size`` and ``local_seq``: the CP group's mode and size and this rank's tokens per row
    it was built for. ``masks`` (``document_mask``'s): ``allgather``, one per local query chunk over
    the keys up to that chunk's end; ``a2a`` and one rank, one over the whole sequence; ``ring``,
    none. ``chunk_segments [batch, 2*cp, chunk]`` (ring): every chunk's segment ids, which mask the
    blocks tile by tile; ``visible_pairs`` (ring): the global chunk pairs it computes, the others
    seeing nothing. Build it with ``CPSegments.gathered`` (this rank's slice, one small all-gather)
    or ``CPSegments.of_row`` (the whole row); every layer of the microbatch reads the same one.
    """

    comm: str
    size: int
    local_seq: int
    masks: tuple[torch.Tensor, ...] = ()
    chunk_segments: torch.Tensor | None = None
    visible_pairs: frozenset[tuple[int, int]] = frozenset()

    @staticmethod
    def of_row(segment_ids: torch.Tensor, cp: CPGroup) -> "CPSegments":
        """From the whole rows' segment ids ``[batch, seq]`` (int, sequence order; the same on every CP rank)."""
        seq = segment_ids.shape[-1]
        local_seq = seq // cp.size
        if cp.size == 1 or cp.comm == "a2a":
            return CPSegments(cp.comm, cp.size, local_seq, masks=(document_mask(segment_ids, segment_ids, 0),))
        chunk = local_seq // 2
        if cp.comm == "ring":
            chunk_segments = segment_ids.unflatten(-1, (2 * cp.size, chunk))
            return CPSegments(cp.comm, cp.size, local_seq, chunk_segments=chunk_segments,
                              visible_pairs=visible_chunk_pairs(chunk_segments))
        masks = []  # allgather: query chunk g (rows from token g * chunk) over the keys before its end
        for global_chunk in context_parallel_chunks(cp.rank, cp.size):
            start, end = global_chunk * chunk, (global_chunk + 1) * chunk
            masks.append(document_mask(segment_ids[:, start:end], segment_ids[:, :end], start))
        return CPSegments(cp.comm, cp.size, local_seq, masks=tuple(masks))

    @staticmethod
    def gathered(local_segment_ids: torch.Tensor, cp: CPGroup) -> "CPSegments":
        """From this CP rank's slice ``[batch, local_seq]`` of the segment ids (as its microbatch holds them).

        The whole rows come from one all-gather of the int ids over the CP group (every CP rank
        calls this for the same microbatch, in the same order), then ``of_row``.
        """
        if cp.size == 1:
            return CPSegments.of_row(local_segment_ids, cp)
        local_seq = local_segment_ids.shape[-1]
        leading = local_segment_ids.t().contiguous()  # sequence-first: the gather concatenates along dim 0
        gathered = leading.new_empty((cp.size * local_seq, *leading.shape[1:]))
        cp.post(all_gather_single, gathered, leading)
        in_sequence = torch.argsort(_rank_major_positions(local_seq, cp, gathered.device))
        return CPSegments.of_row(gathered.index_select(0, in_sequence).t(), cp)

    def check_built_for(self, cp: CPGroup, local_seq: int) -> None:
        """Raise ValueError (one line) unless built for ``cp``'s size and mode and ``local_seq`` tokens a row."""
        if (self.size, self.local_seq) != (cp.size, local_seq) or (cp.size > 1 and self.comm != cp.comm):
            raise ValueError(f"CPSegments built for cp={self.size} cp_comm={self.comm} and {self.local_seq} tokens "
                             f"a row, used with cp={cp.size} cp_comm={cp.comm} and {local_seq}")

    def ring_documents(self, q_chunk: int, k_chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The segment ids ``[batch, chunk]`` of global query chunk ``q_chunk`` and key chunk ``k_chunk``."""
        return self.chunk_segments[:, q_chunk], self.chunk_segments[:, k_chunk]


# ---------------------------------------------------------------------------
# Pure: which chunk pairs the ring computes
# ---------------------------------------------------------------------------

def chunk_pair_mask(q_chunk: int, k_chunk: int) -> str:
    """How query chunk ``q_chunk`` sees key chunk ``k_chunk`` (global chunk indices) under a causal mask.

    ``"full"``: every key precedes every query; ``"causal"``: the same chunk, lower
    triangle; ``"skip"``: every key follows every query, nothing to compute.
    """
    if q_chunk > k_chunk:
        return "full"
    return "causal" if q_chunk == k_chunk else "skip"


def ring_block_owner(cp_rank: int, cp_size: int, step: int) -> int:
    """The CP rank whose key/value block ``cp_rank`` holds at ring step ``step`` (its own at step 0)."""
    return (cp_rank - step) % cp_size


def ring_step_pairs(cp_rank: int, cp_size: int, step: int,
                    visible: frozenset[tuple[int, int]] | None = None) -> list[tuple[int, int, str]]:
    """The pairs ``cp_rank`` computes at ring step ``step``: ``(local query chunk, local key chunk, mask)``.

    Local indices number a rank's chunks in its layout order (0, 1); skipped pairs are left out:
    those causally masked and, given ``visible`` (global ``(query chunk, key chunk)`` pairs, see
    ``visible_chunk_pairs``), those outside it (no query sees a key of its own document there).
    """
    query_chunks = context_parallel_chunks(cp_rank, cp_size)
    key_chunks = context_parallel_chunks(ring_block_owner(cp_rank, cp_size, step), cp_size)
    pairs = [(q_local, k_local, chunk_pair_mask(q_chunk, k_chunk))
             for q_local, q_chunk in enumerate(query_chunks) for k_local, k_chunk in enumerate(key_chunks)
             if visible is None or (q_chunk, k_chunk) in visible]
    return [pair for pair in pairs if pair[2] != "skip"]


# ---------------------------------------------------------------------------
# Shared helpers
# ---------------------------------------------------------------------------

def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Scores and softmax statistics in float32 for half-precision inputs (their range and sums need it)."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _rank_major_positions(local_seq: int, cp: CPGroup, device) -> torch.Tensor:
    """Global sequence index of each token of every rank's tokens concatenated in CP-rank order.

    Called by every attention layer for every microbatch: built once per (length, cp size,
    device) and shared (callers only read it).
    """
    return _cached_rank_major_positions(local_seq, cp.size, str(device))


@functools.lru_cache(maxsize=64)
def _cached_rank_major_positions(local_seq: int, cp_size: int, device: str) -> torch.Tensor:
    seq_length = local_seq * cp_size
    positions = [index for cp_rank in range(cp_size)
                 for index in context_parallel_positions(seq_length, cp_rank, cp_size)]
    return torch.tensor(positions, dtype=torch.long, device=device)


# ---------------------------------------------------------------------------
# allgather: gather keys and values, reduce-scatter their gradients
# ---------------------------------------------------------------------------

class _GatherKeyValue(torch.autograd.Function):
    """All-gather the packed keys and values (one message) forward; reduce-scatter their gradient backward.

    ``packed`` is sequence-first (``[local_seq, 2, batch, heads, head_dim]``), so the
    result holds every rank's tokens one rank after another along dim 0.
    """

    @staticmethod
    def forward(ctx, packed, cp):
        ctx.cp = cp
        gathered = packed.new_empty((cp.size * packed.shape[0], *packed.shape[1:]))
        cp.post(all_gather_single, gathered, packed.contiguous())
        return gathered

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_gathered):
        scattered = grad_gathered.new_empty((grad_gathered.shape[0] // ctx.cp.size, *grad_gathered.shape[1:]))
        ctx.cp.post(reduce_scatter_single, scattered, grad_gathered.contiguous())
        return scattered, None


def _pack_sequence_first(key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``[batch, heads, seq, d]`` twice -> one contiguous ``[seq, 2, batch, heads, d]`` (a single copy)."""
    return torch.stack((key.movedim(SEQUENCE_DIM, 0), value.movedim(SEQUENCE_DIM, 0)), dim=1)


def _unpack_sequence_first(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The two ``[batch, heads, seq, d]`` views of a ``[seq, 2, batch, heads, d]`` tensor."""
    return packed[:, 0].movedim(0, SEQUENCE_DIM), packed[:, 1].movedim(0, SEQUENCE_DIM)


def _allgather_attention(query, key, value, cp: CPGroup, segments: CPSegments | None) -> torch.Tensor:
    """Each local query chunk over the gathered keys/values up to its own end, causal by global index.

    The keys are put in sequence order once; a query chunk ending at token e then needs
    keys ``[0, e)`` only (as Megatron-LM's all-gather CP does), so a rank computes the
    causal work and not all ``seq/cp x seq`` scores. That mask is causal aligned to the
    lower right (query row i, token ``e - chunk + i``, sees keys up to its own token):
    torch's ``causal_lower_right`` bias, which SDPA runs in a fused kernel on CUDA
    (flash or memory-efficient attention, no mask in memory) and as the same boolean
    mask elsewhere. With ``segments`` each chunk's mask is its block-causal one (``CPSegments.masks``).
    """
    # imported here: torch.nn.attention.bias imports torch._dynamo, 1.5 s of every worker's start-up otherwise
    from torch.nn.attention.bias import causal_lower_right

    local_seq = query.shape[SEQUENCE_DIM]
    gathered = _GatherKeyValue.apply(_pack_sequence_first(key, value), cp)  # tokens rank-major
    rank_major = _rank_major_positions(local_seq, cp, query.device)
    keys, values = _unpack_sequence_first(_Reorder.apply(gathered, torch.argsort(rank_major), rank_major))
    chunk = local_seq // 2
    outputs = []
    for local_index, global_chunk in enumerate(context_parallel_chunks(cp.rank, cp.size)):
        end = (global_chunk + 1) * chunk  # query row i is token end - chunk + i: it sees keys j <= end - chunk + i
        mask = causal_lower_right(chunk, end) if segments is None else segments.masks[local_index]
        outputs.append(F.scaled_dot_product_attention(_chunk(query, local_index), keys[..., :end, :],
                                                      values[..., :end, :], attn_mask=mask))
    return torch.cat(outputs, dim=SEQUENCE_DIM)


# ---------------------------------------------------------------------------
# a2a: sequence split <-> head split
# ---------------------------------------------------------------------------

class _AllToAll(torch.autograd.Function):
    """All-to-all of equal blocks along dim 0: block j goes to CP rank j, block i comes from CP rank i.

    Exchanging equal blocks is its own inverse, so the gradient takes the same all-to-all.
    """

    @staticmethod
    def forward(ctx, tensor, cp):
        ctx.cp = cp
        return _all_to_all(tensor, cp)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output):
        return _all_to_all(grad_output, ctx.cp), None


class _Reorder(torch.autograd.Function):
    """Permute dim 0 by ``order``; the gradient goes back through the ``inverse`` permutation.

    (``index_select``'s own backward scatters into a zero tensor: one more copy of the sequence.)
    """

    @staticmethod
    def forward(ctx, tensor, order, inverse):
        ctx.save_for_backward(inverse)
        return tensor.index_select(0, order)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output):
        (inverse,) = ctx.saved_tensors
        return grad_output.index_select(0, inverse), None, None


def _all_to_all(tensor: torch.Tensor, cp: CPGroup) -> torch.Tensor:
    """Equal blocks of dim 0 exchanged over the CP group (a new tensor)."""
    tensor = tensor.contiguous()
    received = torch.empty_like(tensor)
    cp.post(dist.all_to_all_single, received, tensor)
    return received


def _all_to_all_attention(query, key, value, cp: CPGroup, segments: CPSegments | None) -> torch.Tensor:
    """Ulysses: switch to ``heads / cp`` heads over the whole sequence, attend causally (block-causally under
    ``segments``: its whole-sequence mask), switch back."""
    heads = query.shape[1]
    if heads % cp.size:
        raise ValueError(f"cp_comm='a2a' needs the attention heads of a rank ({heads}, num_heads / tp) to be "
                         f"divisible by cp={cp.size}; use another cp_comm or a head count divisible by cp")
    full_query, full_key, full_value = _sequence_to_head_split((query, key, value), cp)
    if segments is None:
        attended = F.scaled_dot_product_attention(full_query, full_key, full_value, is_causal=True)
    else:
        attended = F.scaled_dot_product_attention(full_query, full_key, full_value, attn_mask=segments.masks[0])
    return _head_to_sequence_split(attended, cp)


def _sequence_to_head_split(tensors, cp: CPGroup) -> list[torch.Tensor]:
    """``[batch, heads, local_seq, d]`` each -> ``[batch, heads / cp, seq, d]`` each, tokens in sequence order.

    Head group j goes to CP rank j, sequence-first, so what comes back (every rank's tokens
    of this rank's head group) is one ``[cp * local_seq, ...]`` tensor that a single
    permutation puts in sequence order.
    """
    by_destination = torch.stack([tensor.unflatten(1, (cp.size, -1)).permute(1, 3, 0, 2, 4) for tensor in tensors],
                                 dim=2)  # [cp, local_seq, n, batch, heads/cp, d]
    by_source = _AllToAll.apply(by_destination, cp).flatten(0, 1)  # tokens rank-major
    rank_major = _rank_major_positions(by_destination.shape[1], cp, by_source.device)
    in_sequence = _Reorder.apply(by_source, torch.argsort(rank_major), rank_major)
    return [tensor.permute(1, 2, 0, 3) for tensor in in_sequence.unbind(1)]


def _head_to_sequence_split(attended: torch.Tensor, cp: CPGroup) -> torch.Tensor:
    """``[batch, heads / cp, seq, d]`` in sequence order -> ``[batch, heads, local_seq, d]`` of this rank's tokens."""
    # Sequence-first with the tokens rank-major: block j of dim 0 is rank j's tokens, what rank j gets back.
    rank_major = _rank_major_positions(attended.shape[SEQUENCE_DIM] // cp.size, cp, attended.device)
    by_destination = _Reorder.apply(attended.movedim(SEQUENCE_DIM, 0), rank_major, torch.argsort(rank_major))
    by_head_group = _AllToAll.apply(by_destination, cp)  # [cp * local_seq, batch, heads/cp, d]
    return by_head_group.unflatten(0, (cp.size, -1)).permute(2, 0, 3, 1, 4).flatten(1, 2)


# ---------------------------------------------------------------------------
# ring: key/value blocks around the CP ring, online softmax
# ---------------------------------------------------------------------------

class _RingExchange:
    """One posted exchange: ``tensor`` to the next CP rank, the previous rank's into a new buffer.

    It keeps the sent tensor alive until ``wait``, which returns the received one and lets
    go of both (so a block is freed as soon as the caller drops it).
    """

    def __init__(self, tensor: torch.Tensor, cp: CPGroup):
        self.sent, self.received, self.lanes = tensor, torch.empty_like(tensor), cp.lanes
        group = cp.lanes.communicator(cp.group)
        self.requests = dist.batch_isend_irecv([dist.P2POp(dist.isend, tensor, cp.next_rank, group),
                                                dist.P2POp(dist.irecv, self.received, cp.previous_rank, group)])

    def wait(self) -> torch.Tensor:
        """Wait for the send and the receive (the other half of a pair computing meanwhile,
        ``ppctl.parallel.lanes.Lanes.finish``); return what was received."""
        self.lanes.finish(_Requests(self.requests))
        received, self.sent, self.received, self.requests = self.received, None, None, []
        return received


class _Requests:
    """Posted point-to-point requests, waited as one."""

    def __init__(self, requests):
        self.requests = requests

    def wait(self) -> None:
        """Wait for every request."""
        for request in self.requests:
            request.wait()


def _chunk(tensor: torch.Tensor, index: int) -> torch.Tensor:
    """Local chunk ``index`` (0 or 1) of a rank's tokens (a view; dim 2 of [b, h, seq, d] and of [b, h, seq])."""
    length = tensor.shape[SEQUENCE_DIM] // 2
    return tensor.narrow(SEQUENCE_DIM, index * length, length)


def _query_tiles(rows: int, causal: bool, key_length: int):
    """``(start, stop, key_stop)`` per tile of query rows; a causal tile needs only the keys up to its last row."""
    for start in range(0, rows, RING_QUERY_TILE_ROWS):
        stop = min(start + RING_QUERY_TILE_ROWS, rows)
        yield start, stop, (stop if causal else key_length)


def _tile_scores(query, key, scale: float, start: int, causal: bool, documents=None) -> torch.Tensor:
    """Scaled scores of a query tile (rows ``start`` onwards of its chunk); causal: later keys at -inf.

    ``documents``: ``(query segments, key segments)`` of the tile's rows and keys, or None; keys of
    another document (and, causal, later keys) at -inf.
    """
    scores = torch.matmul(query, key.transpose(-1, -2)).mul_(scale)
    if documents is not None:
        seen = document_mask(*documents, start if causal else None)
        scores.masked_fill_(seen.logical_not_(), float("-inf"))
    elif causal:
        # Row i of the tile is row start+i of the chunk: key j is masked when j > start + i.
        hidden = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).triu_(start + 1)
        scores.masked_fill_(hidden, float("-inf"))
    return scores


def _merge_block(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor,
                 may_see_nothing: bool = False) -> None:
    """Fold one block's softmax-normalised output and log-sum-exp into the running ones, in place.

    ``may_see_nothing`` (documents kept apart): a row may have seen no key yet and none in this block
    (both log-sum-exps -inf); it stays exactly as it was, where ``exp(-inf - -inf)`` would make it NaN.
    """
    merged_lse = torch.logaddexp(lse, block_lse)
    reference = _finite_or_zero(merged_lse) if may_see_nothing else merged_lse
    out.mul_(torch.exp(lse - reference).unsqueeze(-1))
    out.add_(block_out * torch.exp(block_lse - reference).unsqueeze(-1))
    lse.copy_(merged_lse)


def _finite_or_zero(lse: torch.Tensor) -> torch.Tensor:
    """``lse`` with its -inf entries (rows that saw no key) at 0, to subtract from -inf scores: exp gives 0, not NaN."""
    return lse.masked_fill(lse == float("-inf"), 0.0)


def _tile_forward(query, key, value, out, lse, scale: float, start: int, causal: bool, documents=None) -> None:
    """One query tile against its visible keys, merged into the tile's running ``out``/``lse``.

    Under ``documents`` a row may see none of the tile's keys: its block log-sum-exp is -inf, its
    probabilities and output 0, and the merge leaves its running ``out``/``lse`` exactly unchanged.
    """
    compute = out.dtype
    scores = _tile_scores(query.to(compute), key.to(compute), scale, start, causal, documents)
    block_lse = torch.logsumexp(scores, dim=-1)
    shift = block_lse if documents is None else _finite_or_zero(block_lse)
    probs = scores.sub_(shift.unsqueeze(-1)).exp_()
    _merge_block(out, lse, torch.matmul(probs, value.to(compute)), block_lse, may_see_nothing=documents is not None)


def _tile_backward(query, key, value, grad_out, lse, delta, grad_query, grad_key, grad_value,
                   scale: float, start: int, causal: bool, documents=None) -> None:
    """Flash-attention backward of one query tile against its visible keys, accumulated into the gradients.

    ``lse`` is the rows' final log-sum-exp, finite (each token sees itself), so hidden keys get P = 0.
    """
    compute = grad_query.dtype
    query, key, value = query.to(compute), key.to(compute), value.to(compute)
    scores = _tile_scores(query, key, scale, start, causal, documents)
    probs = scores.sub_(lse.unsqueeze(-1)).exp_()  # P = exp(S*scale - lse)
    grad_value.add_(torch.matmul(probs.transpose(-1, -2), grad_out))  # dV += P^T dO
    grad_scores = torch.matmul(grad_out, value.transpose(-1, -2))  # dP = dO V^T
    grad_scores.sub_(delta.unsqueeze(-1)).mul_(probs)  # dS = P * (dP - D)
    grad_query.add_(torch.matmul(grad_scores, key), alpha=scale)  # dQ += scale * dS K
    grad_key.add_(torch.matmul(grad_scores.transpose(-1, -2), query), alpha=scale)  # dK += scale * dS^T Q


def _tile_documents(documents, rows: slice, keys: slice):
    """The ``(query, key)`` segment ids ``[batch, n]`` of a tile's rows and keys, or None without documents."""
    return None if documents is None else (documents[0][:, rows], documents[1][:, keys])


def _pair_forward(query, key, value, out, lse, scale: float, causal: bool, documents=None) -> None:
    """Attend one query chunk to one key chunk, tile by tile, merging into its running ``out``/``lse``.

    ``documents``: the chunks' ``(query, key)`` segment ids ``[batch, chunk]`` (documents kept apart), or None.
    """
    for start, stop, key_stop in _query_tiles(query.shape[-2], causal, key.shape[-2]):
        _tile_forward(query[..., start:stop, :], key[..., :key_stop, :], value[..., :key_stop, :],
                      out[..., start:stop, :], lse[..., start:stop], scale, start, causal,
                      _tile_documents(documents, slice(start, stop), slice(0, key_stop)))


def _pair_backward(query, key, value, grad_out, lse, delta, grad_query, grad_key, grad_value,
                   scale: float, causal: bool, documents=None) -> None:
    """Backward of one (query chunk, key chunk) pair, tile by tile, accumulated into the gradient buffers."""
    for start, stop, key_stop in _query_tiles(query.shape[-2], causal, key.shape[-2]):
        rows, keys = slice(start, stop), slice(0, key_stop)
        _tile_backward(query[..., rows, :], key[..., keys, :], value[..., keys, :], grad_out[..., rows, :],
                       lse[..., rows], delta[..., rows], grad_query[..., rows, :], grad_key[..., keys, :],
                       grad_value[..., keys, :], scale, start, causal, _tile_documents(documents, rows, keys))


def _ring_pairs(cp: CPGroup, step: int, segments: CPSegments | None):
    """``(local query chunk, local key chunk, causal, documents)`` of each pair this rank computes at ``step``.

    ``documents``: the pair's ``(query, key)`` segment ids under ``segments``, else None; pairs in which
    no query sees a key of its own document are skipped (``CPSegments.visible_pairs``).
    """
    visible = None if segments is None else segments.visible_pairs
    query_chunks = context_parallel_chunks(cp.rank, cp.size)
    key_chunks = context_parallel_chunks(ring_block_owner(cp.rank, cp.size, step), cp.size)
    for q_local, k_local, mask in ring_step_pairs(cp.rank, cp.size, step, visible):
        documents = None if segments is None else segments.ring_documents(query_chunks[q_local], key_chunks[k_local])
        yield q_local, k_local, mask == "causal", documents


def _ring_forward(query, key, value, cp: CPGroup, scale: float,
                  segments: CPSegments | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Output (compute dtype) and log-sum-exp of this rank's queries, one key/value block per ring step."""
    compute = _compute_dtype(query.dtype)
    out = torch.zeros(query.shape, dtype=compute, device=query.device)
    lse = torch.full(query.shape[:-1], float("-inf"), dtype=compute, device=query.device)
    block = torch.stack((key, value))  # keys and values travel as one message
    for step in range(cp.size):
        # Post the next block's exchange first, so it travels while this one is computed.
        exchange = _RingExchange(block, cp) if step < cp.size - 1 else None
        for q_local, k_local, causal, documents in _ring_pairs(cp, step, segments):
            _pair_forward(_chunk(query, q_local), _chunk(block[0], k_local), _chunk(block[1], k_local),
                          _chunk(out, q_local), _chunk(lse, q_local), scale, causal, documents)
        if exchange is not None:
            block = exchange.wait()
    return out, lse


def _ring_backward(grad_out, query, key, value, out, lse, cp: CPGroup, scale: float,
                   segments: CPSegments | None = None):
    """Gradients of query, key and value: blocks go around the ring again with their dK/dV accumulators.

    The accumulator of a block starts at its owner, gains each rank's contribution as it
    passes, and after ``cp`` hops is back at the owner, complete.
    """
    compute = lse.dtype
    grad_out = grad_out.to(compute)
    delta = (grad_out * out.to(compute)).sum(dim=-1)  # D = rowsum(dO * O)
    grad_query = torch.zeros(query.shape, dtype=compute, device=query.device)
    block, grad_exchange = torch.stack((key, value)), None
    for step in range(cp.size):
        block_exchange = _RingExchange(block, cp) if step < cp.size - 1 else None
        partial = torch.zeros(block.shape, dtype=compute, device=block.device)
        for q_local, k_local, causal, documents in _ring_pairs(cp, step, segments):
            _pair_backward(_chunk(query, q_local), _chunk(block[0], k_local), _chunk(block[1], k_local),
                           _chunk(grad_out, q_local), _chunk(lse, q_local), _chunk(delta, q_local),
                           _chunk(grad_query, q_local), _chunk(partial[0], k_local), _chunk(partial[1], k_local),
                           scale, causal, documents)
        # This block's accumulator from the previous ranks arrived while we computed our part of it.
        accumulated = partial if grad_exchange is None else grad_exchange.wait().add_(partial)
        grad_exchange = _RingExchange(accumulated, cp)
        del partial, accumulated  # the exchange holds the accumulator; free the rest before the next step
        if block_exchange is not None:
            block = block_exchange.wait()
    grad_key, grad_value = grad_exchange.wait().to(query.dtype).unbind(0)
    return grad_query.to(query.dtype), grad_key, grad_value


class _RingAttention(torch.autograd.Function):
    """Ring attention: forward and backward each pass every key/value block once around the CP ring."""

    @staticmethod
    def forward(ctx, query, key, value, cp, segments=None):
        scale = 1.0 / math.sqrt(query.shape[-1])
        out, lse = _ring_forward(query, key, value, cp, scale, segments)
        out = out.to(query.dtype)
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.cp, ctx.scale, ctx.segments = cp, scale, segments
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        query, key, value, out, lse = ctx.saved_tensors
        return (*_ring_backward(grad_out, query, key, value, out, lse, ctx.cp, ctx.scale, ctx.segments), None, None)
