"""``ppctl bench``'s pure parts (what it refuses, how blocks sum up) and the memory measurement it uses."""

import pytest
import torch

from ppctl.bench.rules import (BenchRequest, TORCH_SCHEDULE_CLASSES, bench_problem,
                               max_relative_difference, median_ratio, resolve_against)
from ppctl.cli.bench_report import different_work
from ppctl.resolve import compose_config
from ppctl.run.memory import StoragePeak, held_bytes, reachable_tensors, step_peak_bytes


def config_of(*overrides):
    return compose_config(["parallel.pp=2", "data=synthetic", *overrides])


def test_auto_is_plain_at_pp1_and_torch_otherwise():
    assert resolve_against("auto", 1) == "plain"
    assert resolve_against("auto", 4) == "torch"
    assert resolve_against("none", 1) == "none"


def test_every_torch_class_exists_in_torch():
    from torch.distributed import pipelining

    for name in TORCH_SCHEDULE_CLASSES.values():
        assert hasattr(pipelining, name), name


@pytest.mark.parametrize("overrides, against, words", [
    (["schedule=hanayo"], "torch", "no schedule class for schedule=hanayo"),
    (["parallel.dp=2"], "torch", "set parallel.dp=2 to 1"),
    (["parallel.tp=2", "parallel.cp=2"], "torch", "set parallel.tp=2, parallel.cp=2 to 1"),
    (["trainer.precision=bf16"], "torch", "trainer.precision=bf16"),
    (["model.tie_embeddings=true"], "torch", "model.tie_embeddings=true"),
    (["optimizer.gradient_delay=1"], "torch", "gradient_delay=1"),
    ([], "plain", "parallel.pp=2"),
    ([], "sideways", "choose one of"),
    ([], "eager", "set trainer.compile=true"),
    (["schedule=zbv", "trainer.compile=true"], "torch", "ScheduleZBVZeroBubble fails on compiled blocks"),
])
def test_refusals_name_the_setting(overrides, against, words):
    problem = bench_problem(config_of(*overrides), against, 2, 1)
    assert problem is not None and words in problem and "\n" not in problem


def test_accepted_comparisons():
    assert bench_problem(config_of(), "torch", 2, 1) is None
    assert bench_problem(config_of("schedule=zbv"), "torch", 2, 1) is None
    assert bench_problem(config_of("schedule=hanayo", "parallel.dp=2"), "none", 2, 1) is None
    assert bench_problem(compose_config(["parallel=single"]), "plain", 2, 1) is None
    assert "at least 1" in bench_problem(config_of(), "torch", 0, 1)
    # compiled against eager: ppctl on both sides, any layout and schedule
    assert bench_problem(config_of("schedule=hanayo", "parallel.tp=2", "trainer.compile=true"), "eager", 2, 1) is None
    # compiled on both sides where torch's class can run compiled blocks
    assert bench_problem(config_of("schedule=1f1b", "trainer.compile=true"), "torch", 2, 1) is None


def test_request_round_trip():
    request = BenchRequest("torch", 3, 2, ("bench/0_1f1b.yaml",))
    assert BenchRequest.from_json(request.to_json()) == request


def test_block_ratios_pair_blocks_and_take_the_median():
    ratio, per_block = median_ratio([1.0, 2.0, 3.0], [2.0, 2.0, 2.0])
    assert per_block == [0.5, 1.0, 1.5] and ratio == 1.0
    with pytest.raises(ValueError):
        median_ratio([1.0], [1.0, 2.0])


def test_loss_difference_and_refusal():
    assert max_relative_difference([2.0, 4.0], [2.0, 4.0]) == 0.0
    assert max_relative_difference([2.0, 4.0], [2.0, 5.0]) == pytest.approx(0.2)
    assert max_relative_difference([0.0], [0.0]) == 0.0
    same = {"schedule": "1f1b", "against": "torch", "loss_max_rel_diff": 1e-7, "loss_tolerance": 1e-4}
    assert different_work([same]) is None
    assert different_work([{**same, "loss_max_rel_diff": None}]) is None
    problem = different_work([same, {**same, "schedule": "zbv", "loss_max_rel_diff": 0.01}])
    assert "schedule=zbv" in problem and "not the same work" in problem


def test_measured_bubble_is_the_simulators_definition():
    from ppctl.pipeline.simulate import RankTimeline, TimedAction
    from ppctl.pipeline.trace import measured_makespan_and_bubble

    # the busiest rank computes 8 of a 12 ms makespan
    rows = [RankTimeline(0, [TimedAction("F", 0, 0, 0.0, 4.0), TimedAction("BW", 0, 0, 8.0, 12.0)], 1.0),
            RankTimeline(1, [TimedAction("F", 1, 0, 4.0, 6.0), TimedAction("BW", 1, 0, 6.0, 8.0)], 1.0)]
    assert measured_makespan_and_bubble(rows) == (12.0, 0.5)
    idle = [RankTimeline(0, [TimedAction("F", 0, 0, 0.0, 0.0)], 1.0)]
    assert measured_makespan_and_bubble(idle) == (0.0, 0.0)


def test_held_bytes_counts_each_storage_once():
    model = torch.nn.Linear(8, 4)  # 32 + 4 floats
    model(torch.ones(2, 8)).sum().backward()
    optimizer = torch.optim.AdamW(model.parameters())
    optimizer.step()  # exp_avg, exp_avg_sq (and a step counter each)
    view = model.weight[:2]  # a view of a held storage adds nothing
    parameters = 36 * 4
    held = held_bytes((model, optimizer, view))
    assert held >= parameters * 4  # weights, gradients, two moments
    assert held == held_bytes((model, optimizer)) and held < parameters * 4 + 64
    assert len(reachable_tensors([{"a": view}, (view,)])) == 1


def test_storage_peak_sees_what_a_step_holds_at_once():
    weight = torch.ones(64, 64, requires_grad=True)
    with StoragePeak([weight]) as tracker:
        first = weight * 2  # 16 KiB live
        second = first * 3  # 32 KiB live
        del first, second
        third = weight + 1  # 16 KiB: the peak stays
    assert tracker.peak_bytes == 2 * 64 * 64 * 4
    assert tracker.live_bytes == 64 * 64 * 4
    del third


def test_step_peak_adds_the_held_bytes():
    weight = torch.nn.Parameter(torch.ones(32, 32))

    def step():
        (weight * 2).sum().backward()  # a 4 KiB product and the gradient

    peak = step_peak_bytes(step, weight, "cpu")
    assert peak >= 32 * 32 * 4 * 2  # the weight, then at least the product or the gradient on top


def test_the_fit_takes_mean_action_times_and_optionally_the_time_between_them():
    from ppctl.pipeline.simulate import RankTimeline, TimedAction
    from ppctl.pipeline.trace import costs_from_measurement, overhead_per_action

    # rank 0: F 0-2, F 3-5 (1 ms between them untraced), waits 5-6, BW 6-10; rank 1: no gaps
    rows = [RankTimeline(0, [TimedAction("F", 0, 0, 0.0, 2.0), TimedAction("F", 0, 1, 3.0, 5.0),
                             TimedAction("BW", 0, 0, 6.0, 10.0)], 1.0, waits=[(5.0, 6.0)]),
            RankTimeline(1, [TimedAction("F", 1, 0, 0.0, 2.0), TimedAction("BW", 1, 0, 2.0, 6.0)], 1.0)]
    assert overhead_per_action(rows) == pytest.approx((1.0 / 3 + 0.0) / 2)
    plain = costs_from_measurement(rows, chunks_per_copy=1)
    assert (plain.F, plain.B, plain.W) == (2.0, 4.0, 0.0)  # a whole backward's time is B, its W 0
    charged = costs_from_measurement(rows, chunks_per_copy=2, include_overhead=True)
    assert charged.F == pytest.approx((2.0 + 1 / 6) * 2) and charged.B == pytest.approx((4.0 + 1 / 6) * 2)
