"""Hanayo's waves: the placement, and the order's bubble and activations over a sweep of (pp, waves, microbatches).

The aim is (pp-1)/(2*W*m) at F=B=W; every case with m >= 2pp stays within (pp-1)/(W*m),
and every rank holds at most the activation cap (interleaved 1F1B's peak at 2W chunks).
"""

import pytest

from ppctl.resolve import compose_config
from ppctl.resolve.resolved import resolve
from ppctl.parallel.placement import v_placement, wave_placement
from ppctl.pipeline.check import check_schedule
from ppctl.pipeline.schedules import ScheduleError, build_schedule
from ppctl.pipeline.schedules.hanayo import activation_cap
from ppctl.pipeline.simulate import simulate


def test_the_waves_fold_the_stages_down_and_up_the_ranks():
    assert wave_placement(4, 1) == v_placement(4)
    assert wave_placement(2, 2).owners == (0, 1, 1, 0, 0, 1, 1, 0)
    assert wave_placement(3, 3).owners == (0, 1, 2, 2, 1, 0) * 3
    for pp in (1, 2, 5):
        for waves in (1, 2, 3):
            placement = wave_placement(pp, waves)
            assert placement.problem(pp, 2 * waves) is None and placement.copies == 1
            assert placement.first_stage_rank == placement.last_stage_rank == 0


def test_the_layout_takes_the_wave_placement_from_parallel_waves():
    config = compose_config(["schedule=hanayo", "parallel.pp=4", "parallel.waves=2", "model.num_layers=16"])
    assert config.parallel.vpp == 4
    layout = resolve(config).layout
    assert layout.placement == wave_placement(4, 2)
    assert layout.placement.embedding_pp_ranks == layout.placement.loss_pp_ranks == [0]


@pytest.mark.parametrize("pp", [2, 3, 4, 6, 8])
def test_bubble_within_twice_the_aim_and_activations_within_the_cap(pp):
    for waves in (1, 2, 3):
        for num_microbatches in (2 * pp, 3 * pp, 4 * pp):
            result = simulate(build_schedule("hanayo", pp, 2 * waves, num_microbatches))
            assert result.bubble_ratio <= (pp - 1) / (waves * num_microbatches) + 1e-9, (pp, waves, num_microbatches)
            assert max(rank.peak_activations for rank in result.ranks) <= activation_cap(pp, waves)


def test_the_aim_is_reached_where_the_waves_fill_evenly():
    """pp=4 with two waves: (pp-1)/(2*W*m) exactly, at 8 and 16 microbatches."""
    for num_microbatches in (8, 16):
        result = simulate(build_schedule("hanayo", 4, 4, num_microbatches))
        assert result.bubble_ratio == pytest.approx(3 / (4 * num_microbatches))


@pytest.mark.parametrize("pp", [1, 2, 3, 5])
def test_every_size_passes_the_checker(pp):
    for waves in (1, 2, 3):
        for num_microbatches in range(1, 3 * pp + 2):
            check_schedule(build_schedule("hanayo", pp, 2 * waves, num_microbatches))


def test_an_odd_chunk_count_is_refused():
    with pytest.raises(ScheduleError, match="vpp=3 must be 2 \\* parallel.waves"):
        build_schedule("hanayo", 2, 3, 4)
