"""``ppctl inspect-schedule``'s inputs (issue 46): ``--steps`` read in one line and bounded by the actions it asks
for, ``--cost`` finite and bounded, and a long ``--steps`` drawn in time linear in the steps."""

import pytest

from ppctl.cli.schedule_report import MAX_TIMELINE_ACTIONS, parse_steps, simulate_config, steps_problem
from ppctl.resolve import compose_config
from ppctl.resolve.resolved import resolve
from ppctl.pipeline.render import render_plain
from ppctl.pipeline.schedules import build_schedule
from ppctl.pipeline.simulate import Costs, simulate_steps


def test_steps_is_a_whole_number_from_one():
    assert parse_steps("3") == 3 and parse_steps(1) == 1  # Typer hands the default over as it is
    for text, said in (("0", "--steps 0: simulates at least 1 step"), ("-2", "--steps -2: simulates at least 1"),
                       ("abc", "--steps abc: not a whole number of steps"), ("1.5", "--steps 1.5: not a whole")):
        with pytest.raises(ValueError) as raised:
            parse_steps(text)
        assert str(raised.value).startswith(said) and str(raised.value).endswith("give --steps 1 or more")


def test_steps_are_bounded_by_the_actions_they_ask_to_simulate():
    schedule = build_schedule("1f1b", 2, 1, 8)  # 32 actions a step
    per_step = sum(map(len, schedule.actions))
    most = MAX_TIMELINE_ACTIONS // per_step
    assert steps_problem(schedule, most) is None
    said = steps_problem(schedule, 100_000)
    assert said == (f"--steps 100000: 100,000 steps of 1f1b at pp=2 are {100_000 * per_step:,} actions to simulate "
                    f"and draw, more than {MAX_TIMELINE_ACTIONS:,}; give --steps {most:,} or fewer (the time and "
                    "bubble per step settle after the first few)")


@pytest.mark.parametrize("cost, said", [
    ("F=nan", "--cost F=nan: F=nan is not a finite number from 0 to 1e+12"),
    ("F=inf", "--cost F=inf: F=inf is not a finite number"),
    ("F=1e308,B=1", "--cost F=1e308,B=1: F=1e308 is not a finite number"),
    ("F=1,W=-2", "--cost F=1,W=-2: W=-2 is not a finite number"),
])
def test_a_cost_that_is_not_a_finite_time_is_refused_naming_cost(cost, said):
    config = resolve(compose_config(["data=synthetic", "parallel.pp=2"]))
    with pytest.raises(ValueError) as raised:
        simulate_config(config, cost)
    assert str(raised.value).startswith(said), str(raised.value)


def test_the_largest_cost_allowed_keeps_a_long_timeline_finite():
    config = resolve(compose_config(["data=synthetic", "parallel.pp=2"]))
    result = simulate_config(config, "F=1e12,B=1e12,W=1e12,comm=1e12", steps=1000).result
    assert result.makespan < float("inf") and result.steady_step()[0] < float("inf")


@pytest.mark.timeout(60)
def test_a_long_run_of_steps_is_drawn_in_time_linear_in_the_steps():
    """10,000 steps of 1f1b at pp=2 (320,000 actions): seconds. The plain grid copied the rest of its columns after
    each action's start (quadratic: 5,000 steps took half a minute, 20,000 more than five)."""
    result = simulate_steps(build_schedule("1f1b", 2, 1, 8), 10_000, Costs())
    grid = render_plain(result.ranks)
    rows = [line for line in grid.splitlines() if line.startswith("rank ")]
    assert len(rows) == 2 and rows[0].split()[2:4] == ["F0", "F1"]
