"""Where a rank's tensors sit in the layout-independent checkpoint: rectangles of global tensors.

A checkpoint stores every parameter (and its optimizer state) as the dense tensor a
single process would hold, by global name, with the vocabulary unpadded. A rank holds
pieces of it: its TP shard of a parameter, and with the distributed optimizer a
contiguous range of that shard's flattened elements. This module describes each piece
as rectangles of the global tensor (offsets and sizes), which is what
``torch.distributed.checkpoint`` needs to write shards and to read any other layout's
shards back: its load plan reads, for each rectangle a rank asks for, the overlapping
parts of whatever rectangles were saved.

How TP shards map. Each TP rule splits one dimension of a "checkpoint view" of the
tensor into ``tp`` contiguous blocks: rows (dim 0) for column-parallel weights and the
vocabulary, columns (dim 1) for row-parallel weights. The fused QKV weight
``[3 * hidden, h]`` is viewed as ``[3, hidden, h]``: each TP rank's heads of q, k and v
are then one block of dim 1. Vocabulary rows beyond ``vocab_size`` (TP padding) are cut
off: they are not part of the model. An expert parameter under expert parallelism (``[E / ep, ...]``,
not split by TP) is block ``ep_rank`` of dim 0, its experts: a checkpoint saved at one ep reads
back at any other.

A flat range of a row-major tensor is a union of at most ``2 * ndim - 1`` rectangles,
each itself a contiguous flat range (a partial row, whole rows, a partial row, recursively),
so a piece of a flat optimizer shard is described without copying.

Pure: torch tensors only (views), no process group.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ppctl.model.rules import COLUMNS, QKV_ROWS, REPLICATED, ROWS, ParameterRule


@dataclass(frozen=True)
class Rectangle:
    """Elements ``[offsets, offsets + sizes)`` of a tensor, which are flat elements ``[flat_start, flat_start + numel)``
    of the row-major tensor they were cut from."""

    flat_start: int
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def numel(self) -> int:
        """Elements in the rectangle."""
        return math.prod(self.sizes)


@dataclass(frozen=True)
class Piece:
    """A tensor holding rectangle ``offsets`` (its own shape gives the sizes) of global tensor ``name``."""

    offsets: tuple[int, ...]
    tensor: torch.Tensor


@dataclass(frozen=True)
class CheckpointView:
    """How a TP shard of shape ``local_shape`` sits in the global tensor.

    ``view_shape``: the shard reshaped (row-major, no copy) so that the TP split is one
    block of dimension ``split_dim`` (None: replicated); ``global_shape``: the stored
    tensor in the same view, vocabulary unpadded; ``block_offset``: where this TP rank's
    block starts along ``split_dim``.
    """

    view_shape: tuple[int, ...]
    global_shape: tuple[int, ...]
    split_dim: int | None
    block_offset: int


def checkpoint_view(rule: ParameterRule, local_shape: tuple[int, ...], tp_size: int, tp_rank: int,
                    vocab_size: int, ep_size: int = 1, ep_rank: int = 0) -> CheckpointView:
    """The checkpoint view of TP rank ``tp_rank``'s shard (shape ``local_shape``) of a parameter of ``rule``; of an
    expert parameter, EP rank ``ep_rank``'s experts."""
    view = tuple(local_shape)
    if rule.experts and ep_size > 1:
        return CheckpointView(view, (view[0] * ep_size, *view[1:]), 0, ep_rank * view[0])
    if rule.split == QKV_ROWS:
        view = (3, local_shape[0] // 3, *local_shape[1:])
    split_dim = {ROWS: 0, COLUMNS: 1, QKV_ROWS: 1, REPLICATED: None}[rule.split]
    if split_dim is None or tp_size == 1:
        global_shape, block_offset = list(view), 0
    else:
        global_shape = list(view)
        global_shape[split_dim] *= tp_size
        block_offset = tp_rank * view[split_dim]
    if rule.vocab_rows:
        global_shape[0] = vocab_size  # padded rows are no part of the model
    return CheckpointView(view, tuple(global_shape), split_dim, block_offset)


def flat_rectangles(shape: tuple[int, ...], start: int, end: int) -> list[Rectangle]:
    """Flat elements ``[start, end)`` of a row-major tensor of ``shape`` as rectangles, in flat order."""
    if not 0 <= start <= end <= math.prod(shape):
        raise ValueError(f"flat range [{start}, {end}) outside a tensor of shape {tuple(shape)}")
    if start == end:
        return []
    if len(shape) <= 1:
        return [Rectangle(start, (start,), (end - start,))]
    inner = math.prod(shape[1:])
    first_row, last_row = start // inner, (end - 1) // inner
    if first_row == last_row:  # inside one row: recurse into it
        return [_in_row(rect, first_row, inner) for rect in flat_rectangles(shape[1:], start - first_row * inner,
                                                                            end - first_row * inner)]
    rectangles = []
    whole_start, whole_end = math.ceil(start / inner), end // inner
    if start % inner:
        rectangles += flat_rectangles(shape, start, whole_start * inner)
    if whole_start < whole_end:
        rectangles.append(Rectangle(whole_start * inner, (whole_start,) + (0,) * (len(shape) - 1),
                                    (whole_end - whole_start, *shape[1:])))
    if end % inner:
        rectangles += flat_rectangles(shape, whole_end * inner, end)
    return rectangles


def _in_row(rect: Rectangle, row: int, inner: int) -> Rectangle:
    """A rectangle of row ``row``'s sub-tensor, lifted into the whole tensor."""
    return Rectangle(rect.flat_start + row * inner, (row, *rect.offsets), (1, *rect.sizes))


def global_pieces(view: CheckpointView, flat: torch.Tensor, flat_start: int) -> list[Piece]:
    """The pieces of the global tensor that ``flat`` holds: elements ``[flat_start, flat_start + flat.numel())``
    of the flattened TP shard described by ``view`` (views of ``flat``, no copy)."""
    pieces = []
    for rect in flat_rectangles(view.view_shape, flat_start, flat_start + flat.numel()):
        begin = rect.flat_start - flat_start
        tensor = flat[begin:begin + rect.numel].view(rect.sizes)
        offsets = list(rect.offsets)
        if view.split_dim is not None:
            offsets[view.split_dim] += view.block_offset
        kept_rows = min(rect.sizes[0], view.global_shape[0] - offsets[0])  # drop padded vocabulary rows
        if kept_rows > 0:
            pieces.append(Piece(tuple(offsets), tensor[:kept_rows]))
    return pieces


def parameter_pieces(rule: ParameterRule, tensor: torch.Tensor, tp_size: int, tp_rank: int, vocab_size: int,
                     flat_start: int = 0, local_shape: tuple[int, ...] | None = None, ep_size: int = 1,
                     ep_rank: int = 0) -> tuple[tuple[int, ...], list[Piece]]:
    """``(global shape, pieces)`` of a TP shard (an EP rank's experts) of a parameter of ``rule``, or of a flat range
    of it.

    ``tensor`` is the whole shard (``local_shape`` None), or a 1-D range of its flattened
    elements starting at ``flat_start`` (``local_shape`` is then the shard's shape).
    """
    shape = tuple(tensor.shape) if local_shape is None else tuple(local_shape)
    view = checkpoint_view(rule, shape, tp_size, tp_rank, vocab_size, ep_size, ep_rank)
    return view.global_shape, global_pieces(view, tensor.view(-1), flat_start)
