"""The placement value: stage -> pp rank and model copies, its arithmetic, its one check, and that it is shared."""

import re

import pytest

from ppctl.resolve import compose_config
from ppctl.resolve.resolved import resolve
from ppctl.parallel.layout import ParallelLayout
from ppctl.parallel.placement import Placement, PlacementError, looped_placement, v_placement
from ppctl.pipeline.schedules import SCHEDULE_SPECS, build_schedule


# --- looped: stage s on rank s % pp, one copy ------------------------------------------------------

@pytest.mark.parametrize("pp", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("chunks_per_rank", [1, 2, 3])
def test_looped_placement_arithmetic(pp, chunks_per_rank):
    placement = looped_placement(pp, chunks_per_rank)
    num_stages = pp * chunks_per_rank
    assert placement.owners == tuple(stage % pp for stage in range(num_stages)) and placement.copies == 1
    assert placement.problem(pp, chunks_per_rank) is None
    assert placement.num_stages == placement.stages_per_copy == num_stages
    for stage in range(num_stages):
        assert placement.rank_of(stage) == placement[stage] == stage % pp
        assert placement.model_stage(stage) == stage and placement.copy_of(stage) == 0
        assert placement.chunk_of(stage) == stage // pp
    for pp_rank in range(pp):
        assert placement.stages_of(pp_rank) == tuple(range(pp_rank, num_stages, pp))
        assert placement.model_stages_of(pp_rank) == placement.stages_of(pp_rank)
    assert placement.stages_of(pp) == ()  # not a rank of this placement
    assert placement.first_stage_rank == 0 and placement.last_stage_rank == pp - 1
    assert placement.loss_pp_ranks == [pp - 1] and placement.embedding_pp_ranks == sorted({0, pp - 1})


# --- V: rank r holds stages r and 2pp-1-r -----------------------------------------------------------

@pytest.mark.parametrize("pp", [1, 2, 3, 4, 5])
def test_v_placement_arithmetic(pp):
    placement = v_placement(pp)
    assert placement.owners == tuple(range(pp)) + tuple(reversed(range(pp))) and placement.copies == 1
    assert placement.problem(pp, 2) is None
    assert placement.num_stages == placement.stages_per_copy == 2 * pp
    for pp_rank in range(pp):
        assert placement.stages_of(pp_rank) == (pp_rank, 2 * pp - 1 - pp_rank)
        assert placement.chunk_of(pp_rank) == 0 and placement.chunk_of(2 * pp - 1 - pp_rank) == 1
        assert placement.model_stages_of(pp_rank) == (pp_rank, 2 * pp - 1 - pp_rank)
    assert all(placement.copy_of(stage) == 0 for stage in range(2 * pp))
    # both ends of the model on rank 0
    assert placement.first_stage_rank == placement.last_stage_rank == 0
    assert placement.loss_pp_ranks == placement.embedding_pp_ranks == [0]


# --- DualPipe: the V read as two model copies -------------------------------------------------------

@pytest.mark.parametrize("pp", [2, 4, 6, 8])
def test_dualpipe_placement_arithmetic(pp):
    placement = v_placement(pp, copies=2)
    assert placement.owners == v_placement(pp).owners and placement.copies == 2
    assert placement != v_placement(pp)  # the copies are part of the value
    assert placement.problem(pp, 2) is None
    assert placement.num_stages == 2 * pp and placement.stages_per_copy == pp
    assert [placement.model_stage(stage) for stage in range(2 * pp)] == list(range(pp)) * 2
    assert [placement.copy_of(stage) for stage in range(2 * pp)] == [0] * pp + [1] * pp
    # copy 1 enters at rank pp-1: its model stage j runs on rank pp-1-j
    assert [placement.rank_of(pp + j) for j in range(pp)] == list(reversed(range(pp)))
    for pp_rank in range(pp):
        assert placement.model_stages_of(pp_rank) == tuple(sorted({pp_rank, pp - 1 - pp_rank}))
        assert placement.chunk_of(pp_rank) == 0 and placement.chunk_of(2 * pp - 1 - pp_rank) == 1
    # copy 0 reads tokens on rank 0 and computes its loss on rank pp-1; copy 1 the other way round
    assert placement.first_stage_rank == 0 and placement.last_stage_rank == 0
    assert placement.loss_pp_ranks == placement.embedding_pp_ranks == [0, pp - 1]


# --- a value: indexing, iteration, equality --------------------------------------------------------

def test_a_placement_reads_as_its_owners_and_compares_by_value():
    placement = Placement([0, 1, 0, 1])
    assert placement.owners == (0, 1, 0, 1)  # any sequence is kept as a tuple
    assert len(placement) == 4 and placement[2] == 0 and placement[-1] == 1
    assert list(placement) == [0, 1, 0, 1] and list(enumerate(placement))[3] == (3, 1)
    assert placement == looped_placement(2, 2) and hash(placement) == hash(looped_placement(2, 2))
    assert placement != Placement((0, 1, 0, 1), copies=2)
    with pytest.raises(AttributeError):
        placement.copies = 2  # frozen


@pytest.mark.parametrize("build", [lambda: looped_placement(0, 1), lambda: looped_placement(2, 0),
                                   lambda: v_placement(0)])
def test_constructors_refuse_bad_sizes(build):
    with pytest.raises(PlacementError, match="must both be at least 1"):
        build()


# --- the one check -----------------------------------------------------------------------------------

@pytest.mark.parametrize("placement, pp, chunks_per_rank, message", [
    (Placement((0, 1)), 0, 1, "pp=0 and chunks per rank=1 must both be at least 1"),
    (Placement(()), 2, 0, "pp=2 and chunks per rank=0 must both be at least 1"),
    (Placement((0, 1, 0)), 2, 2, "placement has 3 stages, expected pp\\*chunks_per_rank = 4"),
    (Placement((0, 2)), 2, 1, "stage 1 is placed on rank 2, outside 0..1"),
    (Placement((-1, 0)), 2, 1, "stage 0 is placed on rank -1, outside 0..1"),
    (Placement((0, 0)), 2, 1, "does not put 1 of 2 stages on each of 2 pp ranks: rank 0 holds 2 stages, "
                              "expected chunks_per_rank = 1"),
    (Placement((0, 0, 2, 2)), 3, 1, "placement has 4 stages"),
    (Placement((0, 0, 1, 1, 2, 2)), 3, 2, None),
    (Placement((0, 0, 2, 2, 2, 2)), 3, 2, "does not put 2 of 6 stages on each of 3 pp ranks: rank 1 holds 0 "
                                          "stages"),  # a rank left out holds no stage
    (Placement((0, 0, 2, 2, 0, 1)), 3, 2, "rank 0 holds 3 stages, expected chunks_per_rank = 2$"),
    (Placement((0, 1), copies=0), 2, 1, "copies=0 must be at least 1"),
    (Placement((0, 1, 2), copies=2), 3, 1, "3 pipeline stages cannot hold 2 model copies"),
    (Placement((0, 1, 2, 3), copies=2), 4, 1, "2 model copies do not divide chunks_per_rank=1"),
])
def test_problem_names_the_first_thing_wrong_in_one_line(placement, pp, chunks_per_rank, message):
    problem = placement.problem(pp, chunks_per_rank)
    if message is None:
        assert problem is None
    else:
        assert problem is not None and "\n" not in problem and re.search(message, problem), problem


# --- shared: the layout and the schedules hold one and the same value ------------------------------

def registry_cases():
    """(name, pp, vpp, microbatches) for each registry schedule, at sizes its rules allow."""
    for name, spec in SCHEDULE_SPECS.items():
        for pp in (2, 4):
            vpp = spec.chunks_per_rank or (2 if spec.multi_chunk else 1)
            yield name, pp, vpp, 4 * pp


@pytest.mark.parametrize("name, pp, vpp, num_microbatches", list(registry_cases()))
def test_layout_and_schedule_share_the_placement(name, pp, vpp, num_microbatches):
    spec = SCHEDULE_SPECS[name]
    schedule = build_schedule(name, pp, vpp, num_microbatches)
    config = compose_config([f"schedule={name}", f"parallel.pp={pp}", f"parallel.vpp={vpp}"])
    layout = resolve(config, check=False, layer_split=False).layout
    assert schedule.placement == spec.placement(pp, vpp) == layout.placement
    assert layout.placement.problem(pp, vpp) is None
    assert layout.placement.copies == (2 if name == "dualpipe" else 1)
    assert schedule.chunks_per_copy == vpp // layout.placement.copies
    # the layer map follows the same placement: each (rank, chunk) holds the stage the placement says
    for (pp_rank, chunk), stage in layout.layer_map(2 * pp * vpp).items():
        assert schedule.placement.stages_of(pp_rank)[chunk] == stage.stage
        assert schedule.placement.chunk_of(stage.stage) == chunk


def test_the_layout_refuses_a_placement_that_does_not_fit():
    from ppctl.parallel.layout import LayoutError

    with pytest.raises(LayoutError, match="does not put 1 of 2 stages on each of 2 pp ranks: rank 0 holds 2"):
        ParallelLayout(pp=2, placement=Placement((0, 0)))
    with pytest.raises(LayoutError, match="placement has 2 stages, expected pp\\*chunks_per_rank = 4"):
        ParallelLayout(pp=2, vpp=2, placement=looped_placement(2, 1))
