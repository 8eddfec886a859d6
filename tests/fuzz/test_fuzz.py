"""The composition fuzzer in CI: a fixed seed's few drawn configurations, each proven equal to one process.

CI proves seed 0's first three draws of four workers (one launch); ``make fuzz SEED=S N=N`` runs any number (``tests/fuzz/run.py``); a failure prints the seed and the ``ppctl
verify`` line that reproduces it. The draw itself is checked here too: the same seed draws the same
configurations, each valid, spread over world sizes and schedules.
"""

import pytest

from tests.fuzz.draw import drawn, world_size
from tests.fuzz.run import main, prove

pytestmark = [pytest.mark.dist, pytest.mark.timeout(600)]
CI_SEED, CI_COUNT, CI_WORLD = 0, 3, 4  # one launch of four workers


def test_a_seed_draws_the_same_valid_configurations_across_the_space():
    runs, _ = drawn(7, 12)
    assert drawn(7, 6)[0] == runs[:6]  # the same seed, the same draws in the same order
    assert len({world_size(overrides) for overrides in runs}) >= 2
    assert len({item for overrides in runs for item in overrides if item.startswith("schedule=")}) >= 4
    assert {world_size(overrides) for overrides in drawn(7, 3, world=4)[0]} == {4}


def test_the_ci_seeds_configurations_equal_one_process():
    runs, failures, _ = prove(CI_SEED, CI_COUNT, world=CI_WORLD)
    assert len(runs) == CI_COUNT
    assert not failures, "\n".join(f"{failure.what}\n  {failure.reproduce()}" for failure in failures)


@pytest.mark.parametrize("argv, says", [
    (["--count", "-1"], "argument --count: -1: draw at least 1 configuration (make fuzz N=1 or more)"),
    (["--count", "0"], "argument --count: 0: draw at least 1 configuration (make fuzz N=1 or more)"),
    (["--count", "2.5"], "argument --count: '2.5' is not a whole number (make fuzz N=)"),
    (["--seed", "-1"], "argument --seed: -1: a seed is 0 or more (random draws the same from -1 as from 1, which "
                       "failures would then name)"),
])
def test_a_count_or_seed_that_proves_nothing_is_refused_in_one_line(capsys, argv, says):
    # before: N=-1 drew nothing and said "0 drawn configurations proven", exit 0
    with pytest.raises(SystemExit) as ended:
        main(argv)
    error = capsys.readouterr().err.splitlines()[-1]
    assert ended.value.code == 2 and error == f"python -m tests.fuzz.run: error: {says}"
