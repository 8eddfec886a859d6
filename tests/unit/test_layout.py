"""Layout math: coordinates, every group kind, order variants and the layer map."""

import itertools
import re

import pytest

from ppctl.parallel.layout import (
    GROUP_NAMES,
    LayoutError,
    ParallelLayout,
    context_parallel_chunks,
    context_parallel_positions,
    context_parallel_slices,
    layer_map,
    even_pipeline_layout,
    parse_pipeline_layout,
    split_layers,
)
from ppctl.parallel.placement import Placement, looped_placement, v_placement

SHAPES = [
    (1, 1, 1, 1), (2, 1, 1, 1), (1, 1, 2, 1), (1, 1, 1, 4), (2, 1, 2, 2), (2, 2, 2, 2),
    (4, 1, 2, 2), (1, 2, 3, 2), (8, 1, 4, 4), (3, 1, 5, 2),
]
ORDERS = ["tp-cp-dp-pp", "tp-dp-cp-pp", "tp-pp-dp-cp", "pp-dp-cp-tp", "dp-tp-pp-cp"]


def test_megatron_documented_example():
    # initialize_model_parallel's docstring: 16 GPUs, TP=2, PP=4 (so DP=2).
    layout = ParallelLayout(tp=2, pp=4, dp=2)
    assert layout.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]]
    assert layout.groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    assert layout.groups("pp") == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
    assert layout.groups("embedding") == [[0, 12], [1, 13], [2, 14], [3, 15]]
    assert layout.groups("tp_pp")[0] == [0, 1, 4, 5, 8, 9, 12, 13]


def test_megatron_example_with_cp():
    # TP=2, CP=2, DP=2, PP=2 on 16 ranks with the default order tp-cp-dp-pp.
    layout = ParallelLayout(tp=2, cp=2, dp=2, pp=2)
    assert layout.groups("cp")[:2] == [[0, 2], [1, 3]]
    assert layout.groups("dp")[:2] == [[0, 4], [1, 5]]
    assert layout.groups("dp_cp")[0] == [0, 2, 4, 6]
    assert layout.groups("tp_cp")[0] == [0, 1, 2, 3]
    assert layout.groups("pp")[0] == [0, 8]


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("shape", SHAPES)
def test_groups_partition_and_agree_with_coords(shape, order):
    tp, cp, dp, pp = shape
    layout = ParallelLayout(tp=tp, cp=cp, dp=dp, pp=pp, order=order)
    world = layout.world_size
    assert world == tp * cp * dp * pp
    for rank in range(world):
        assert layout.rank(**layout.coords(rank)) == rank
    for name in GROUP_NAMES:
        groups = layout.groups(name)
        if name != "embedding":
            assert sorted(itertools.chain(*groups)) == list(range(world))
        for group in groups:
            for rank in group:
                assert layout.group_of(name, rank) == group
    for name, dims in [("tp", {"tp"}), ("dp_cp", {"dp", "cp"}), ("tp_pp", {"tp", "pp"})]:
        for group in layout.groups(name):
            coords = [layout.coords(rank) for rank in group]
            for dim in {"tp", "cp", "dp", "pp"} - dims:
                assert len({c[dim] for c in coords}) == 1  # fixed dims are constant
            assert len({tuple(c[d] for d in sorted(dims)) for c in coords}) == len(group)
    assert layout.groups("replica") == layout.groups("dp_cp")  # one parameter copy: the replicas are dp x cp


def test_order_changes_which_ranks_are_neighbours():
    default = ParallelLayout(tp=2, dp=2, pp=2)
    dp_first = ParallelLayout(tp=2, dp=2, pp=2, order="dp-tp-cp-pp")
    assert default.groups("tp")[0] == [0, 1]
    assert dp_first.groups("tp")[0] == [0, 2]
    assert dp_first.groups("dp")[0] == [0, 1]
    assert default.coords(5) == {"tp": 1, "cp": 0, "dp": 0, "pp": 1}


@pytest.mark.parametrize("order", ["tp-dp-pp", "tp-tp-dp-pp", "tp-cp-dp-xx"])
def test_bad_order_refused(order):
    with pytest.raises(LayoutError, match="parallel.order"):
        ParallelLayout(order=order)


def test_bad_sizes_and_ranks_refused():
    with pytest.raises(LayoutError, match="parallel.tp"):
        ParallelLayout(tp=0)
    with pytest.raises(LayoutError, match="outside"):
        ParallelLayout(tp=2).coords(2)


def test_large_layout_is_cheap():
    layout = ParallelLayout(tp=8, pp=16, dp=128)
    assert layout.world_size == 16384
    groups = layout.all_groups()
    assert len(groups["tp"]) == 2048 and len(groups["pp"][0]) == 16


def test_even_split_and_divisibility():
    assert split_layers(8, 4) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    with pytest.raises(LayoutError, match="divisible"):
        split_layers(7, 2)


def test_vpp_layer_map_matches_megatron_interleaving():
    # Megatron's documented example: 16 layers, pp=4, vpp=2 -> rank 0 holds layers 0-1 and 8-9.
    layers = layer_map(16, pp=4, chunks_per_rank=2)
    assert layers[(0, 0)].layers == (0, 1) and layers[(0, 1)].layers == (8, 9)
    assert layers[(3, 0)].layers == (6, 7) and layers[(3, 1)].layers == (14, 15)
    assert layers[(0, 0)].pre_process and not layers[(0, 1)].pre_process
    assert layers[(3, 1)].post_process and not layers[(3, 0)].post_process
    assert sorted(l for chunk in layers.values() for l in chunk.layers) == list(range(16))


def test_v_shaped_placement_layer_map():
    placement = Placement(tuple(min(s, 2 * 2 - 1 - s) for s in range(4)))  # V: rank r holds r and 2pp-1-r
    layers = layer_map(8, pp=2, chunks_per_rank=2, placement=placement)
    assert layers[(0, 0)].layers == (0, 1) and layers[(0, 1)].layers == (6, 7)
    assert layers[(0, 1)].post_process and layers[(0, 0)].pre_process


def test_pipeline_layout_string():
    assert parse_pipeline_layout("Ettt|tttt|t|tL", 9, 4) == [[0, 1, 2], [3, 4, 5, 6], [7], [8]]
    assert parse_pipeline_layout("Et*3|t*2L", 5, 2) == [[0, 1, 2], [3, 4]]
    with pytest.raises(LayoutError, match="places 8"):
        parse_pipeline_layout("Ettt|tttttL", 9, 2)
    with pytest.raises(LayoutError, match="3 stages"):
        parse_pipeline_layout("Et|t|tL", 3, 2)
    with pytest.raises(LayoutError, match="first stage"):
        parse_pipeline_layout("tt|EtL", 3, 2)
    with pytest.raises(LayoutError, match="unexpected"):
        parse_pipeline_layout("Etx|tL", 2, 2)


@pytest.mark.parametrize("text,num_layers,stages,expected", [
    ("E(tt|)*7tL", 15, 8, [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14]]),
    ("E((t|)*2t|)*2tL", 7, 7, [[0], [1], [2], [3], [4], [5], [6]]),
    ("Et||tL", 2, 3, [[0], [], [1]]),  # an empty stage passes its input on
    ("E|t*3|L", 3, 3, [[], [0, 1, 2], []]),
    (" E t | t L ", 2, 2, [[0], [1]]),
    ("(t|)*3tL", 4, 4, [[0], [1], [2], [3]]),  # E may be left implicit
])
def test_pipeline_layout_groups_repeats_and_empty_stages(text, num_layers, stages, expected):
    assert parse_pipeline_layout(text, num_layers, stages) == expected


@pytest.mark.parametrize("text,words", [
    ("E(tt|tL", "unbalanced parentheses"), ("E(tt|)tL", "a group without \\*N"), ("Ett)|tL", "unbalanced"),
    ("(t)*99999999|L", "expands to more than 1,000,000"), ("t*99999999|L", "expands to more than"),
    ("EtE|t|tL", "E and L may appear once each"), ("Et|Lt|tL", "L \\(loss\\) must be in the last stage"),
    ("Et|t*2x|L", "unexpected 'x'"),
])
def test_bad_pipeline_layouts_say_what_is_wrong(text, words):
    with pytest.raises(LayoutError, match=words):
        parse_pipeline_layout(text, 3, 3)


@pytest.mark.parametrize("num_layers,stages,embedding,loss,expected", [
    (6, 4, True, True, "Et|tt|tt|tL"), (7, 4, True, False, "Et|tt|tt|ttL"), (7, 4, False, True, "Ett|tt|tt|tL"),
    (2, 4, True, True, "E|t|t|L"), (3, 1, True, False, "EtttL"),
])
def test_even_split_counting_embedding_and_loss_as_layers(num_layers, stages, embedding, loss, expected):
    text = even_pipeline_layout(num_layers, stages, embedding, loss)
    assert text == expected
    assert sum(map(len, parse_pipeline_layout(text, num_layers, stages))) == num_layers
    if stages > 1:
        with pytest.raises(LayoutError, match="must be divisible by the number of pipeline stages"):
            even_pipeline_layout(num_layers + 1, stages, embedding, loss)


def test_middle_stage_is_in_no_embedding_group():
    layout = ParallelLayout(pp=4)
    assert layout.group_of("embedding", 0) == [0, 3]
    assert layout.group_of("embedding", 1) == [] and layout.group_of("embedding", 2) == []


# --- the stage placement is the layout's, and everything placement-dependent follows it ----------

def test_v_placement_puts_embedding_and_loss_on_rank_zero():
    layout = ParallelLayout(tp=2, dp=2, pp=4, vpp=2, placement=v_placement(4))
    assert layout.placement.first_stage_rank == 0 and layout.placement.last_stage_rank == 0
    assert layout.placement.embedding_pp_ranks == [0]
    # one embedding group per pipeline, holding only that pipeline's pp rank 0
    assert layout.groups("embedding") == [[rank] for rank in range(4)]
    assert layout.group_of("embedding", 0) == [0] and layout.group_of("embedding", 12) == []
    assert layout.placement.stages_of(0) == (0, 7) and layout.placement.stages_of(3) == (3, 4)
    layers = layout.layer_map(16)
    assert layers[(0, 0)].pre_process and layers[(0, 1)].post_process
    assert layers[(0, 1)].stage == 7 and layers[(3, 1)].stage == 4 and layers[(3, 1)].layers == (8, 9)


def test_looped_placement_is_the_default_and_a_bad_placement_is_refused():
    layout = ParallelLayout(pp=4, vpp=2)
    assert layout.placement == looped_placement(4, 2) and layout.placement.stages_of(1) == (1, 5)
    assert layout.placement.embedding_pp_ranks == [0, 3] and layout.placement.last_stage_rank == 3
    with pytest.raises(LayoutError, match="does not put 2 of 8 stages on each of 4 pp ranks"):
        ParallelLayout(pp=4, vpp=2, placement=Placement((0, 0, 1, 1, 2, 2, 3, 0)))
    with pytest.raises(LayoutError, match="must be a Placement"):
        ParallelLayout(pp=2, placement=(0, 1))


@pytest.mark.parametrize("tp, dp, pp", [(1, 1, 2), (2, 2, 4), (1, 3, 6), (2, 1, 8)])
def test_dualpipe_two_copies_mirror_ranks_hold_the_same_parameters(tp, dp, pp):
    layout = ParallelLayout(tp=tp, dp=dp, pp=pp, vpp=2, placement=v_placement(pp, copies=2))
    assert layout.placement.stages_per_copy == pp and layout.placement.loss_pp_ranks == [0, pp - 1]
    layers = layout.layer_map(2 * pp)
    for pp_rank in range(pp):
        mirror = pp - 1 - pp_rank
        assert layout.replica_pp_ranks(pp_rank) == sorted({pp_rank, mirror})
        # copy 0 holds model stage r, copy 1 model stage pp-1-r: the mirror rank holds the same two
        assert layers[(pp_rank, 0)].stage == pp_rank and layers[(pp_rank, 0)].layers == (2 * pp_rank, 2 * pp_rank + 1)
        assert layers[(pp_rank, 1)].layers == layers[(mirror, 0)].layers
        assert layout.placement.copy_of(layers[(pp_rank, 1)].stage) == 1
        assert layers[(pp_rank, 0)].pre_process == (pp_rank == 0) == layers[(pp_rank, 1)].post_process
    # replicas: every dp rank of both mirror pp ranks, same tp rank; a partition of the world
    for group in layout.groups("replica"):
        coords = [layout.coords(rank) for rank in group]
        assert len(group) == 2 * dp and len({c["tp"] for c in coords}) == 1
        assert {c["pp"] for c in coords} == {coords[0]["pp"], pp - 1 - coords[0]["pp"]}
    assert sorted(itertools.chain(*layout.groups("replica"))) == list(range(layout.world_size))
    # each end rank holds one copy's embedding and the other's output layer: its tie is local
    assert layout.placement.embedding_pp_ranks == [0, pp - 1]
    for rank in range(layout.world_size):
        tied = layout.group_of("embedding", rank)
        assert tied == ([rank] if layout.coords(rank)["pp"] in (0, pp - 1) else [])
    assert len(layout.groups("embedding")) == 2 * tp * dp


def test_copies_must_divide_the_stages():
    with pytest.raises(LayoutError, match="3 pipeline stages cannot hold 2 model copies"):
        ParallelLayout(pp=3, placement=Placement((0, 1, 2), copies=2))


# --- context parallelism: the tokens of each CP rank ---------------------------------------

@pytest.mark.parametrize("cp", [1, 2, 3, 4, 8])
def test_context_parallel_slices_cover_the_sequence_once_with_equal_causal_work(cp):
    seq_length = 2 * cp * 3
    held = [context_parallel_positions(seq_length, rank, cp) for rank in range(cp)]
    assert sorted(itertools.chain(*held)) == list(range(seq_length))
    assert {len(positions) for positions in held} == {seq_length // cp}
    # Under a causal mask token i attends to i + 1 keys: every rank must do the same work.
    assert len({sum(position + 1 for position in positions) for positions in held}) == 1


def test_context_parallel_chunks_and_slices_by_example():
    assert context_parallel_chunks(0, 1) == (0,)
    assert [context_parallel_chunks(rank, 4) for rank in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert context_parallel_slices(16, 1, 2) == (range(4, 8), range(8, 12))
    assert context_parallel_positions(8, 0, 2) == [0, 1, 6, 7]
    with pytest.raises(LayoutError, match="sequence length 12 must be a multiple of 2\\*cp = 8"):
        context_parallel_slices(12, 0, 4)
    with pytest.raises(LayoutError, match="cp_rank=2 out of range"):
        context_parallel_chunks(2, 2)


def layouts_of_every_kind():
    """Every shape and order with the looped placement, and (even pp) the V placement with one and two copies."""
    for (tp, cp, dp, pp), order in itertools.product(SHAPES, ORDERS):
        yield ParallelLayout(tp=tp, cp=cp, dp=dp, pp=pp, order=order)
        if pp % 2 == 0:
            for copies in (1, 2):
                yield ParallelLayout(tp=tp, cp=cp, dp=dp, pp=pp, vpp=2, order=order,
                                     placement=v_placement(pp, copies=copies))


def test_group_counts_sizes_and_end_groups_agree_with_the_listing():
    """What a summary of a huge layout uses (counts, sizes, the first and last group, met one rank at a time)
    is exactly what the full listing gives."""
    for layout in layouts_of_every_kind():
        for name in GROUP_NAMES:
            groups = layout.groups(name)
            assert layout.group_count(name) == len(groups), (layout, name)
            assert {len(group) for group in groups} == {layout.group_size(name)}, (layout, name)
            first, last = layout.end_group_ranks(name)
            assert list(layout.iter_group(name, first)) == groups[0], (layout, name)
            assert list(layout.iter_group(name, last)) == groups[-1], (layout, name)
            assert list(layout.iter_group(name, last, descending=True)) == groups[-1][::-1], (layout, name)


def test_a_huge_group_is_met_lazily():
    """Ten million ranks in one dp group: its ends come at once, without building the group."""
    import time

    layout = ParallelLayout(tp=2, dp=10_000_000, pp=2)
    started = time.monotonic()
    members = layout.iter_group("dp", layout.world_size - 1, descending=True)
    assert [next(members) for _ in range(3)] == [39_999_999, 39_999_997, 39_999_995]
    assert layout.group_count("dp") == 4 and layout.group_size("dp") == 10_000_000
    assert time.monotonic() - started < 0.1


# --- the expert view (MoE parallel folding) ---------------------------------------------------------------------------

EXPERT_SHAPES = [  # (tp, cp, dp, pp, ep, etp)
    (1, 1, 2, 2, 2, 1), (1, 1, 4, 2, 2, 1), (1, 1, 4, 1, 4, 1), (2, 1, 2, 2, 2, 1), (2, 2, 2, 2, 4, 1),
    (2, 1, 4, 3, 2, 2), (1, 2, 3, 2, 3, 1),
]


@pytest.mark.parametrize("shape", EXPERT_SHAPES)
def test_expert_groups_fold_each_stage_and_keep_the_pipeline_groups(shape):
    tp, cp, dp, pp, ep, etp = shape
    layout = ParallelLayout(tp=tp, cp=cp, dp=dp, pp=pp, ep=ep, etp=etp)
    world = layout.world_size
    assert layout.edp == tp * cp * dp // (ep * etp)
    for name, size in (("ep", ep), ("edp", layout.edp), ("expert_replica", layout.edp)):
        groups = layout.groups(name)
        assert sorted(itertools.chain(*groups)) == list(range(world)), name  # a partition
        assert all(len(group) == size == layout.group_size(name) for group in groups), name
        assert layout.group_count(name) == len(groups)
        for group in groups:
            assert len({layout.coords(rank)["pp"] for rank in group}) == 1, name  # inside one stage
            for rank in group:
                assert layout.group_of(name, rank) == group
        first, last = layout.end_group_ranks(name)
        assert list(layout.iter_group(name, first)) == groups[0] and list(layout.iter_group(name, last)) == groups[-1]
    for rank in range(world):
        coords = layout.expert_coords(rank)
        assert layout.expert_rank(**coords) == rank
        # a stage's ranks, read in the dense order, enumerate etp fastest, then ep, then edp (Megatron's fold)
        index = rank % (tp * cp * dp)
        assert index == coords["etp"] + etp * (coords["ep"] + ep * coords["edp"])
        # ranks of one ep group hold different experts; of one edp group the same
        assert [layout.experts_of(other, 8 * ep)[0] for other in layout.group_of("ep", rank)] == \
            [8 * index for index in range(ep)]
        assert {layout.experts_of(other, 8 * ep) for other in layout.group_of("edp", rank)} == \
            {layout.experts_of(rank, 8 * ep)}
    assert set(layout.group_names) == set(GROUP_NAMES) | {"ep", "edp", "expert_replica"}


def test_expert_groups_megatron_example():
    # 8 ranks, dp=4 pp=2, ep=2: EP groups of consecutive data-parallel ranks, EDP groups strided by ep.
    layout = ParallelLayout(dp=4, pp=2, ep=2)
    assert layout.groups("ep") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.groups("edp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert ParallelLayout(dp=4, pp=2).group_names == GROUP_NAMES


def test_expert_replica_joins_dualpipe_mirror_ranks():
    placement = Placement(owners=(0, 1, 1, 0), copies=2)
    layout = ParallelLayout(dp=4, pp=2, vpp=2, placement=placement, ep=2)
    assert layout.group_of("expert_replica", 0) == [0, 2, 4, 6]
    assert layout.group_of("expert_replica", 5) == [1, 3, 5, 7]
    assert layout.groups("expert_replica") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert layout.end_group_ranks("expert_replica") == (0, 1)


@pytest.mark.parametrize("kwargs, message", [
    (dict(dp=4, pp=2, ep=2, order="tp-cp-pp-dp"), "must end in pp with parallel.ep=2"),
    (dict(dp=3, pp=2, ep=2), "parallel.ep=2 * parallel.etp=1 must divide the 3 ranks"),
    (dict(dp=2, ep=0), "parallel.ep=0 must be a positive integer"),
])
def test_expert_fold_refusals(kwargs, message):
    with pytest.raises(LayoutError, match=re.escape(message)):
        ParallelLayout(**kwargs)
    with pytest.raises(LayoutError, match="only with expert parallelism"):
        ParallelLayout(dp=2).groups("ep")
