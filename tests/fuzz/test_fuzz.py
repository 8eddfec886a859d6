"""The composition fuzzer in CI: a fixed seed's few drawn configurations, each proven equal to one process.

CI proves seed 0's first three draws of four workers (one launch); ``make fuzz SEED=S N=N`` runs any number (``tests/fuzz/run.py``); a failure prints the seed and the ``ppctl
verify`` line that reproduces it. The draw itself is checked here too: the same seed draws the same
configurations, each valid, spread over world sizes and schedules.
"""

import pytest

from tests.fuzz.draw import drawn, world_size
from tests.fuzz.run import prove

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
