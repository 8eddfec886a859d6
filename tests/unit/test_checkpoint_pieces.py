"""The checkpoint's rectangles: flat ranges cut into rectangles, and TP shards placed in the dense tensor.

The property that resharding rests on: the pieces of every TP rank (whole shards, or
any cut of their flattened elements into ranges, as the distributed optimizer makes)
tile the dense, unpadded tensor exactly once, each with the right values.
"""

import math

import pytest
import torch

from ppctl.checkpoint.pieces import checkpoint_view, flat_rectangles, parameter_pieces
from ppctl.model.gpt.rules import gpt_rule
from ppctl.model.rules import dense_to_tp_shard
from ppctl.parallel.tensor_parallel import TPGroup

SHAPES = [(7,), (3, 5), (2, 3, 4), (4, 1, 3)]


@pytest.mark.parametrize("shape", SHAPES)
def test_flat_range_is_contiguous_rectangles_in_order(shape):
    numel = math.prod(shape)
    values = torch.arange(numel).view(shape)
    for start in range(numel + 1):
        for end in range(start, numel + 1):
            rectangles = flat_rectangles(shape, start, end)
            covered = []
            for rect in rectangles:
                window = values[tuple(slice(o, o + s) for o, s in zip(rect.offsets, rect.sizes))].reshape(-1)
                assert window.tolist() == list(range(rect.flat_start, rect.flat_start + rect.numel))
                covered += window.tolist()
            assert covered == list(range(start, end))
            assert len(rectangles) <= 2 * len(shape) - 1


def test_flat_range_outside_the_tensor_is_refused():
    with pytest.raises(ValueError, match="outside a tensor of shape"):
        flat_rectangles((2, 3), 4, 7)


def test_qkv_view_gives_each_rank_one_block_of_heads():
    view = checkpoint_view(gpt_rule("layers.0.attention.qkv.weight"), (12, 8), tp_size=2, tp_rank=1, vocab_size=257)
    assert (view.view_shape, view.global_shape, view.split_dim, view.block_offset) == ((3, 4, 8), (3, 8, 8), 1, 4)


def test_vocabulary_rows_are_unpadded():
    view = checkpoint_view(gpt_rule("embedding.word.weight"), (192, 8), tp_size=2, tp_rank=1, vocab_size=257)
    assert view.global_shape == (257, 8) and view.block_offset == 192


NAMES = ["embedding.word.weight", "embedding.position.weight", "layers.3.attention.qkv.weight",
         "layers.3.attention.qkv.bias", "layers.3.attention.proj.weight", "layers.3.mlp.fc_in.weight", "layers.3.mlp.fc_in.bias",
         "layers.3.mlp.fc_out.weight", "final_norm.bias", "output_layer.weight"]
DENSE_SHAPES = {"embedding.word.weight": (20, 8), "embedding.position.weight": (6, 8),
                "layers.3.attention.qkv.weight": (24, 8), "layers.3.attention.qkv.bias": (24,),
                "layers.3.attention.proj.weight": (8, 8),
                "layers.3.mlp.fc_in.weight": (16, 8), "layers.3.mlp.fc_in.bias": (16,),
                "layers.3.mlp.fc_out.weight": (8, 16), "final_norm.bias": (8,), "output_layer.weight": (20, 8)}
VOCAB = 17  # the vocabulary tables have 20 rows: 3 padded


def _place(global_tensor, count, pieces):
    for piece in pieces:
        index = tuple(slice(o, o + s) for o, s in zip(piece.offsets, piece.tensor.shape))
        global_tensor[index] = piece.tensor.reshape(global_tensor[index].shape)
        count[index] += 1


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("cut", [None, 5, 11])
def test_tp_shards_and_their_flat_ranges_tile_the_dense_tensor_once(name, tp, cut):
    dense = torch.randn(DENSE_SHAPES[name], dtype=torch.float64)
    if name in ("embedding.word.weight", "output_layer.weight"):
        dense[VOCAB:] = 0.0
    expected = dense.reshape(3, -1, *dense.shape[1:]) if "qkv" in name else dense
    expected = expected[:VOCAB] if name in ("embedding.word.weight", "output_layer.weight") else expected
    rebuilt, count = torch.zeros_like(expected), torch.zeros(expected.shape, dtype=torch.int64)
    shape = None
    for rank in range(tp):
        shard = dense_to_tp_shard(gpt_rule(name), dense, TPGroup(None, tp, rank)).contiguous()
        if cut is None:  # the whole shard (model parameters, plain optimizer state)
            shape, pieces = parameter_pieces(gpt_rule(name), shard, tp, rank, VOCAB)
            _place(rebuilt, count, pieces)
            continue
        flat = shard.reshape(-1)  # distributed optimizer: ranges of the flattened shard
        for start in range(0, flat.numel(), cut):
            shape, pieces = parameter_pieces(gpt_rule(name), flat[start:start + cut], tp, rank, VOCAB, flat_start=start,
                                             local_shape=tuple(shard.shape))
            _place(rebuilt, count, pieces)
    assert shape == tuple(expected.shape)
    # Every TP rank holds a replicated parameter whole: the same rectangles, which DCP keeps once.
    copies = tp if gpt_rule(name).tp_replicated else 1
    assert torch.equal(count, torch.full_like(count, copies)), "a rectangle is missing or doubled"
    assert torch.equal(rebuilt, expected)


def test_pieces_are_views_so_loading_writes_through():
    shard = torch.zeros(4, 8)
    _shape, pieces = parameter_pieces(gpt_rule("layers.0.mlp.fc_in.weight"), shard, 2, 0, VOCAB)
    pieces[0].tensor.fill_(3.0)
    assert shard.eq(3.0).all()
