"""PipeDream-2BW's pipeline: its stream across steps, its rule, its refusals, its simulated steady state.

Costs are F=B=W=1 (a whole backward 2): 1F1B's step takes m(F+B+W) + (pp-1)(F+B+W); 2BW's
stream pays the fill and the drain once, so every step after the first takes m(F+B+W).
"""

import pytest

from ppctl.resolve import compose_config, validate
from ppctl.config.schema import ConfigError
from ppctl.pipeline.check import check_schedule
from ppctl.pipeline.schedules import ScheduleError, build_schedule, stream_of, streams_steps
from ppctl.pipeline.simulate import Costs, simulate_steps

UNIT = Costs(F=1, B=1, W=1)
TWO_BW = ["schedule=pipedream_2bw", "optimizer.gradient_delay=1", "optimizer.clip_grad=0"]


def test_the_stream_of_k_steps_is_1f1b_over_k_times_m_microbatches():
    stream = stream_of(build_schedule("pipedream_2bw", 4, 1, 8), 3)
    one_f_one_b = build_schedule("1f1b", 4, 1, 3 * 8)
    assert stream.actions == one_f_one_b.actions and stream.name == "pipedream_2bw"
    check_schedule(stream)
    assert streams_steps(stream) and not streams_steps(one_f_one_b)


@pytest.mark.parametrize("pp, num_microbatches", [(4, 3), (8, 7), (2, 1)])
def test_fewer_microbatches_than_pp_are_refused_with_the_rule(pp, num_microbatches):
    with pytest.raises(ScheduleError, match=f"num_microbatches={num_microbatches} must be at least pp={pp}"):
        build_schedule("pipedream_2bw", pp, 1, num_microbatches)


@pytest.mark.parametrize("pp", [2, 3, 4, 6, 8])
@pytest.mark.parametrize("per_pp", [1, 2, 3])
def test_after_the_first_step_a_stream_has_no_bubble(pp, per_pp):
    """The fill shows once: step k > 0 ends m(F+B+W) after step k-1, where 1F1B pays (pp-1)(F+B+W) more."""
    num_microbatches, steps = per_pp * pp, 3
    result = simulate_steps(build_schedule("pipedream_2bw", pp, 1, num_microbatches), steps, UNIT)
    work = 3 * num_microbatches
    first = work + 3 * (pp - 1)  # 1F1B's one step: the fill and the drain
    assert result.step_ends() == [first, first + work, first + 2 * work]
    assert result.steady_step() == (work, 0.0)
    assert result.weight_versions == 2
    flushed = simulate_steps(build_schedule("1f1b", pp, 1, num_microbatches), steps, UNIT)
    assert flushed.step_ends() == [first, 2 * first, 3 * first]
    assert flushed.steady_step() == (first, pytest.approx(3 * (pp - 1) / work))
    assert flushed.weight_versions == 1


def test_two_weight_versions_show_in_the_parameter_figures():
    from ppctl.pipeline.render import simulation_lines

    result = simulate_steps(build_schedule("pipedream_2bw", 4, 1, 8), 3, UNIT)
    lines = simulation_lines(result)
    assert "parameters per rank: 1/4 of the model, kept in 2 weight versions" in lines[-1]
    assert "3 steps, ending at 33, 57, 81 · after the first: 24 per step, bubble ratio 0.0% per step" in lines
    report = result.to_json()
    assert report["weight_versions"] == 2 and report["steady_bubble_ratio"] == 0.0 and report["steps"] == 3


@pytest.mark.parametrize("extra, fragment", [
    ([], "set optimizer.gradient_delay=1"),
    (["optimizer.clip_grad=1.0"], "clips by the global norm of every rank's gradients; set optimizer.clip_grad=0"),
    (["trainer.precision=fp16"], "fp16's loss scaling skips a step on any rank's overflow"),
    (["trainer.global_batch_size=2"], "num_microbatches=2 must be at least pp=4"),
    (["schedule.stream_steps=0"], "schedule.stream_steps=0 must be a positive integer"),
])
def test_configs_2bw_cannot_run_are_refused_in_one_line(extra, fragment):
    overrides = ["parallel.pp=4", *TWO_BW]
    if not extra:
        overrides = ["parallel.pp=4", "schedule=pipedream_2bw", "optimizer.clip_grad=0"]
    with pytest.raises(ConfigError, match=fragment.replace("(", r"\(").replace(")", r"\)")) as refused:
        validate(compose_config(overrides + extra))
    assert "\n" not in str(refused.value)


def test_a_valid_2bw_config_passes():
    validate(compose_config(["parallel.pp=4", *TWO_BW, "trainer.precision=bf16"]))
